"""Render a pipeline's DAG as an indented text tree or as Graphviz DOT (``cdcflow graph``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import networkx as nx

from cdcflow.transforms.base import PrimitiveTransform

__all__ = ["FORMATS", "describe"]


class _Dag(Protocol):
    """What rendering reads of a pipeline (cdcflow.dag.Dag)."""

    name: str
    graph: nx.DiGraph

    def nodes(self) -> Iterator[tuple[str, PrimitiveTransform[Any, Any]]]: ...

    def transform(self, label: str) -> PrimitiveTransform[Any, Any]: ...

    def upstream(self, label: str) -> str | None: ...

    def downstream(self, label: str) -> list[str]: ...

FORMATS = ("text", "dot")

_SHAPES = {"Source": "cylinder", "Read": "ellipse", "ParDo": "box", "Sink": "box3d"}


def describe(pipeline: _Dag, format: str = "text") -> str:
    """The DAG of ``pipeline``: ``"text"`` (an indented tree, one line per transform, in
    topological order, each branch indented under the step it reads from) or ``"dot"``
    (a Graphviz digraph; render with ``dot -Tsvg``). The output ends with a newline."""
    if format == "text":
        return _text(pipeline)
    if format == "dot":
        return _dot(pipeline)
    msg = f"unknown graph format {format!r}: use one of {'|'.join(FORMATS)}"
    raise ValueError(msg)


def _summary(transform: PrimitiveTransform[Any, Any]) -> str:
    params = transform.describe_params()
    return f"{type(transform).__name__}: {params}" if params else type(transform).__name__


def _text(pipeline: _Dag) -> str:
    lines = [f"pipeline {pipeline.name!r}"]
    if pipeline.graph.number_of_nodes() == 0:
        return lines[0] + " (empty)\n"

    # Every node has at most one input, so the DAG is a forest; a pre-order walk is a
    # topological order that keeps each branch under the step it reads from.
    def walk(label: str, prefix: str, last: bool) -> None:
        lines.append(f"{prefix}{'└─ ' if last else '├─ '}{label}  "
                     f"({_summary(pipeline.transform(label))})")
        children = pipeline.downstream(label)
        for i, child in enumerate(children):
            walk(child, prefix + ("   " if last else "│  "), i == len(children) - 1)

    roots = [label for label, _ in pipeline.nodes() if pipeline.upstream(label) is None]
    for i, root in enumerate(roots):
        walk(root, "", i == len(roots) - 1)
    return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    """A DOT double-quoted string: backslashes and quotes escaped, newlines as DOT's \\n."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\r\n", "\\n").replace("\n", "\\n").replace("\r", "\\n") + '"'


def _dot(pipeline: _Dag) -> str:
    ids: dict[str, int] = {}
    out = [f"digraph {_quote(pipeline.name)} {{", "  rankdir=TB;", "  node [fontname=Helvetica];"]
    for i, (label, transform) in enumerate(pipeline.nodes()):
        ids[label] = i
        text = f"{label}\n{_summary(transform)}"
        shape = _SHAPES.get(transform.kind, "box")
        out.append(f"  n{i} [label={_quote(text)}, shape={shape}];")
    for src, dst in sorted((ids[s], ids[d]) for s, d in pipeline.graph.edges()):
        out.append(f"  n{src} -> n{dst};")
    out.append("}")
    return "\n".join(out) + "\n"
