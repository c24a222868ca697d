"""Resuming stored progress: the source definition it was made with, and the change it takes.

A pipeline's stored progress belongs to the source definition it began with (database,
stream, start_at, end_at, snapshot; :meth:`DetectPartitions.definition`). A run whose
definition differs resumes the stored progress as it is and warns (``strict`` refuses),
with two exceptions. **Another database or stream** is refused
(:class:`~cdcflow.errors.PipelineDefinitionError`): the stored partitions are the old
stream's, whose tokens the new one cannot read. **An earlier end_at**: an absolute
``end_at`` (RFC 3339 text, a datetime, nanoseconds) at or before the end the stored
progress reads to (none: never) is applied: the new definition is stored with that end
(``end_ns``, the exclusive end in nanoseconds), and from then on every partition ends
there (:func:`end_cap`, applied by :class:`~cdcflow.engine.partitions.PartitionView`).
Partitions already read past it finish at once; what was read past it stays delivered. A
batch planned before the change is replayed as it was planned (output identity), so it
may read past the new end. A *later* end_at cannot be applied: partitions that reached
the stored end have finished, and the child partitions after it were never read.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from cdcflow.durations import is_relative_time, parse_time
from cdcflow.errors import PipelineDefinitionError
from cdcflow.metadata.base import MetadataStore
from cdcflow.model import MAX_NS, PartitionMetadata, Timestamp
from cdcflow.transforms.source import DetectPartitions

__all__ = [
    "END_KEY", "capped", "end_cap", "resume_source", "source_of_record", "stored_partitions",
    "stored_source",
]

_log = logging.getLogger("cdcflow.engine")

#: The key of the stored definition that holds an end applied on resume.
END_KEY = "end_ns"

Definition = Mapping[str, Any]


def end_cap(stored: Definition) -> int | None:
    """The exclusive end an end_at applied on resume holds every partition to (None: none
    was; the partitions carry the end the pipeline began with)."""
    end = stored.get(END_KEY)
    return None if end is None else int(end)


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


def source_of_record(source: DetectPartitions, stored: Definition | None
                     ) -> DetectPartitions | None:
    """``source`` reading the database and stream of the ``stored`` definition, when they
    differ from its own (None when they do not, or when the stored source was a client
    object, which cannot be made again): what a reset reads the old progress's owed
    batches with, since their partition tokens are that stream's."""
    if stored is None:
        return None
    database, stream = stored.get("database"), stored.get("stream")
    if (database, stream) == (source.database, source.stream) or source.client is not None:
        return None
    if not isinstance(database, str) or not isinstance(stream, str) or database.startswith("<"):
        return None
    old = copy.copy(source)
    old.database, old.stream = database, stream
    return old


def stored_partitions(
    store: MetadataStore, pipeline: str, source: Definition | None
) -> list[PartitionMetadata]:
    """``pipeline``'s stored partitions as its runs see them under its stored ``source``
    (:func:`stored_source`): ends lowered to an end_at applied on resume (what
    :class:`~cdcflow.engine.partitions.PartitionView` holds)."""
    return capped(store.partitions(pipeline), None if source is None else end_cap(source))


def _instant(text: str) -> int | None:
    """The instant an absolute start_at or end_at stands for (None: relative, or not
    read as a time)."""
    if is_relative_time(text):
        return None
    try:
        return int(text) if text.isdigit() else parse_time(text)
    except (TypeError, ValueError):
        return None


def _same(key: str, stored: Any, given: Any) -> bool:
    """Whether a definition's value is unchanged: equal, or for start_at and end_at the
    same instant however spelled (``...36Z``, ``...36.000000000Z``, nanoseconds)."""
    if stored == given:
        return True
    if key not in ("start_at", "end_at") or not (isinstance(stored, str)
                                                   and isinstance(given, str)):
        return False
    instant = _instant(stored)
    return instant is not None and instant == _instant(given)


def resume_source(
    store: MetadataStore, pipeline: str, definition: Definition, end_ns: int | None, *,
    strict: bool, partitions: Sequence[PartitionMetadata],
) -> int | None:
    """Check ``definition`` against the one ``pipeline``'s stored progress began with (see
    the module docstring); ``end_ns`` is the run's exclusive end when its end_at is
    absolute (None: no end_at, or a relative one). Returns :func:`end_cap` of the definition
    the run goes on with. Raises PipelineDefinitionError for a change under ``strict`` (an
    earlier end_at is applied all the same)."""
    text = store.source(pipeline)
    if text is None:  # progress from before sources were stored
        store.set_source(pipeline, json.dumps(definition, sort_keys=True))
        return None
    stored = json.loads(text)
    cap = end_cap(stored)
    given = {k: v for k, v in stored.items() if k != END_KEY}
    changed = sorted(k for k in set(given) | set(definition)
                     if not _same(k, given.get(k), definition.get(k)))
    if not changed:
        return cap
    summary = ", ".join(f"{k} {given.get(k)!r} -> {definition.get(k)!r}" for k in changed)
    msg = f"pipeline {pipeline!r}: its source changed since its stored progress began ({summary}); "
    if {"database", "stream"} & set(changed):
        # the stored partitions are the old stream's: their tokens mean nothing to another
        msg += ("the stored progress is another change stream's partitions, which this one "
                "cannot read: run with --reset to start over with the new source, or give "
                "the pipeline a new name")
        raise PipelineDefinitionError(msg)
    if changed == ["end_at"]:
        # the end the stored progress reads to: one applied before, else the one the
        # pipeline began with, which every partition inherited
        old = cap if cap is not None else max((p.end for p in partitions), default=MAX_NS)
        if end_ns is not None and end_ns <= old:
            store.set_source(pipeline, json.dumps({**definition, END_KEY: end_ns}, sort_keys=True))
            _log.info("pipeline %s: end_at is now %s (was %s); every partition ends there",
                      pipeline, Timestamp.from_ns(end_ns - 1),
                      "none" if old == MAX_NS else Timestamp.from_ns(old - 1))
            past = max((p.watermark for p in partitions), default=0)
            if past > end_ns:
                _log.warning(
                    "pipeline %s: it has read up to %s, past the new end_at; what it read past "
                    "it stays delivered", pipeline, Timestamp.from_ns(past),
                )
            return end_ns
        msg += (
            "end_at can only move earlier, to an absolute time (RFC 3339): partitions that "
            "reached the stored end have finished; "
        )
    if strict:
        msg += "run with --reset to start over with the new source, or undo the change"
        raise PipelineDefinitionError(msg)
    _log.warning("%sresuming the stored progress; run with --reset to start over with the new "
                 "source (--strict refuses instead)", msg)
    return cap
