"""The example plugin's transform and sink, used directly."""

from __future__ import annotations

from pathlib import Path

import pytest
from cdcflow_example_plugin import CountingSink, ProjectColumns

from cdcflow.transforms.base import SinkContext, WriterContext


def test_project_columns_keeps_the_named_columns_in_order() -> None:
    t = ProjectColumns("total", "id")
    out = list(t.fn.process({"id": 1, "total": 9, "note": "x"}))
    assert out == [{"total": 9, "id": 1}]
    assert list(out[0]) == ["total", "id"]
    assert list(t.fn.process({"id": 2})) == [{"id": 2}]
    assert t.default_label() == "ProjectColumns(total, id)"
    assert t.describe_params() == "columns=total,id"


def test_project_columns_needs_columns_and_dict_rows() -> None:
    with pytest.raises(TypeError, match="name one or more columns"):
        ProjectColumns()
    with pytest.raises(TypeError, match="after a Map that turns records into dicts"):
        list(ProjectColumns("id").fn.process(("not", "a", "dict")))  # type: ignore[arg-type]


def _write(sink: CountingSink, batch_id: int, sizes: list[int]) -> list[int]:
    """The batch's commit messages as the engine passes them (None left out)."""
    messages = []
    for i, size in enumerate(sizes):
        ctx = WriterContext("p", "count", batch_id, f"token-{i}", 0, 10, f"attempt-{i}")
        writer = sink.open_writer(ctx)
        for n in range(size):
            writer.write({"n": n})
        message = writer.close()
        if message is not None:
            messages.append(message)
    return messages


def test_counting_sink_counts_each_batch_once(tmp_path: Path) -> None:
    sink = CountingSink("counts")
    sink.setup(SinkContext("p", "count", str(tmp_path)))
    sink.commit(1, _write(sink, 1, [3, 0, 2]))
    sink.commit(2, _write(sink, 2, [0, 0]))  # empty batch: no file
    messages = _write(sink, 3, [4])
    sink.commit(3, messages)
    sink.commit(3, messages)  # a replayed commit of the same batch changes nothing
    files = sorted(p.name for p in (tmp_path / "counts").iterdir())
    assert files == ["batch-000000000001.count", "batch-000000000003.count"]
    assert (tmp_path / "counts" / "batch-000000000001.count").read_text() == "5\n"
    assert sink.total() == 9


def test_aborted_writer_counts_nothing(tmp_path: Path) -> None:
    sink = CountingSink(tmp_path / "abs")
    sink.setup(SinkContext("p", "count", "/elsewhere"))  # an absolute directory stays as is
    writer = sink.open_writer(WriterContext("p", "count", 1, "t", 0, 1, "a"))
    writer.write("x")
    writer.abort()
    sink.commit(1, [writer.close()])
    assert sink.total() == 0
    assert sink.describe_params() == f"directory={tmp_path / 'abs'}"
