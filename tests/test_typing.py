"""The DSL's generics under mypy: element types flow through ``|``, and mistakes are rejected.

mypy runs (through its API) on two snippet files at once: one that must type-check under
``--strict``, with ``assert_type`` pinning what ``pcoll | Map(f)`` and friends infer, and
one whose every marked line must be reported. Errors inside cdcflow itself are not this
test's business (``mypy --strict cdcflow`` checks them), so imports are followed silently.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from mypy import api

import cdcflow

REPO = Path(cdcflow.__file__).resolve().parents[1]

_PRELUDE = """\
from collections.abc import Iterable, Sequence
from typing import Any, assert_type

import cdcflow as cf
from cdcflow.model import DataChangeRecord
from cdcflow.transforms import Collect, DetectPartitions, Filter, FlatMap, Map, ReadPartition
from cdcflow.transforms.base import DoFn, ParDo, PCollection, Sink, SinkWriter, WriterContext


def to_row(r: DataChangeRecord, scale: int = 1) -> dict[str, int]:
    return {"mods": len(r.mods) * scale}


def amounts(row: dict[str, int]) -> Iterable[int]:
    return row.values()


class Count:
    def __init__(self) -> None:
        self.n = 0

    def write(self, element: object) -> None:
        self.n += 1

    def close(self) -> int | None:
        return self.n or None

    def abort(self) -> None:
        self.n = 0


class CountSink(Sink[Any, int]):
    def open_writer(self, ctx: WriterContext) -> SinkWriter[Any, int]:
        return Count()

    def commit(self, batch_id: int, messages: Sequence[int]) -> None:
        print(batch_id, sum(messages))


pipeline = cf.Pipeline("typed")
records = (
    pipeline
    | DetectPartitions(database="projects/p/instances/i/databases/d", stream="S")
    | ReadPartition()
)
"""

_GOOD = """\
assert_type(records, PCollection[DataChangeRecord])
kept = records | Filter(lambda r: r.mod_type != "DELETE")
assert_type(kept, PCollection[DataChangeRecord])
rows = kept | "rows" >> Map(to_row, 10)
assert_type(rows, PCollection[dict[str, int]])
rows_kw = kept | Map(to_row, scale=2)
assert_type(rows_kw, PCollection[dict[str, int]])
numbers = rows | FlatMap(amounts)
assert_type(numbers, PCollection[int])
text = numbers | Map(lambda n: f"{n:05d}")
assert_type(text, PCollection[str])
big = numbers | Filter(lambda n, floor: n > floor, 3)
assert_type(big, PCollection[int])


class Halve(DoFn[int, float]):
    def process(self, element: int) -> Iterable[float]:
        yield element / 2


halves = numbers | ParDo(Halve())
assert_type(halves, PCollection[float])
out: Collect[str] = Collect()
done = text | out
assert_type(done, PCollection[None])
assert_type(out.items, list[str])
big | CountSink()
"""

# Every line ending in "# E: <code>" must be reported with that error code, and nothing else.
_BAD = """\
numbers = records | Map(to_row) | FlatMap(amounts)
numbers | Map(to_row)  # E: arg-type
records | Map(to_row, "ten")  # E: arg-type
records | Map(to_row, 1, 2, 3)  # E: call-arg
texts: PCollection[str] = numbers  # E: assignment
strings: Collect[str] = Collect()
numbers | strings  # E: operator
numbers | Filter(lambda n: n.mod_type)  # E: attr-defined


class Wrong(CountSink):
    def commit(self, batch_id: int, messages: Sequence[str]) -> None:  # E: override
        print(messages)


class Text:
    def write(self, element: object) -> None: ...
    def close(self) -> str: return ""
    def abort(self) -> None: ...


class WrongWriter(CountSink):
    def open_writer(self, ctx: WriterContext) -> SinkWriter[Any, int]:
        return Text()  # E: return-value
"""

_ERROR = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")


def _expected(source: str) -> set[tuple[int, str]]:
    marks = re.compile(r"# E: ([a-z-]+)$")
    return {
        (n, m.group(1))
        for n, line in enumerate(source.splitlines(), start=1)
        if (m := marks.search(line))
    }


def test_mypy_infers_element_types_and_rejects_mismatches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text(_PRELUDE + textwrap.dedent(_GOOD))
    bad_source = _PRELUDE + textwrap.dedent(_BAD)
    bad.write_text(bad_source)
    # cdcflow is installed in editable mode through an import hook mypy cannot follow:
    # check from the source tree, with the project's own mypy settings.
    monkeypatch.chdir(REPO)
    stdout, stderr, _ = api.run([
        "--strict",
        "--config-file", str(REPO / "pyproject.toml"),
        "--cache-dir", str(tmp_path / "cache"),
        "--follow-imports", "silent",
        "--hide-error-context",
        "--no-pretty",
        "--show-error-codes",
        str(good),
        str(bad),
    ])
    assert not stderr, stderr
    errors = [m for line in stdout.splitlines() if (m := _ERROR.match(line))]
    unparsed = [
        line for line in stdout.splitlines()
        if ": error:" in line and not _ERROR.match(line)
    ]
    assert not unparsed, stdout
    in_good = [m.group(0) for m in errors if Path(m["file"]).name == "good.py"]
    assert in_good == [], stdout
    in_bad = {(int(m["line"]), m["code"]) for m in errors if Path(m["file"]).name == "bad.py"}
    expected = _expected(bad_source)
    assert len(expected) == 8
    assert in_bad == expected, stdout
