-- The shop database of the quick start and the demo (GoogleSQL), as cdcflow.workload
-- creates it: cdcflow emulator start --database shop --ddl-file examples/shop.sql
CREATE TABLE Orders (OrderId INT64 NOT NULL, Customer STRING(MAX), Status STRING(16), Quantity INT64, Price FLOAT64, Details JSON) PRIMARY KEY (OrderId);
CREATE CHANGE STREAM OrdersStream FOR Orders OPTIONS (value_capture_type = 'OLD_AND_NEW_VALUES', retention_period = '1d');
