"""The README's code runs as written: its test example passes under pytest, and its pipeline
file loads and validates."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from cdcflow.loader import load_pipeline

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def python_block(first_line: str) -> str:
    """The README's one ```python block that starts with ``first_line``."""
    blocks = [b for b in _BLOCK.findall(README.read_text()) if b.startswith(first_line + "\n")]
    assert len(blocks) == 1, f"expected one python block starting {first_line!r}"
    return blocks[0]


def test_testing_section_example_passes_under_pytest(tmp_path: Path) -> None:
    section = README.read_text().split("## Testing your pipeline", 1)[1].split("\n## ", 1)[0]
    code = python_block("# test_orders.py")
    assert code in section  # the block run here is the one the section shows
    (tmp_path / "test_orders.py").write_text(code)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_orders.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


def test_pipeline_example_loads_and_validates(tmp_path: Path) -> None:
    path = tmp_path / "pipeline.py"
    path.write_text(python_block("# pipeline.py"))
    pipeline = load_pipeline(path)
    pipeline.validate()
    assert list(pipeline.graph) == [
        "ReadChangeStream/DetectPartitions", "ReadChangeStream/ReadPartition", "no deletes",
        "as rows", "WriteFiles",
    ]


def test_consume_example_calls_fn_once_per_changed_row(tmp_path: Path) -> None:
    # A record holds every row its transaction changed in the table: the example splits
    # it into rows, each keyed by its own order id and idempotency key.
    from cdcflow.testing import ScriptedChangeStream

    code = python_block("# notify.py")
    sent: list[tuple[int, str]] = []
    namespace: dict[str, object] = {"send": lambda order_id, key: sent.append((order_id, key))}
    exec(compile(code, "notify.py", "exec"), namespace)  # the README's code
    rows, notify, order_id = namespace["rows"], namespace["notify"], namespace["order_id"]
    t0 = 1_700_000_000 * 10**9
    stream = ScriptedChangeStream("OrdersStream", origin=t0)
    with stream.transaction(at=t0 + 10**9) as tx:
        for oid in (1, 2, 3):
            tx.write("Orders", {"OrderId": oid}, "INSERT", {"Total": oid})
    (record,) = stream.expected_records(t0, t0 + 2 * 10**9)
    assert len(record.mods) == 3
    for row in rows(record):  # type: ignore[operator]
        assert order_id(row) == row[0].mods[row[1]].keys["OrderId"]  # type: ignore[operator]
        notify(row)  # type: ignore[operator]
    assert sorted(oid for oid, _ in sent) == [1, 2, 3]
    assert len({key for _, key in sent}) == 3  # one idempotency key per row
