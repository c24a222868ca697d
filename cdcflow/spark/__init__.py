"""Apache Spark: the Spark runner and Spark sinks. The only package that imports pyspark."""
