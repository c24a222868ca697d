"""The public facade: every name in __all__ exists, and importing cdcflow stays light."""

from __future__ import annotations

import subprocess
import sys

import cdcflow
import cdcflow.transforms


def test_all_names_exist() -> None:
    for module in (cdcflow, cdcflow.transforms):
        missing = [name for name in module.__all__ if not hasattr(module, name)]
        assert missing == [], f"{module.__name__}.__all__ names missing attributes: {missing}"


def test_facade_exports_the_dsl() -> None:
    assert {"Pipeline", "Map", "FlatMap", "Filter", "DetectPartitions", "ReadPartition",
            "WriteFiles", "Collect", "Print", "Timestamp", "ErrorPolicy"} <= set(cdcflow.__all__)
    assert cdcflow.__version__ == "0.1.0"


def test_import_does_not_load_spark_or_the_spanner_client() -> None:
    code = (
        "import sys, cdcflow; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'pyspark', 'google', 'grpc'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
