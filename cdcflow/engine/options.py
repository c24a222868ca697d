"""RunOptions: how a run proceeds (intervals, limits, retries, the lease, pacing), each
checked where it is made, with a message naming the option and what to give."""

from __future__ import annotations

import math
from typing import Any

import attrs

from cdcflow.durations import parse_size
from cdcflow.errors import PipelineDefinitionError

__all__ = ["DEFAULT_TASK_BYTES", "MIN_LEASE_TTL", "RunOptions"]


def _non_negative(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (value < 0 or not math.isfinite(value)):
        msg = f"RunOptions.{attribute.name} must be 0 or more (and finite), got {value}"
        raise ValueError(msg)


#: The longest batch interval: a run waits that long between batches once caught up.
_DAY = 86_400.0


def _interval(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _non_negative(instance, attribute, value)
    if value > _DAY:
        msg = (f"RunOptions.{attribute.name} must be at most a day (86400 s), got {value:g}; "
               "for runs days apart, run with --max-batches from a scheduler instead")
        raise ValueError(msg)


#: The bytes a task of a paced batch aims to read (``RunOptions.max_task_bytes``).
DEFAULT_TASK_BYTES = 128 << 20


def _task_bytes(value: Any) -> int | None:
    if value is None:
        return None
    try:
        size = parse_size(value, "RunOptions.max_task_bytes=...")
    except PipelineDefinitionError as e:
        raise ValueError(str(e)) from None
    if size < 1:
        msg = f"RunOptions.max_task_bytes must be 1 byte or more, or None; got {value!r}"
        raise ValueError(msg)
    return size


def _positive(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and (value <= 0 or not math.isfinite(value)):
        msg = f"RunOptions.{attribute.name} must be more than 0 (and finite), got {value}"
        raise ValueError(msg)


#: The shortest lease a run may ask for (seconds): it is renewed every third of it, and a
#: renewal that takes longer than what is left lets the lease lapse.
MIN_LEASE_TTL = 0.1


def _lease_ttl(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    _positive(instance, attribute, value)
    if value < MIN_LEASE_TTL:
        msg = (f"RunOptions.lease_ttl must be at least {MIN_LEASE_TTL} (seconds; the lease "
               f"is renewed every third of it, and 30 is the default), got {value}")
        raise ValueError(msg)


@attrs.frozen
class RunOptions:
    """How a run proceeds. Durations are seconds.

    ``batch_interval``: the least time between the starts of batches once the pipeline has
    caught up with the clock (a lagging pipeline runs batches back to back).
    ``max_batch_span``: a batch reads at most this far past the low watermark.
    ``max_batches`` / ``duration``: stop after that many batches / seconds (None: no limit).
    ``reset``: forget the pipeline's stored progress first and start over.
    ``gc_ttl``: delete finished partitions this long after they finished (once their
    children have started). ``base_dir``: relative sink paths resolve against it.
    ``idle_read_interval``: an idle partition (no data in its last slices) is queried less
    often, its wait doubling up to this many seconds; the resolved watermark then lags by
    at most that much more (0: every partition every batch; see
    :mod:`cdcflow.engine.partitions`).
    ``takeover``: take the pipeline over from a run whose lease is still alive (after
    confirming it is gone); ``lease_ttl``: how long this run's lease holds without a
    heartbeat (:mod:`cdcflow.engine.ownership`). ``strict``: refuse to resume stored
    progress made with another source definition (database, stream, start_at, end_at)
    instead of warning (an earlier end_at is applied all the same:
    :mod:`cdcflow.engine.resume`).
    ``batch_retries`` / ``retry_backoff``: a batch whose tasks (or sink commits) failed with
    a transient error is run again up to this many times, after a fully jittered wait whose
    cap starts at ``retry_backoff`` and doubles (:class:`cdcflow.backoff.RetryPolicy`).
    ``pipelined``: while the run lags the clock (catching up), read the next batch while
    the current one's sinks and store commit (:mod:`cdcflow.engine.batch`; exactly once
    all the same). False runs one batch at a time.
    ``max_task_bytes``: pace the span of batches so that the busiest task reads about this
    many bytes (a size such as ``"64MiB"`` or a number; None: every batch spans
    ``max_batch_span``; see :mod:`cdcflow.engine.pacing`).
    """

    batch_interval: float = attrs.field(default=1.0, validator=_interval)
    max_batch_span: float = attrs.field(default=60.0, validator=_positive)
    max_batches: int | None = attrs.field(default=None, validator=_positive)
    duration: float | None = attrs.field(default=None, validator=_non_negative)
    reset: bool = False
    gc_ttl: float = attrs.field(default=3600.0, validator=_non_negative)
    base_dir: str = "."
    batch_retries: int = attrs.field(default=3, validator=_non_negative)
    retry_backoff: float = attrs.field(default=1.0, validator=_non_negative)
    takeover: bool = False
    lease_ttl: float = attrs.field(default=30.0, validator=_lease_ttl)
    idle_read_interval: float = attrs.field(default=5.0, validator=_non_negative)
    strict: bool = False
    pipelined: bool = True
    max_task_bytes: int | None = attrs.field(
        default=DEFAULT_TASK_BYTES, converter=_task_bytes, metadata={"kind": "size"}
    )
