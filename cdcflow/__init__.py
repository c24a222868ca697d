"""cdcflow: read Google Cloud Spanner change streams with a small Python dataflow DSL.

    import cdcflow as cf

    pipeline = cf.Pipeline("orders-to-files")
    (pipeline
     | cf.DetectPartitions(database="projects/p/instances/i/databases/shop",
                           stream="OrdersStream", start_at="now")
     | cf.ReadPartition(heartbeat="1s")
     | "no deletes" >> cf.Filter(lambda r: r.mod_type != "DELETE")
     | cf.WriteFiles("out/orders", format="jsonl"))

Importing this package is light: each name loads its module on first use (Spark and the Spanner
client only when a run needs them), so the command line can say a Ctrl-C while it loads in one
line.
"""

# No import at all when the package loads (typing's alone is milliseconds): the command
# line's window for a Ctrl-C it cannot yet say in one line stays as short as it can be.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from cdcflow.engine.listener import BatchStats, EngineListener, RunSummary
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
    from cdcflow.spanner.lookup import LookupRows
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
        WriteTables,
        plugin,
    )

__version__ = "0.1.0"

#: Where each public name lives.
_HOMES = {
    **dict.fromkeys(
        ["ChildPartition", "ChildPartitionsRecord", "ColumnType", "DataChangeRecord",
         "HeartbeatRecord", "JsonString", "Mod", "ModType", "PartitionEndRecord",
         "PartitionEventRecord", "PartitionStartRecord", "Timestamp", "ValueCaptureType"],
        "cdcflow.model"),
    **dict.fromkeys(["BatchStats", "EngineListener", "RunSummary"], "cdcflow.engine.listener"),
    "PCollection": "cdcflow.pipeline",
    "Pipeline": "cdcflow.pipeline",
    **dict.fromkeys(["ErrorPolicy", "Retry", "Skip", "Stop"], "cdcflow.policy"),
    "LookupRows": "cdcflow.spanner.lookup",
    **dict.fromkeys(
        ["Collect", "Consume", "DetectPartitions", "DoFn", "Filter", "FlatMap", "Map",
         "ParDo", "Print", "PTransform", "ReadChangeStream", "ReadPartition", "Sink",
         "WriteFiles", "WriteTables", "plugin"],
        "cdcflow.transforms"),
}


def __getattr__(name: str) -> "Any":
    home = _HOMES.get(name)
    if home is None:
        msg = f"module 'cdcflow' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(__import__(home, fromlist=[name]), name)
    globals()[name] = value  # the next use is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*__all__, *(n for n in globals() if n.startswith("__"))})


__all__ = [
    "BatchStats",
    "ChildPartition",
    "ChildPartitionsRecord",
    "Collect",
    "ColumnType",
    "Consume",
    "DataChangeRecord",
    "DetectPartitions",
    "DoFn",
    "EngineListener",
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
    "RunSummary",
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
