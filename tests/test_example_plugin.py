"""The example plugin package (examples/plugin), found through its entry points.

`make venv` installs it (``pip install -e examples/plugin``); these tests fail, not skip,
when it is missing, because the plugin mechanism is what they check.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import cdcflow as cf
from cdcflow.plugins import available, list_plugins, load_plugin
from cdcflow.transforms import Map, plugin
from cdcflow.transforms.base import SinkContext, WriterContext


@pytest.fixture(autouse=True)
def _installed() -> None:
    names = available("cdcflow.sinks")
    assert "counting" in names, (
        f"the example plugin is not installed (sinks: {names}): "
        "run `.venv/bin/pip install -e examples/plugin` (make venv does it)"
    )


def test_entry_points_are_registered_by_the_distribution() -> None:
    ours = {
        (i.group, i.name): i for i in list_plugins(load=False)
        if i.distribution == "cdcflow-example-plugin"
    }
    assert set(ours) == {("cdcflow.transforms", "project_columns"), ("cdcflow.sinks", "counting")}
    assert ours["cdcflow.sinks", "counting"].value == "cdcflow_example_plugin:CountingSink"
    sink_cls = load_plugin("cdcflow.sinks", "counting")
    assert issubclass(sink_cls, cf.Sink)


def to_row(r: dict[str, object]) -> dict[str, object]:
    return r


def test_plugins_compose_into_a_valid_pipeline() -> None:
    p = cf.Pipeline("orders")
    (
        p
        | cf.DetectPartitions(database="projects/p/instances/i/databases/shop", stream="Orders")
        | cf.ReadPartition()
        | Map(to_row)
        | plugin("project_columns", "id", "total")
        | plugin("counting", "out/counts")
    )
    p.validate()
    labels = [label for label, _ in p.nodes()]
    assert labels[-2:] == ["ProjectColumns(id, total)", "CountingSink"]
    assert "(CountingSink: directory=out/counts)" in p.describe()
    assert p.transform("ProjectColumns(id, total)").kind == "ParDo"


def test_plugin_transform_and_sink_deliver_one_batch(tmp_path: Path) -> None:
    project = plugin("project_columns", "id")
    sink = plugin("counting", "counts")
    assert isinstance(sink, cf.Sink)
    sink.setup(SinkContext("orders", "CountingSink", str(tmp_path)))
    rows = [{"id": 1, "x": "a"}, {"id": 2, "x": "b"}]
    assert isinstance(project, cf.ParDo)
    projected = [y for r in rows for y in project.fn.process(r)]
    assert projected == [{"id": 1}, {"id": 2}]
    writer = sink.open_writer(WriterContext("orders", "CountingSink", 7, "t", 0, 5, "a1"))
    for row in projected:
        writer.write(row)
    message = writer.close()
    sink.commit(7, [message])
    sink.commit(7, [message])  # replay after a crash before the store commit
    assert (tmp_path / "counts" / "batch-000000000007.count").read_text() == "2\n"
