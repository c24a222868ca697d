"""An example cdcflow plugin: one transform and one sink, registered by entry points.

- ``ProjectColumns(*columns)``: a ParDo keeping only ``columns`` of dict rows.
- ``CountingSink(directory)``: writes how many elements each batch delivered to
  ``directory/batch-<id>.count``. ``commit`` is idempotent per batch id (the file is
  replaced atomically with the same count when a batch is replayed), so counts are exact.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cdcflow.transforms import DoFn, ParDo, Sink
from cdcflow.transforms.base import SinkContext, WriterContext

__all__ = ["CountingSink", "ProjectColumns"]


class _Project(DoFn[dict[str, Any], dict[str, Any]]):
    def __init__(self, columns: tuple[str, ...]) -> None:
        self.columns = columns

    def process(self, element: dict[str, Any]) -> Iterable[dict[str, Any]]:
        # Pipelines are not type-checked when they run: a record reaching here by mistake
        # gets a message naming the fix rather than a KeyError.
        if not isinstance(element, Mapping):
            msg = (
                f"ProjectColumns takes dict rows, got a {type(element).__name__}: "
                "apply it after a Map that turns records into dicts"
            )
            raise TypeError(msg)
        # A missing column is left out: an UPDATE's new values hold only changed columns.
        return ({c: element[c] for c in self.columns if c in element},)


class ProjectColumns(ParDo[dict[str, Any], dict[str, Any]]):
    """Keep only ``columns`` of every dict row (in the order given)."""

    def __init__(self, *columns: str) -> None:
        if not columns or not all(isinstance(c, str) and c for c in columns):
            msg = f"ProjectColumns{columns!r}: name one or more columns, e.g. ProjectColumns('id')"
            raise TypeError(msg)
        super().__init__(_Project(columns))
        self.columns = columns

    def default_label(self) -> str:
        return f"ProjectColumns({', '.join(self.columns)})"

    def describe_params(self) -> str:
        return "columns=" + ",".join(self.columns)


class _CountingWriter:
    def __init__(self) -> None:
        self.count = 0

    def write(self, element: Any) -> None:
        self.count += 1

    def close(self) -> int:
        return self.count

    def abort(self) -> None:
        self.count = 0


class CountingSink(Sink[Any, int]):
    """Count each batch's elements into ``directory/batch-<id>.count``.

    A relative ``directory`` resolves against the pipeline file's directory. Batches
    without elements write no file. :meth:`total` sums every committed batch.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)

    def setup(self, ctx: SinkContext) -> None:
        self.directory = Path(ctx.base_dir, self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def open_writer(self, ctx: WriterContext) -> _CountingWriter:
        return _CountingWriter()

    def commit(self, batch_id: int, messages: Sequence[int]) -> None:
        count = sum(messages)
        if not count:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        # Write-then-rename: a crash leaves the old file or the new one, never half a file.
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".batch-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(f"{count}\n")
        os.replace(tmp, self.directory / f"batch-{batch_id:012d}.count")

    def total(self) -> int:
        """Elements delivered by every committed batch."""
        return sum(int(p.read_text()) for p in sorted(self.directory.glob("batch-*.count")))

    def describe_params(self) -> str:
        return f"directory={self.directory}"
