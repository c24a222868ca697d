"""What ``cdcflow status`` prints: stored progress of the pipelines in a metadata store."""

from __future__ import annotations

from cdcflow.engine.lifecycle import all_finished, count_states, low_watermark
from cdcflow.errors import UserInputError
from cdcflow.metadata.base import MetadataStore
from cdcflow.model import MAX_NS, PartitionState, Timestamp
from cdcflow.progress import format_duration, format_partitions

__all__ = ["render_status"]

_TOKEN_WIDTH = 28
_MAX_ACTIVE_ROWS = 50


def _stamp(ns: int | None) -> str:
    if ns is None:
        return "-"
    if ns >= MAX_NS:
        return "end"
    return Timestamp.from_ns(ns).rfc3339()


def _ago(ns: int | None, now_ns: int) -> str:
    return "-" if ns is None or ns >= MAX_NS else format_duration(max(0, now_ns - ns) / 1e9)


def _short(token: str) -> str:
    return token if len(token) <= _TOKEN_WIDTH else token[: _TOKEN_WIDTH - 1] + "…"


def _table(header: list[str], rows: list[list[str]], indent: str = "    ") -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in [header, *rows]]


def _render_one(store: MetadataStore, name: str, batches: int, now_ns: int) -> list[str]:
    parts = store.partitions(name)
    counts = {state: n for state, n in count_states(parts).items() if n}
    low = low_watermark(parts)
    out = [f"pipeline {name}"]
    if not parts:
        out.append("  no partitions yet (the first batch has not been planned)")
    elif all_finished(parts):
        out.append(
            f"  low watermark  all partitions finished at {_stamp(low)} (the run reached its end)"
        )
    else:
        out.append(f"  low watermark  {_stamp(low)} (lag {_ago(low, now_ns)})")
    out.append(f"  partitions     {format_partitions(counts)}")
    pending = store.pending_plan(name)
    if pending is not None:
        out.append(
            f"  pending batch  {pending.batch_id}: {len(pending.slices)} slices up to "
            f"{_stamp(pending.end)}, planned {_ago(pending.planned_at, now_ns)} ago "
            "(the next run replays it)"
        )
    active = [p for p in parts if p.state != PartitionState.FINISHED]
    if active:
        out.append("  active partitions:")
        rows = [
            [_short(p.token), p.state.value.lower(), _stamp(p.watermark),
             _ago(p.watermark, now_ns), _stamp(p.end) if p.end < MAX_NS else "-",
             str(len(p.parent_tokens))]
            for p in active[:_MAX_ACTIVE_ROWS]
        ]
        out += _table(["TOKEN", "STATE", "WATERMARK", "LAG", "END", "PARENTS"], rows)
        if len(active) > _MAX_ACTIVE_ROWS:
            out.append(f"    ... and {len(active) - _MAX_ACTIVE_ROWS} more")
    log = store.batches(name, limit=batches)
    if log:
        out.append("  recent batches:")
        rows = []
        for b in log:
            took = (format_duration((b.committed_at - b.planned_at) / 1e9)
                    if b.committed_at is not None else "pending")
            rows.append([str(b.batch_id), _stamp(b.end), str(b.slices), f"{b.records:,}",
                         f"{_ago(b.planned_at, now_ns)} ago", took])
        out += _table(["BATCH", "END", "SLICES", "RECORDS", "PLANNED", "TOOK"], rows)
    return out


def render_status(
    store: MetadataStore, pipeline: str | None = None, *, batches: int = 5,
    now_ns: int | None = None,
) -> str:
    """The status text of ``pipeline`` (default: every pipeline in the store)."""
    now = Timestamp.now().ns if now_ns is None else now_ns
    names = store.pipelines()
    if pipeline is not None:
        if pipeline not in names:
            known = ", ".join(names) or "none"
            msg = (
                f"no pipeline named {pipeline!r} in {store.url} (stored pipelines: {known}); "
                "check --pipeline and --metadata"
            )
            raise UserInputError(msg)
        names = [pipeline]
    if not names:
        return f"no pipelines in {store.url} yet: `cdcflow run FILE --metadata {store.url}`\n"
    lines = [f"store {store.url}"]
    for name in names:
        lines += _render_one(store, name, batches, now)
    return "\n".join(lines) + "\n"
