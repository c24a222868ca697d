"""What ``cdcflow status`` prints: stored progress of the pipelines in a metadata store.

- :func:`render_status`: the text (per pipeline: low watermark and lag, partitions by
  state, the active partitions, a pending batch, recent batches);
- :func:`status_document`: the same as one JSON-ready document, for scripts;
- :func:`watch_status`: the text redrawn in place every few seconds (``--watch``);
- :func:`render_lineage` / :func:`render_svg`: the partitions' split/merge tree as
  Graphviz DOT, or SVG through the ``dot`` program.

Partition semantics (low watermark, states, "finished") come from
:mod:`cdcflow.engine.lifecycle`, as the engine decides them. Each pipeline has a ``run``
entry from its ownership lease: whether a run is alive, where (host:pid), since when and
its last heartbeat (None when no run ever took the lease).

Stuck partitions, as the store shows them: while a run is alive, a partition whose
progress a planned batch has held for more than ``stuck_after`` (default: as the run's
detector, :func:`cdcflow.stuck.default_stuck_after`) is flagged ``stuck``. The store
holds only what batches commit, so while one read of a batch hangs every partition of
that batch is flagged; the run itself (its warning line and its metric
``cdcflow_stuck_partition_seconds``) names the partition whose read hangs.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from cdcflow.engine.lifecycle import all_finished, count_states, low_watermark
from cdcflow.engine.ownership import owner_gone
from cdcflow.engine.resume import stored_partitions, stored_source
from cdcflow.errors import UserInputError
from cdcflow.metadata.base import MetadataStore
from cdcflow.model import (
    INITIAL_PARTITION_TOKEN,
    MAX_NS,
    Lease,
    PartitionMetadata,
    PartitionState,
    Timestamp,
)
from cdcflow.progress import format_duration, format_partitions
from cdcflow.stuck import default_stuck_after

__all__ = [
    "render_lineage",
    "render_status",
    "render_svg",
    "status_document",
    "watch_status",
]

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


def _run_doc(lease: Lease | None, now_ns: int) -> dict[str, Any] | None:
    """The run that owns (or last owned) the pipeline, from its lease."""
    if lease is None:
        return None
    alive = lease.alive(now_ns) and not owner_gone(lease)
    return {
        "alive": alive,
        "owner": lease.owner,
        "run_id": lease.run_id,
        "since": _iso(lease.acquired_at),
        "heartbeat": _iso(lease.renewed_at),
        "expires": _iso(lease.expires_at) if lease.expires_at else None,
    }


def _run_text(run: dict[str, Any] | None, now_ns: int) -> str:
    if run is None:
        return "never run (no run has taken this pipeline's lease)"
    if run["alive"]:
        return (f"alive: {run['owner']} (run {run['run_id']}), since {run['since']}, "
                f"last heartbeat {run['heartbeat']}")
    return f"not running (last run {run['owner']}, run {run['run_id']}, since {run['since']})"


def _render_one(
    store: MetadataStore, name: str, batches: int, now_ns: int, stuck_after: float | None
) -> list[str]:
    source = stored_source(store, name)
    parts = stored_partitions(store, name, source)
    counts = {state: n for state, n in count_states(parts).items() if n}
    low = low_watermark(parts)
    out = [f"pipeline {name}"]
    run = _run_doc(store.lease(name), now_ns)
    out.append(f"  run            {_run_text(run, now_ns)}")
    if source is not None:
        out.append(f"  source         {_source_text(source)}")
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
            + ("(the running run is reading or committing it)" if run is not None and run["alive"]
               else "(the next run replays it)")
        )
    for sink in _staging(store, name, pending is not None):
        owed = sink["owed_batches"]
        out.append(
            f"  staging sink   {sink['sink']}: durable through batch {sink['durable_through']}"
            + (f"; {owed} committed batch{'es' if owed != 1 else ''} after it staged, not "
               "durable yet (a flush, or the next run, writes them)" if owed else "")
        )
    # the furthest behind first (those hold the low watermark), stuck ones before them
    held = _held(store, name, parts, now_ns, stuck_after)
    active = sorted((p for p in parts if p.state != PartitionState.FINISHED),
                    key=lambda p: (p.token not in held, p.watermark, p.token))
    if active:
        out.append("  active partitions (furthest behind first):")
        rows = [
            [_short(p.token), p.state.value.lower() + (" (stuck)" if p.token in held else ""),
             _stamp(p.watermark),
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
                         f"{_ago(b.planned_at, now_ns)} ago", took, *_phase_cells(b.stats),
                         *_policy_cells(b.stats)])
        out += _table(["BATCH", "END", "SLICES", "RECORDS", "PLANNED", "TOOK", "PLAN", "READ",
                       "SINKS", "RETRIED", "SKIPPED", "DEAD"], rows)
    return out


def _staging(store: MetadataStore, name: str, pending: bool) -> list[dict[str, Any]]:
    """The staging sinks (those that make output durable after the store commits it, see
    the two-stage ack): each one's durable mark and the committed batches after it."""
    marks = store.durable_marks(name)
    if not marks:
        return []
    committed = store.last_batch_id(name) - (1 if pending else 0)
    return [{"sink": label, "durable_through": mark, "owed_batches": max(0, committed - mark)}
            for label, mark in sorted(marks.items())]


def _when(value: Any) -> str:
    """A stored start_at or end_at: nanoseconds (stored as digits) as RFC 3339 text,
    anything else (``now``, ``-10m``) as it is."""
    text = str(value)
    return _stamp(int(text)) if text.isdigit() else text


def _source_doc(source: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The stored source definition for the JSON document: a start_at or end_at stored as
    nanoseconds is RFC 3339 text there, its nanoseconds beside it (``start_at_ns``), as the
    document gives every other time."""
    if source is None:
        return None
    doc = dict(source)
    for key in ("start_at", "end_at"):
        value = doc.get(key)
        if value is not None and str(value).isdigit():
            doc[key], doc[f"{key}_ns"] = _when(value), int(str(value))
    return doc


def _source_text(source: Mapping[str, Any]) -> str:
    """``stream S of DB, from START to END`` (a definition's times as given)."""
    start, end = source.get("start_at"), source.get("end_at")
    text = (f"stream {source.get('stream')} of {source.get('database')}, from "
            f"{_when(start)} to {_when(end) if end is not None else 'no end'}")
    if source.get("snapshot"):
        text += f", after a snapshot of {source['snapshot']}"
    return text


#: The phases of a batch the batch log times (the store commit is not known to itself).
_PHASES = ("plan", "execute", "sink_commit")


def _count(stats: Mapping[str, float], name: str) -> int | None:
    return int(stats[name]) if name in stats else None


def _phase_cells(stats: Mapping[str, float]) -> list[str]:
    """The batch's plan, execute (read and process) and sink commit times, or "-"."""
    return [format_duration(stats[f"{p}_seconds"]) if f"{p}_seconds" in stats else "-"
            for p in _PHASES]


def _policy_cells(stats: Mapping[str, float]) -> list[str]:
    """Elements the error policy retried, skipped and dead-lettered, or "-"."""
    return [f"{int(stats[n]):,}" if n in stats else "-"
            for n in ("retries", "skipped", "dead_lettered")]


def _names(store: MetadataStore, pipeline: str | None) -> list[str]:
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
    return names


def render_status(
    store: MetadataStore, pipeline: str | None = None, *, batches: int = 5,
    now_ns: int | None = None, stuck_after: float | None = None,
) -> str:
    """The status text of ``pipeline`` (default: every pipeline in the store); partitions
    held past ``stuck_after`` seconds (None: the run's default) are marked stuck.

    An unknown ``pipeline`` raises UserInputError listing the stored ones."""
    now = Timestamp.now().ns if now_ns is None else now_ns
    names = _names(store, pipeline)
    if not names:
        return f"no pipelines in {store.url} yet: `cdcflow run FILE --metadata {store.url}`\n"
    lines = [f"store {store.url}"]
    for name in names:
        lines += _render_one(store, name, batches, now, stuck_after)
    return "\n".join(lines) + "\n"


# -- JSON ----------------------------------------------------------------------------------


def _iso(ns: int | None) -> str | None:
    """RFC 3339 text; None for no time and for "no end"."""
    return None if ns is None or ns >= MAX_NS else Timestamp.from_ns(ns).rfc3339()


def _lag_s(ns: int | None, now_ns: int) -> float | None:
    return None if ns is None or ns >= MAX_NS else round(max(0, now_ns - ns) / 1e9, 3)


def _held(
    store: MetadataStore, name: str, parts: list[PartitionMetadata], now_ns: int,
    stuck_after: float | None,
) -> set[str]:
    """Tokens whose progress a planned batch has held for more than the stuck threshold,
    while the pipeline's run is alive (a dead run holds everything; ``run`` says so)."""
    run = _run_doc(store.lease(name), now_ns)
    pending = store.pending_plan(name)
    if run is None or not run["alive"] or pending is None or not pending.planned_at:
        return set()
    heartbeats = {p.token: p.heartbeat_millis for p in parts
                  if p.state != PartitionState.FINISHED}
    held = set()
    for sl in pending.slices:
        if sl.token not in heartbeats:
            continue
        after = stuck_after if stuck_after is not None else default_stuck_after(
            heartbeats[sl.token])
        if now_ns - pending.planned_at > after * 1e9:
            held.add(sl.token)
    return held


def _partition_doc(p: PartitionMetadata, now_ns: int, stuck: bool = False) -> dict[str, Any]:
    finished = p.state == PartitionState.FINISHED
    return {
        "token": p.token,
        "state": p.state.value,
        "watermark": _iso(p.watermark),
        "watermark_ns": p.watermark,
        "lag_seconds": None if finished else _lag_s(p.watermark, now_ns),
        "stuck": stuck,
        "start": _iso(p.start),
        "end": _iso(p.end),
        "parents": list(p.parent_tokens),
        "heartbeat_millis": p.heartbeat_millis,
        "created_at": _iso(p.created_at or None),
        "running_at": _iso(p.running_at),
        "finished_at": _iso(p.finished_at),
    }


def _pipeline_doc(
    store: MetadataStore, name: str, batches: int, now_ns: int, stuck_after: float | None,
) -> dict[str, Any]:
    source = stored_source(store, name)
    parts = stored_partitions(store, name, source)
    stuck = _held(store, name, parts, now_ns, stuck_after)
    low = low_watermark(parts) if parts else None
    done = all_finished(parts)
    pending = store.pending_plan(name)
    recent = []
    for b in store.batches(name, limit=batches):
        recent.append({
            "batch_id": b.batch_id,
            "end": _iso(b.end),
            "slices": b.slices,
            "records": b.records,
            "planned_at": _iso(b.planned_at),
            "committed_at": _iso(b.committed_at),
            "seconds": None if b.committed_at is None
            else round((b.committed_at - b.planned_at) / 1e9, 3),
            "phases": {phase: round(b.stats[f"{phase}_seconds"], 3) for phase in _PHASES
                       if f"{phase}_seconds" in b.stats},
            "bytes": _count(b.stats, "bytes"),
            "retried": _count(b.stats, "retries"),
            "skipped": _count(b.stats, "skipped"),
            "dead_lettered": _count(b.stats, "dead_lettered"),
        })
    return {
        "name": name,
        "run": _run_doc(store.lease(name), now_ns),
        "source": _source_doc(source),
        "low_watermark": _iso(low),
        "low_watermark_ns": low,
        "lag_seconds": None if low is None else 0.0 if done else _lag_s(low, now_ns),
        "finished": done,
        "partitions_by_state": count_states(parts),
        "partitions": [_partition_doc(p, now_ns, p.token in stuck) for p in parts],
        "stuck_partitions": sorted(stuck),
        "pending_batch": None if pending is None else {
            "batch_id": pending.batch_id,
            "end": _iso(pending.end),
            "slices": [{"token": sl.token, "start": _iso(sl.start), "end": _iso(sl.end)}
                       for sl in pending.slices],
            "planned_at": _iso(pending.planned_at or None),
        },
        "staging_sinks": _staging(store, name, pending is not None),
        "recent_batches": recent,
    }


def status_document(
    store: MetadataStore, pipeline: str | None = None, *, batches: int = 5,
    now_ns: int | None = None, stuck_after: float | None = None,
) -> dict[str, Any]:
    """What :func:`render_status` shows, as plain data (``json.dumps`` takes it).

    ``{"store", "now", "pipelines": [{"name", "run" ({"alive", "owner", "run_id", "since",
    "heartbeat", "expires"}; None: never run), "source" (the stored source definition:
    {"database", "stream", "start_at", "end_at", ...}, a time given in nanoseconds as RFC
    3339 text with its ``start_at_ns``/``end_at_ns`` beside it; None: none stored),
    "low_watermark",
    "low_watermark_ns", "lag_seconds", "finished", "partitions_by_state", "partitions":
    [{"token", "state", "watermark", "watermark_ns", "lag_seconds", "stuck", "start", "end",
    "parents", ...}], "stuck_partitions" (tokens), "pending_batch", "staging_sinks":
    [{"sink", "durable_through" (a batch id), "owed_batches" (committed after it, staged
    but not durable yet)}], "recent_batches":
    [{"batch_id", "end", "slices",
    "records", "planned_at", "committed_at", "seconds", "phases" ({"plan", "execute",
    "sink_commit"}: seconds), "bytes", "retried", "skipped", "dead_lettered"}]}]}``
    (a batch committed without statistics has empty phases and None counts). Times are RFC 3339 text
    (None for "no end"); lags are seconds at ``now`` (None for finished partitions; a
    pipeline whose partitions all finished has lag 0). Every partition is listed.
    ``stuck``: see the module docstring (``stuck_after`` in seconds, None: the default).
    """
    now = Timestamp.now().ns if now_ns is None else now_ns
    return {
        "store": store.url,
        "now": _iso(now),
        "pipelines": [_pipeline_doc(store, n, batches, now, stuck_after)
                      for n in _names(store, pipeline)],
    }


# -- watch ---------------------------------------------------------------------------------

_HOME = "\x1b[H"
_CLEAR_SCREEN = "\x1b[2J"
_CLEAR_EOL = "\x1b[K"
_CLEAR_BELOW = "\x1b[J"


def watch_status(
    render: Callable[[], str],
    interval: float,
    *,
    count: int | None = None,
    stream: TextIO | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Show ``render()`` every ``interval`` seconds until Ctrl-C (KeyboardInterrupt, which
    ends the watch quietly) or ``count`` refreshes; return how many were shown.

    On a terminal the screen is redrawn in place (cursor home, each line cleared to its
    end, the rest of the screen cleared); elsewhere each refresh follows the last under a
    ``--- <time>`` line.
    """
    out = stream if stream is not None else sys.stdout
    live = out.isatty()
    shown = 0
    try:
        while count is None or shown < count:
            if shown:
                sleep(interval)
            header = f"every {interval:g}s: cdcflow status at {Timestamp.now().rfc3339()}"
            body = render()
            if live:
                lines = [header, "", *body.rstrip("\n").splitlines()]
                out.write((_CLEAR_SCREEN if not shown else "") + _HOME
                          + "".join(line + _CLEAR_EOL + "\n" for line in lines) + _CLEAR_BELOW)
            else:
                out.write(f"--- {header}\n{body}")
            out.flush()
            shown += 1
    except KeyboardInterrupt:
        if live:
            out.write("\n")
            out.flush()
    return shown


# -- lineage -------------------------------------------------------------------------------

_STATE_COLORS = {
    PartitionState.CREATED: "lightgrey",
    PartitionState.SCHEDULED: "lightyellow",
    PartitionState.RUNNING: "lightblue",
    PartitionState.FINISHED: "palegreen",
}


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render_lineage(
    store: MetadataStore, pipeline: str | None = None, *, now_ns: int | None = None
) -> str:
    """The partitions of ``pipeline`` (needed when the store holds several) as a Graphviz
    digraph: one node per stored partition (token, state, start and watermark; filled by
    state), an edge from each parent to its child, so splits fan out and merges fan in.
    A parent that is no longer stored (garbage collected after it finished) is drawn
    dashed. Render it with ``dot -Tsvg`` (:func:`render_svg`)."""
    now = Timestamp.now().ns if now_ns is None else now_ns
    names = _names(store, pipeline)
    if len(names) != 1:
        msg = (
            f"{store.url} holds {len(names)} pipelines ({', '.join(names) or 'none'}); "
            "choose one with --pipeline NAME"
        ) if names else f"no pipelines in {store.url} yet: run one first"
        raise UserInputError(msg)
    name = names[0]
    parts = stored_partitions(store, name, stored_source(store, name))
    ids = {p.token: f"p{i}" for i, p in enumerate(parts)}
    out = [f"digraph {_dot_quote(name)} {{", "  rankdir=LR;",
           "  node [shape=box, style=filled, fontname=Helvetica, fontsize=10];"]
    for p in parts:
        label = p.token if p.token != INITIAL_PARTITION_TOKEN else "(root query)"
        lines = [_short(label), p.state.value.lower(), f"from {_stamp(p.start)}"]
        if p.state == PartitionState.FINISHED:
            lines.append(f"to {_stamp(p.watermark)}")
        else:
            lines.append(f"at {_stamp(p.watermark)} (lag {_ago(p.watermark, now)})")
        out.append(f"  {ids[p.token]} [label={_dot_quote(chr(10).join(lines))}, "
                   f"fillcolor={_STATE_COLORS[p.state]}, tooltip={_dot_quote(p.token)}];")
    gone: dict[str, str] = {}
    for p in parts:
        for parent in p.parent_tokens:
            if parent not in ids and parent not in gone:
                gone[parent] = f"g{len(gone)}"
                label = parent if parent != INITIAL_PARTITION_TOKEN else "(root query)"
                text = _dot_quote(f"{_short(label)}\ncollected")
                out.append(f"  {gone[parent]} [label={text}, style=dashed, fillcolor=white];")
            out.append(f"  {ids.get(parent) or gone[parent]} -> {ids[p.token]};")
    out.append("}")
    return "\n".join(out) + "\n"


def render_svg(dot: str) -> bytes:
    """``dot`` rendered as SVG by Graphviz's ``dot`` program. Without it on PATH, raises
    UserInputError naming the fix."""
    program = shutil.which("dot")
    if program is None:
        msg = (
            "--lineage svg needs Graphviz's `dot` program, which is not on PATH: install it "
            "(apt-get install graphviz) or use --lineage dot"
        )
        raise UserInputError(msg)
    done = subprocess.run([program, "-Tsvg"], input=dot.encode(), capture_output=True,
                          check=False, timeout=120)
    if done.returncode != 0:
        msg = f"dot -Tsvg failed: {done.stderr.decode(errors='replace').strip()}"
        raise UserInputError(msg)
    return done.stdout
