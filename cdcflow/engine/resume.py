"""Resuming stored progress: the source definition it was made with, and the change it takes.

A pipeline's stored progress belongs to the source definition it began with (database,
stream, start_at, end_at, snapshot; :meth:`DetectPartitions.definition`). A run whose
definition differs resumes the stored progress as it is and warns (``strict`` refuses),
with one exception: **an earlier end_at**. An absolute ``end_at`` (RFC 3339 text, a
datetime, nanoseconds) at or before the stored end (none: never) is applied: it becomes
the stored definition, and from then on every partition ends there
(:func:`end_cap`, applied by :class:`~cdcflow.engine.partitions.PartitionView`).
Partitions already read past it finish at once; what was read past it stays delivered. A
batch planned before the change is replayed as it was planned (output identity), so it
may read past the new end. A *later* end_at cannot be applied: partitions that reached the
stored end have finished, and the child partitions after it were never read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from cdcflow.durations import parse_time
from cdcflow.errors import PipelineDefinitionError
from cdcflow.metadata.base import MetadataStore
from cdcflow.model import MAX_NS, PartitionMetadata, Timestamp

__all__ = ["capped", "end_cap", "resume_source", "stored_partitions", "stored_source"]

_log = logging.getLogger("cdcflow.engine")

Definition = Mapping[str, Any]


def _absolute_ns(text: str | None) -> int | None:
    """The instant of a definition's time text, or None for no time and relative ones
    ("now", "-10m": they were resolved once, when the pipeline began)."""
    if text is None:
        return None
    s = text.strip()
    if s.lower() == "now" or s.startswith("-"):
        return None
    return int(s) if s.isdecimal() else parse_time(s)


def end_cap(definition: Definition) -> int | None:
    """The exclusive end every partition is held to under ``definition``: its end_at + 1 ns
    when that is absolute, else None (the partitions carry the end they began with)."""
    at = _absolute_ns(definition.get("end_at"))
    return None if at is None else at + 1


def capped(partitions: Sequence[PartitionMetadata], end: int | None) -> list[PartitionMetadata]:
    """``partitions`` with every end after ``end`` lowered to it (None: as they are)."""
    if end is None:
        return list(partitions)
    return [attrs.evolve(p, end=end) if p.end > end else p for p in partitions]


def stored_source(store: MetadataStore, pipeline: str) -> dict[str, Any] | None:
    """The source definition ``pipeline``'s stored progress goes on with (None: none
    stored)."""
    text = store.source(pipeline)
    return None if text is None else dict(json.loads(text))


def stored_partitions(store: MetadataStore, pipeline: str) -> list[PartitionMetadata]:
    """``pipeline``'s stored partitions as its runs see them: ends lowered to an end_at
    applied on resume (what :class:`~cdcflow.engine.partitions.PartitionView` holds)."""
    source = stored_source(store, pipeline)
    return capped(store.partitions(pipeline), None if source is None else end_cap(source))


def resume_source(
    store: MetadataStore, pipeline: str, definition: Definition, *, strict: bool,
    partitions: Sequence[PartitionMetadata],
) -> int | None:
    """Check ``definition`` against the one ``pipeline``'s stored progress began with (see
    the module docstring); returns :func:`end_cap` of the definition the run goes on
    with. Raises PipelineDefinitionError for a change under ``strict`` (an earlier end_at
    is applied all the same)."""
    text = json.dumps(definition, sort_keys=True)
    stored_text = store.source(pipeline)
    if stored_text is None:  # progress from before sources were stored
        store.set_source(pipeline, text)
        return end_cap(definition)
    stored = json.loads(stored_text)
    if stored == definition:
        return end_cap(stored)
    changed = sorted(k for k in set(stored) | set(definition) if stored.get(k) != definition.get(k))
    summary = ", ".join(f"{k} {stored.get(k)!r} -> {definition.get(k)!r}" for k in changed)
    msg = f"pipeline {pipeline!r}: its source changed since its stored progress began ({summary}); "
    if changed == ["end_at"]:
        old = _stored_end(stored, partitions)
        new = end_cap(definition)
        if new is not None and new <= old:
            store.set_source(pipeline, text)
            _log.info("pipeline %s: end_at is now %s (was %s); every partition ends there",
                      pipeline, Timestamp.from_ns(new - 1),
                      "none" if old == MAX_NS else Timestamp.from_ns(old - 1))
            past = max((p.watermark for p in partitions), default=0)
            if past > new:
                _log.warning(
                    "pipeline %s: it has read up to %s, past the new end_at; what it read past "
                    "it stays delivered", pipeline, Timestamp.from_ns(past),
                )
            return new
        msg += (
            "end_at can only move earlier, to an absolute time (RFC 3339): partitions that "
            "reached the stored end have finished; "
        )
    if strict:
        msg += "run with --reset to start over with the new source, or undo the change"
        raise PipelineDefinitionError(msg)
    _log.warning("%sresuming the stored progress; run with --reset to start over with the new "
                 "source (--strict refuses instead)", msg)
    return end_cap(stored)


def _stored_end(stored: Definition, partitions: Sequence[PartitionMetadata]) -> int:
    """The exclusive end the stored progress reads to: the stored end_at's, or (for a
    relative one, resolved when the pipeline began) the end its partitions carry."""
    if stored.get("end_at") is None:
        return MAX_NS
    cap = end_cap(stored)
    if cap is not None:
        return cap
    return max((p.end for p in partitions), default=MAX_NS)
