"""Pipeline.describe(): the text tree and Graphviz DOT."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest

import cdcflow as cf
from cdcflow.graphviz import describe
from cdcflow.transforms.base import SinkWriter, WriterContext


class Out(cf.Sink):
    def __init__(self, path: str) -> None:
        self.path = path

    def describe_params(self) -> str:
        return f"path={self.path}"

    def open_writer(self, ctx: WriterContext) -> SinkWriter:
        raise AssertionError("graph tests never run a sink")

    def commit(self, batch_id: int, messages: Sequence[Any]) -> None:
        raise AssertionError("graph tests never run a sink")


def to_row(r: Any) -> Any:
    return r


def branching() -> cf.Pipeline:
    p = cf.Pipeline("orders")
    rows = (
        p
        | cf.DetectPartitions(database="projects/p/instances/i/databases/shop", stream="Orders")
        | cf.ReadPartition(heartbeat="500ms")
        | "rows" >> cf.Map(to_row)
    )
    rows | "keep" >> cf.Filter(bool) | "files" >> Out("out/a")
    rows | "audit" >> Out("out/b")
    return p


def test_text_is_an_indented_tree_with_branches() -> None:
    assert branching().describe() == (
        "pipeline 'orders'\n"
        "└─ DetectPartitions  (DetectPartitions: projects/p/instances/i/databases/shop"
        " stream=Orders start_at=now)\n"
        "   └─ ReadPartition  (ReadPartition: heartbeat=500ms max_inflight=1)\n"
        "      └─ rows  (Map: fn=to_row)\n"
        "         ├─ audit  (Out: path=out/b)\n"
        "         └─ keep  (Filter: fn=bool)\n"
        "            └─ files  (Out: path=out/a)\n"
    )


def test_text_lists_every_node_after_its_input() -> None:
    p = branching()
    lines = p.describe("text").splitlines()[1:]
    order = [re.sub(r"^[│├└─ ]+", "", line).split("  (")[0] for line in lines]
    assert sorted(order) == sorted(p.graph.nodes)
    for label in order:
        up = p.upstream(label)
        assert up is None or order.index(up) < order.index(label)


def test_text_of_an_empty_pipeline() -> None:
    assert cf.Pipeline("x").describe() == "pipeline 'x' (empty)\n"


# A strict reader for the DOT subset describe() writes: quoted IDs/labels, node statements
# with attributes, edges. It fails on anything else, so unescaped quotes break the test.
_QUOTED = r'"(?:[^"\\\n]|\\.)*"'
_LINE = re.compile(
    rf"^(?:digraph (?P<name>{_QUOTED}) \{{"
    rf"|  rankdir=TB;|  node \[fontname=Helvetica\];"
    rf"|  (?P<node>n\d+) \[label=(?P<label>{_QUOTED}), shape=(?P<shape>[a-z0-9]+)\];"
    rf"|  (?P<src>n\d+) -> (?P<dst>n\d+);"
    rf"|\}})$"
)


def _unquote(text: str) -> str:
    body = text[1:-1]
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), body)


def parse_dot(dot: str) -> tuple[str, dict[str, tuple[str, str]], list[tuple[str, str]]]:
    lines = dot.splitlines()
    assert dot.endswith("}\n") and lines[-1] == "}"
    name = ""
    nodes: dict[str, tuple[str, str]] = {}
    edges: list[tuple[str, str]] = []
    for line in lines:
        m = _LINE.match(line)
        assert m, f"not valid DOT for describe(): {line!r}"
        if m["name"]:
            name = _unquote(m["name"])
        if m["node"]:
            nodes[m["node"]] = (_unquote(m["label"]), m["shape"])
        if m["src"]:
            assert m["src"] in nodes and m["dst"] in nodes  # nodes are declared before edges
            edges.append((m["src"], m["dst"]))
    return name, nodes, edges


def test_dot_has_every_node_and_edge() -> None:
    p = branching()
    name, nodes, edges = parse_dot(p.describe("dot"))
    assert name == "orders"
    by_label = {label.split("\n")[0]: (node, shape) for node, (label, shape) in nodes.items()}
    assert set(by_label) == set(p.graph.nodes)
    assert by_label["DetectPartitions"][1] == "cylinder"
    assert by_label["files"][1] == "box3d"
    got = {(_label(nodes, s), _label(nodes, d)) for s, d in edges}
    assert got == set(p.graph.edges)
    assert nodes[by_label["rows"][0]][0] == "rows\nMap: fn=to_row"


def _label(nodes: dict[str, tuple[str, str]], node: str) -> str:
    return nodes[node][0].split("\n")[0]


@pytest.mark.parametrize("label", ['say "hi"', "back\\slash", 'end\\', "two\nlines", "{x};[y]"])
def test_dot_quotes_labels_safely(label: str) -> None:
    q = cf.Pipeline("q")
    rows = (
        q
        | cf.DetectPartitions(database="projects/p/instances/i/databases/shop", stream="Orders")
        | cf.ReadPartition()
    )
    rows | label >> Out(label)
    _, nodes, _ = parse_dot(q.describe("dot"))
    assert f"{label}\nOut: path={label}" in {text for text, _ in nodes.values()}


def test_unknown_format_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'svg'.*text\|dot"):
        describe(branching(), "svg")
