"""The public facade: every name in __all__ exists, and importing cdcflow stays light."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def _loaded_after(code: str) -> list[str]:
    heavy = "{'pyspark', 'google', 'grpc', 'pyarrow', 'fsspec'}"
    code += f"; import sys; print(sorted({{m.split('.')[0] for m in sys.modules}} & {heavy}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return list(eval(out.stdout.strip()))


def test_import_does_not_load_spark_the_spanner_client_or_pyarrow() -> None:
    assert _loaded_after("import cdcflow") == []


def test_import_loads_each_name_s_module_on_first_use() -> None:
    code = ("import sys, cdcflow; before = sorted(m for m in sys.modules if m.startswith("
            "'cdcflow.')); cdcflow.Timestamp; after = sorted(m for m in sys.modules if "
            "m.startswith('cdcflow.')); print(before, after, 'Pipeline' in dir(cdcflow))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("] ")
    assert out[0] == "[" and "'cdcflow.model'" in out[1]
    assert "cdcflow.pipeline" not in out[1] and out[2].strip() == "True"
    from cdcflow import Pipeline
    from cdcflow.pipeline import Pipeline as home

    assert Pipeline is home is cdcflow.Pipeline
    try:
        cdcflow.Nothing  # noqa: B018
    except AttributeError as e:
        assert str(e) == "module 'cdcflow' has no attribute 'Nothing'"
    else:
        raise AssertionError("cdcflow.Nothing did not raise AttributeError")
def test_a_run_without_typed_rows_does_not_load_pyarrow(tmp_path: Path) -> None:
    pipeline = (
        "import cdcflow as cf, cdcflow.testing as t; "
        "s = t.ScriptedChangeStream('Orders', origin=10**18); "
        "s.write('Orders', {'id': 1}, 'INSERT', {'total': 5}, at=10**18 + 1000); "
        "p = cf.Pipeline('x'); "
        "p | cf.ReadChangeStream(stream='Orders', start_at=10**18, end_at=10**18 + 10**9, "
        "client=s) | cf.Map(lambda r: {'t': r.table_name}) "
        f"| cf.WriteFiles({str(tmp_path)!r}, format='jsonl'); "
        "t.run(p)"
    )
    assert _loaded_after(pipeline) == []
    assert [f.suffix for f in tmp_path.glob("*.jsonl")] == [".jsonl"]


def test_typed_rows_load_pyarrow_on_first_use() -> None:
    assert _loaded_after("import cdcflow; cdcflow.WriteTables") == ["fsspec", "pyarrow"]
    assert _loaded_after("from cdcflow.transforms import Rows") == ["pyarrow"]
