"""cdcflow: read Google Cloud Spanner change streams with a small Python dataflow DSL.

    import cdcflow as cf

    pipeline = cf.Pipeline("orders-to-files")
    (pipeline
     | cf.DetectPartitions(database="projects/p/instances/i/databases/shop",
                           stream="OrdersStream", start_at="now")
     | cf.ReadPartition(heartbeat="1s")
     | "no deletes" >> cf.Filter(lambda r: r.mod_type != "DELETE")
     | cf.WriteFiles("out/orders", format="jsonl"))

Importing this package is light: Spark and the Spanner client load only when a run needs them.
"""

from typing import TYPE_CHECKING, Any

from cdcflow.model import (
    ChildPartition,
    ChildPartitionsRecord,
    ColumnType,
    DataChangeRecord,
    HeartbeatRecord,
    JsonString,
    Mod,
    ModType,
    PartitionEndRecord,
    PartitionEventRecord,
    PartitionStartRecord,
    Timestamp,
    ValueCaptureType,
)
from cdcflow.pipeline import PCollection, Pipeline
from cdcflow.policy import ErrorPolicy, Retry, Skip, Stop
from cdcflow.transforms import (
    Collect,
    Consume,
    DetectPartitions,
    DoFn,
    Filter,
    FlatMap,
    Map,
    ParDo,
    Print,
    PTransform,
    ReadChangeStream,
    ReadPartition,
    Sink,
    WriteFiles,
    plugin,
)

if TYPE_CHECKING:
    from cdcflow.spanner.lookup import LookupRows
    from cdcflow.transforms import WriteTables

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Loaded on first use, so `import cdcflow` loads no Google library and no pyarrow.
    if name == "LookupRows":
        from cdcflow.spanner.lookup import LookupRows

        return LookupRows
    if name == "WriteTables":
        from cdcflow import transforms

        return transforms.WriteTables
    msg = f"module 'cdcflow' has no attribute {name!r}"
    raise AttributeError(msg)


__all__ = [
    "ChildPartition",
    "ChildPartitionsRecord",
    "Collect",
    "ColumnType",
    "Consume",
    "DataChangeRecord",
    "DetectPartitions",
    "DoFn",
    "ErrorPolicy",
    "Filter",
    "FlatMap",
    "HeartbeatRecord",
    "JsonString",
    "LookupRows",
    "Map",
    "Mod",
    "ModType",
    "PCollection",
    "PTransform",
    "ParDo",
    "PartitionEndRecord",
    "PartitionEventRecord",
    "PartitionStartRecord",
    "Pipeline",
    "Print",
    "ReadChangeStream",
    "ReadPartition",
    "Retry",
    "Sink",
    "Skip",
    "Stop",
    "Timestamp",
    "ValueCaptureType",
    "WriteFiles",
    "WriteTables",
    "__version__",
    "plugin",
]
