"""Catch-up on the emulator: a backlog read by a stock-client reader and by ``cdcflow run``.

A Cloud Spanner emulator (started here, on a free port) gets a table, a change stream and a
backlog of 200,000 changes (inserts, ``ROWS_PER_TXN`` rows per transaction); then, each in
a process of its own and timed from launch to exit (start-up included), three readers read
the whole backlog, following child partitions to the end:

* ``stock reader``: a minimal single-threaded reader on the stock google-cloud-spanner
  client (``snapshot.execute_sql`` on ``READ_<stream>``, one partition after another,
  counting the mods of the data change records it gets): the reference;
* ``cdcflow run`` with the in-memory runner (the default), and
* ``cdcflow run --runner spark --master local[2]``,

both with a pipeline ending in a sink that counts the mods it is given (no output: the
read path is measured, as for the reference). Printed side by side as changes/s and ratios
to the reference. Targets: in-memory >= 4x, Spark local[2] >= 2x.

Then where each reader's time went, from its own timestamps (the cdcflow runs log JSON
lines; the stock reader notes when its imports ended): ``imports`` (the interpreter and
imports; on Spark ``imports+JVM+session``), ``connect+store+lease`` (connecting, describing
the stream, the store, the lease), ``first-batch`` (on Spark it includes starting the
Python workers), the other batches, and ``end`` (from the last batch to the process's exit:
closing sinks, the runner, the interpreter). The reading rate (changes per second of
reading alone) shows what start-up costs each reader.

``python -m bench.bench_catchup [--shapes CHANGESxROWS_PER_TRANSACTION,...] [--no-spark]
[--set NAME=VALUE ...]`` (``--set`` passes a run option to the cdcflow runs);
``CDCFLOW_BENCH_CATCHUP_CHANGES`` sets the default's changes (e.g. 20000 for a quick run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import attrs

from bench._args import from_env, positive_int

__all__ = ["Run", "main"]

STREAM = "BacklogStream"
CEILING = "ceiling: raw gRPC, every partition at once"
TABLE = "Backlog"
ROWS_PER_TXN = 20
_INSTANCE = "test-instance"
_DATABASE = "catchup"

PIPELINE = '''
from collections.abc import Sequence
from pathlib import Path

import cdcflow as cf
from cdcflow.transforms import DetectPartitions, ReadPartition, Sink


class _Writer:
    def __init__(self) -> None:
        self.n = 0

    def write(self, record: cf.DataChangeRecord) -> None:
        self.n += len(record.mods)

    def close(self) -> int:
        return self.n

    def abort(self) -> None:
        return None


class CountMods(Sink):
    """Counts the mods it is given; the total goes to a file when the run ends."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.total = 0

    def open_writer(self, ctx):
        return _Writer()

    def commit(self, batch_id: int, messages: Sequence[int]) -> None:
        self.total += sum(messages)

    def close(self) -> None:
        Path(self.path).write_text(str(self.total))


pipeline = cf.Pipeline("catchup")
(pipeline
 | DetectPartitions(database={database!r}, stream={stream!r}, start_at={start!r},
                    end_at={end!r})
 | ReadPartition(heartbeat="10s")
 | CountMods({count!r}))
'''


def _load(emulator: Any, changes: int, per_txn: int = ROWS_PER_TXN,
          database_id: str = _DATABASE) -> tuple[str, str, str]:
    """Create the database and commit the backlog, ``per_txn`` rows per transaction;
    (database path, start, end) as RFC 3339."""
    from google.api_core.exceptions import Aborted

    from cdcflow.model import Timestamp

    db = emulator.create_database(database_id, [
        f"CREATE TABLE {TABLE} (Id INT64 NOT NULL, Customer STRING(MAX), Status STRING(16), "
        f"Quantity INT64, Price FLOAT64) PRIMARY KEY (Id)",
        f"CREATE CHANGE STREAM {STREAM} FOR {TABLE} "
        "OPTIONS (value_capture_type = 'NEW_ROW', retention_period = '1d')",
    ], instance=_INSTANCE)
    columns = ("Id", "Customer", "Status", "Quantity", "Price")
    firsts = list(range(0, changes, per_txn))

    def commit(first: int) -> Any:
        rows = [
            (i, f"customer-{i % 997}", "NEW", i % 13, i * 0.25)
            for i in range(first, min(changes, first + per_txn))
        ]
        for attempt in itertools.count(1):
            try:
                with db.batch() as batch:
                    batch.insert(TABLE, columns, rows)
                return batch.committed
            except Aborted:  # the client's own retries ran out on a busy machine
                if attempt == 5:
                    raise
                time.sleep(0.1 * attempt)
        return None  # pragma: no cover - the loop returns or raises

    # A few writers at once: the emulator commits one at a time (it aborts a commit while
    # another runs, which the client retries), but the client's round trips overlap.
    # Distinct keys: blind writes that never conflict.
    with ThreadPoolExecutor(4) as pool:
        stamps = list(pool.map(commit, firsts))
    first_commit, last = min(stamps), max(stamps)
    assert first_commit is not None and last is not None
    # the stream cannot be read before it was created: start at the first commit (inclusive)
    start = Timestamp.from_datetime(first_commit)
    # one microsecond past the last commit: the stock client's timestamps have microseconds
    end = Timestamp.from_ns(Timestamp.from_datetime(last).ns + 1000)
    return emulator.database_path(database_id, _INSTANCE), str(start), str(end)


def read_stock(database: str, start_us: int, end_us: int) -> tuple[int, float]:
    """The reference: read every partition in turn with the stock client; the mods counted
    and when (``time.time()``) its imports ended. (Imports nothing of cdcflow: its start-up
    is the stock client's alone.)"""
    from google.cloud import spanner
    from google.cloud.spanner_v1 import param_types

    imported = time.time()

    _, project, _, instance, _, name = database.split("/")
    db = spanner.Client(project=project).instance(instance).database(name)
    sql = (
        f"SELECT ChangeRecord FROM READ_{STREAM}(start_timestamp => @s, end_timestamp => @e, "
        "partition_token => @t, heartbeat_milliseconds => 10000)"
    )
    types = {"s": param_types.TIMESTAMP, "e": param_types.TIMESTAMP, "t": param_types.STRING}
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    end_at = epoch + timedelta(microseconds=end_us)
    todo: list[tuple[str | None, Any]] = [(None, epoch + timedelta(microseconds=start_us))]
    seen: set[str] = set()
    mods = 0
    while todo:
        token, begin = todo.pop()
        params = {"s": begin, "e": end_at, "t": token}
        with db.snapshot() as snapshot:
            for row in snapshot.execute_sql(sql, params=params, param_types=types):
                for record in row[0]:
                    data, _, children = record[0], record[1], record[2]
                    for change in data:
                        mods += len(change[6])
                    for child in children:
                        for child_token, _ in child[2]:
                            if child_token not in seen:
                                seen.add(child_token)
                                todo.append((child_token, child[0]))
    return mods, imported


def read_ceiling(database: str, start_ns: int, end_ns: int) -> tuple[int, float, int]:
    """The emulator's ceiling: every partition read at once (a thread each, a child
    started as soon as a parent names it, no waiting for its other parents), each answer
    received as the bytes the server sent and parsed by protobuf in C; nothing decoded but
    the child partitions records to follow and each record's mods count (to check that
    all changes were read). Returns the mods, when the imports ended, and the partitions
    read."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from google.cloud import spanner  # noqa: F401 - imported before the clock, as the stock reader's

    from cdcflow.spanner import flat
    from cdcflow.spanner.client import SpannerChangeStreamClient
    from cdcflow.spanner.transport import GrpcTransport, merge_values
    from cdcflow.spanner.values import parse_timestamp

    flat._types()  # the message types, built once
    imported = time.time()
    client = SpannerChangeStreamClient(database)
    info = client.describe_stream(STREAM)
    transport = GrpcTransport(database)
    types = flat._types()
    lock = threading.Lock()
    seen: set[str] = set()
    mods = 0
    pending = 0
    done = threading.Event()
    errors: list[BaseException] = []
    pool = ThreadPoolExecutor(32)

    def count(row: Any, at: int) -> int:
        """A row's mods (its value parsed with ChangeRecords apart); follows children."""
        found = 0
        for record in row.list_value.values:
            data, _, children = record.list_value.values
            leaf = flat._leaf(data)
            for listed in leaf.l[1::2]:
                found += len(types.mods(listed).values.list_value.values.s) // 3
            cp = flat._leaf(children)
            for stamp, listed in zip(cp.s[::2], cp.l, strict=True):
                child_start = parse_timestamp(stamp).ns
                for child in flat._children(listed):
                    spawn(child.token, child_start)
        return found

    def read(token: str | None, start: int) -> None:
        nonlocal mods, pending
        try:
            sql, params = client._statement(info, token, start, end_ns, 10_000)
            found = 0
            chunk: Any = None  # the start of a value split across two messages
            column: Any = None
            for message in transport.execute_streaming_sql(
                sql, params, priority="MEDIUM", timeout=600
            ):
                parsed = types.rows(message)
                if column is None and parsed.metadata:
                    column = types.metadata(parsed.metadata).row_type.fields[0].type_
                values = list(parsed.values)
                if chunk is not None and values:
                    whole = merge_values(chunk, types.value(values.pop(0)), column)
                    values.insert(0, whole.SerializeToString())
                    chunk = None
                if parsed.chunked_value and values:
                    chunk = types.value(values.pop())
                for value in values:
                    found += count(types.split_row(value), start)
            with lock:
                mods += found
        except BaseException as exc:
            errors.append(exc)
        finally:
            with lock:
                pending -= 1
                if pending == 0:
                    done.set()

    def spawn(token: str | None, start: int) -> None:
        nonlocal pending
        with lock:
            if token is not None:
                if token in seen:
                    return
                seen.add(token)
            pending += 1
        pool.submit(read, token, start)

    spawn(None, start_ns)
    done.wait()
    pool.shutdown()
    transport.close()
    client.close()
    if errors:
        raise errors[0]
    return mods, imported, len(seen)


def _micros(text: str) -> int:
    from cdcflow.model import Timestamp

    return Timestamp.parse(text).ns // 1000


@attrs.frozen
class Run:
    """One reader's run: wall-clock times (``time.time()``) of its launch, its exit and the
    events it reported (see :func:`_events`)."""

    name: str
    mods: int
    launched: float
    exited: float
    events: dict[str, float]
    batches: list[float]
    own_cpu: float = 0.0  # CPU seconds of the reader's processes (a JVM and workers too)
    emulator_cpu: float = 0.0  # CPU seconds the emulator spent while the reader ran

    @property
    def seconds(self) -> float:
        return self.exited - self.launched

    def phases(self) -> list[tuple[str, float]]:
        """(phase, seconds) from launch to exit; phases without events are left out."""
        e, b = self.events, self.batches
        marks = [("launched", self.launched)]
        if "imported" in e:  # the stock reader
            marks.append(("imports", e["imported"]))
            marks.append(("reading", e["done"]))
        else:
            if "session" in e:
                marks.append(("imports+JVM+session", e["session"]))
                marks.append(("connect+store+lease", e["running"]))
            else:
                marks.append(("imports", e.get("connecting", e["running"])))
                marks.append(("connect+store+lease", e["running"]))
            if b:
                marks.append(("first-batch", b[0]))
            if len(b) > 1:
                marks.append((f"batches-2..{len(b)}", b[-1]))
        marks.append(("end", self.exited))
        return [(name, at - before) for (_, before), (name, at) in itertools.pairwise(marks)]

    def reading(self) -> float:
        """Seconds of reading alone: the batches (the stock reader: after its imports)."""
        if "imported" in self.events:
            return self.events["done"] - self.events["imported"]
        return self.batches[-1] - self.events["running"] if self.batches else 0.0


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


_BATCH = re.compile(r"batch (\d+): ")


def _events(stderr: str) -> tuple[dict[str, float], list[float]]:
    """From a run's JSON log lines: when the Spark session was up (``session``), when it
    first connected to Spanner (``connecting``), when the engine began (``running``), and
    when each batch ended."""
    events: dict[str, float] = {}
    batches: list[float] = []
    for line in stderr.splitlines():
        if not line.startswith("{"):
            continue
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        message, at = str(doc.get("message", "")), _stamp(doc["time"])
        if message.startswith("Spark session started"):
            events.setdefault("session", at)
        elif message.startswith("connecting to"):
            events.setdefault("connecting", at)
        elif message.startswith("running "):
            events.setdefault("running", at)
        elif _BATCH.match(message):
            batches.append(at)
    return events, batches


def _cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    """CPU seconds of this process's finished (waited) descendants."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _timed(argv: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """Run ``argv``; its launch and exit times (``time.time()``) and its stderr."""
    began = time.time()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    ended = time.time()
    if done.returncode != 0:
        msg = f"{' '.join(argv[:4])} failed ({done.returncode}):\n{done.stderr[-3000:]}"
        raise RuntimeError(msg)
    return began, ended, done.stderr


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_catchup", description=__doc__)
    parser.add_argument("--shapes", type=_shapes,
                        help="backlogs to read, CHANGESxROWS_PER_TRANSACTION separated by "
                             "commas (default: 200000x20,40000x1); the first is judged")
    parser.add_argument("--no-spark", dest="spark", action="store_false")
    parser.add_argument("--set", dest="options", action="append", default=[],
                        type=_option, metavar="NAME=VALUE",
                        help="a run option for the cdcflow runs (repeatable), as `cdcflow "
                             "run --set` takes it, e.g. max_batch_span=60s")
    parser.add_argument("--stock", nargs=4, help=argparse.SUPPRESS)  # DB START END OUT
    parser.add_argument("--ceiling", nargs=4, help=argparse.SUPPRESS)  # DB START END OUT
    args = parser.parse_args(argv)
    if args.stock:
        database, start, end, out = args.stock
        mods, imported = read_stock(database, int(start), int(end))
        Path(out).write_text(json.dumps({"mods": mods, "imported": imported,
                                         "done": time.time()}))
        return
    if args.ceiling:
        database, start, end, out = args.ceiling
        mods, imported, partitions = read_ceiling(
            database, int(start) * 1000, int(end) * 1000
        )
        Path(out).write_text(json.dumps({"mods": mods, "imported": imported,
                                         "done": time.time(), "partitions": partitions}))
        return
    if args.shapes is None:
        scale = from_env(parser, "CDCFLOW_BENCH_CATCHUP_CHANGES", "200000", positive_int)
        args.shapes = [(scale, ROWS_PER_TXN), (max(1, scale // 5), 1)]

    from cdcflow.spanner.emulator import Emulator

    print(f"  cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}", flush=True)
    with Emulator() as emulator, tempfile.TemporaryDirectory(prefix="cdcflow-catchup-") as tmp:
        for i, (changes, per_txn) in enumerate(args.shapes):
            print(f"bench_catchup: a {changes}-change backlog on the emulator ({per_txn} rows "
                  f"per transaction), start-up included"
                  + (" (the targets are judged on this shape)" if i == 0 else ""), flush=True)
            results = _run_shape(emulator, Path(tmp) / f"shape-{i}", changes, per_txn,
                                 args.spark, f"catchup{i}", args.options)
            _report(results, changes, judged=i == 0)
            print(flush=True)


def _option(text: str) -> str:
    """``max_batch_span=60s``: passed on to ``cdcflow run --set``, which checks the value."""
    name, eq, _ = text.partition("=")
    if not eq or not name.strip():
        msg = f"{text!r}: give NAME=VALUE, such as max_batch_span=60s"
        raise argparse.ArgumentTypeError(msg)
    return text


def _shapes(text: str) -> list[tuple[int, int]]:
    """``200000x20,40000x1`` -> [(200000, 20), (40000, 1)]: changes x rows per transaction
    (``200000`` alone: ``ROWS_PER_TXN`` per transaction)."""
    out = []
    try:
        for part in text.split(","):
            changes, _, per_txn = part.strip().partition("x")
            out.append((positive_int(changes), positive_int(per_txn or str(ROWS_PER_TXN))))
    except argparse.ArgumentTypeError:
        msg = (f"{text!r}: give CHANGESxROWS_PER_TRANSACTION separated by commas, whole "
               "numbers of at least 1, such as 200000x20,40000x1")
        raise argparse.ArgumentTypeError(msg) from None
    return out


def _run_shape(emulator: Any, tmp: Path, changes: int, per_txn: int, spark: bool,
               database_id: str, options: list[str]) -> list[Run]:
    """Load a backlog into a database of its own and time every reader on it."""
    tmp.mkdir()
    root = Path(__file__).resolve().parent.parent
    began = time.monotonic()
    database, start, end = _load(emulator, changes, per_txn, database_id)
    print(f"  (loaded in {time.monotonic() - began:.1f}s)", flush=True)
    env = {**os.environ, "SPANNER_EMULATOR_HOST": emulator.host,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(root),
                                                       os.environ.get("PYTHONPATH")]))}
    bounds = [database, str(_micros(start)), str(_micros(end))]
    runs: list[tuple[str, list[str]]] = [
        ("stock reader (1 thread)", ["--stock", *bounds]),
        (CEILING, ["--ceiling", *bounds]),
        ("cdcflow run (in-memory)", []),
    ]
    if spark:
        runs.append(("cdcflow run --runner spark local[2]",
                     ["--runner", "spark", "--master", "local[2]"]))
    results: list[Run] = []
    for i, (name, extra) in enumerate(runs):
        count = tmp / f"count-{i}.txt"
        if extra[:1] in (["--stock"], ["--ceiling"]):
            argv_i = [sys.executable, "-m", "bench.bench_catchup", *extra, str(count)]
        else:
            path = tmp / f"pipeline-{i}.py"
            path.write_text(textwrap.dedent(PIPELINE.format(
                database=database, stream=STREAM, start=start, end=end, count=str(count))))
            argv_i = [sys.executable, "-m", "cdcflow", "run", str(path),
                      "--metadata", f"sqlite:///{tmp / f'state-{i}.db'}",
                      "--log-format", "json", *extra,
                      *itertools.chain.from_iterable(("--set", o) for o in options)]
        cpu_before, emulator_before = _children_cpu(), _cpu_seconds(emulator.pid)
        launched, exited, stderr = _timed(argv_i, env)
        own_cpu = _children_cpu() - cpu_before
        emulator_cpu = _cpu_seconds(emulator.pid) - emulator_before
        if extra[:1] in (["--stock"], ["--ceiling"]):
            doc = json.loads(count.read_text())
            mods = int(doc["mods"])
            events = {"imported": float(doc["imported"]), "done": float(doc["done"])}
            batches: list[float] = []
            if "partitions" in doc:
                name = f"{name} ({doc['partitions']} partitions)"
        else:
            mods = int(count.read_text())
            events, batches = _events(stderr)
        results.append(Run(name, mods, launched, exited, events, batches, own_cpu,
                           emulator_cpu))
        print(f"  ({name}: {exited - launched:.1f}s)", flush=True)
    return results


def _report(results: list[Run], changes: int, judged: bool = True) -> None:
    ref = results[0]
    rate_ref = ref.mods / ref.seconds
    read_ref = ref.mods / ref.reading() if ref.reading() > 0 else float("inf")
    print()
    print(f"  {'reader':<38} {'changes':>8} {'seconds':>8} {'changes/s':>10} {'x stock':>8}")
    for run in results:
        rate = run.mods / run.seconds
        ok = "" if run.mods == changes else f"  WRONG: {run.mods} of {changes} changes"
        print(f"  {run.name:<38} {run.mods:8d} {run.seconds:8.1f} {rate:10.0f} "
              f"{rate / rate_ref:7.2f}x{ok}")
    for run in results[1:]:
        if not run.name.startswith("cdcflow"):
            continue
        target = 2.0 if "spark" in run.name else 4.0
        ratio = run.mods / run.seconds / rate_ref
        if judged:
            print(f"  {run.name}: target >= {target:g}x the stock reader: "
                  f"{'met' if ratio >= target else 'MISSED'} ({ratio:.2f}x)")
    print()
    print("  where the time went (seconds, launch to exit):")
    for run in results:
        phases = "  ".join(f"{name} {seconds:.2f}" for name, seconds in run.phases())
        print(f"  {run.name:<38} {phases}")
    print()
    print(f"  {'reader':<38} {'reading s':>9} {'changes/s':>10} {'x stock':>8}  (reading alone)")
    for run in results:
        reading = run.reading()
        rate = run.mods / reading if reading > 0 else float("inf")
        print(f"  {run.name:<38} {reading:9.2f} {rate:10.0f} {rate / read_ref:7.2f}x")
    _report_cpu(results)


def _report_cpu(results: list[Run]) -> None:
    """The CPU each run took, its own and the emulator's, and the floor it sets: on this
    machine's cores a run needs at least (own + emulator CPU) / cores seconds."""
    cores = os.cpu_count() or 1
    ref = results[0]
    print()
    print(f"  {'reader':<38} {'own CPU s':>9} {'emulator':>9} {'floor s':>8} {'seconds':>8}"
          f"  (floor: (own + emulator CPU) / {cores} cores)")
    for run in results:
        floor = (run.own_cpu + run.emulator_cpu) / cores
        jvm = "spark" in run.name
        print(f"  {run.name:<38} {run.own_cpu:9.2f} {run.emulator_cpu:9.2f} {floor:8.2f} "
              f"{run.seconds:8.2f}" + ("  (its JVM's CPU is not counted: the JVM is not "
                                       "a waited-for child)" if jvm else ""))
    ceiling = next((r for r in results if r.name.startswith(CEILING)), None)
    if ceiling is None:
        return
    served = min(r.emulator_cpu for r in results)
    floor = (served + ceiling.own_cpu) / cores
    best = ref.seconds / floor
    print(f"  serving this backlog costs the emulator at least {served:.2f} CPU s; with the "
          f"ceiling reader's own {ceiling.own_cpu:.2f} s")
    print(f"  (start-up, protobuf parsing, nothing decoded) no run on {cores} cores ends "
          f"before {floor:.2f} s: {best:.2f}x the stock reader at most")
    for target in (4.0, 2.0):
        print(f"  {target:g}x needs {ref.seconds / target:.2f} s: at least "
              f"{(served + ceiling.own_cpu) / (ref.seconds / target):.1f} cores busy for the "
              f"whole run" + (" (more than this machine has)"
                              if ref.seconds / target < floor else ""))
    for run in results:
        phases = dict(run.phases())
        startup = phases.get("imports+JVM+session")
        if startup is not None and startup > ref.seconds / 2:
            print(f"  {run.name}: its start-up alone (interpreter, imports, JVM, Spark "
                  f"session) took {startup:.2f} s, more than the {ref.seconds / 2:.2f} s "
                  "that 2x allows")


if __name__ == "__main__":
    main()
