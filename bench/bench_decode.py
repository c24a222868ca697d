"""How fast change records come out of a Spanner stream: stock client vs cdcflow vs raw gRPC.

A local gRPC server (127.0.0.1, free port, a separate process by default) implements just
enough of ``google.spanner.v1.Spanner`` to serve ``ExecuteStreamingSql``: it replays
pre-serialized PartialResultSets holding N three-mod data change records. The same stream
is read three ways, side by side:

* ``stock``: ``snapshot.execute_sql`` iterated with default decoding (the rows only), and
  ``stock+model``: the same rows turned into cdcflow records;
* ``cdcflow``: :class:`cdcflow.spanner.client.SpannerChangeStreamClient` reading the
  stream (its transport and decoder, producing model records); when the compiled module
  (:mod:`cdcflow.compiled`) is built, once more with the Python decoder, side by side;
* ``raw grpc``: receiving and parsing the PartialResultSets, nothing else (the ceiling).

Every reader is consumed two ways: one by one, each item dropped once counted (what a
pipeline's task does: it pushes each record through the chain and lets it go), and kept
in a list until the end (each round then also pays the interpreter's garbage collector,
which walks every live record, and every object of the process, again and again as the
list grows). The targets are judged one by one, the consumer's shape; both are
printed. Every reader runs with the garbage collector as cdcflow's engine sets it while
batches run (:func:`cdcflow.processes.settled_heap`): the stock client and cdcflow alike.

Then, decoding only (the serialized messages in memory, no server): the same records
spread over ten tables decoded in full with typed values (and again with the Python
decoder, when the compiled one is built), in full with wire values, and with a filter that
wants one of the ten tables (the pushed-down filter skips the other
tables' records after reading their table name); the same records as a PostgreSQL-dialect
database sends them (one JSONB text per row), decoded in full with typed values; beside
them the floor of any decoder on
this protobuf runtime: parsing the messages, pulling out every string and parsing every
JSON text, making no record and typing nothing.

Each figure is a reader's fastest round, of at least ``--rounds`` and more while its
rounds took less than ``--min-seconds`` in all (1 s): a fast reader's round is a few
hundredths of a second, which one busy moment of a shared machine doubles.

``python -m bench.bench_decode [--records N] [--rows-per-message K] [--rounds R]
[--min-seconds S]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from decimal import Decimal
from typing import Any

import attrs

from bench._args import non_negative_float, non_negative_int, positive_int
from cdcflow.model import ColumnType, DataChangeRecord, Mod, Timestamp
from cdcflow.processes import settled_heap

__all__ = ["FakeSpanner", "Result", "decode_only", "main", "make_records", "run"]

STREAM = "BenchStream"
DATABASE = "projects/bench/instances/bench/databases/bench"
_SERVICE = "google.spanner.v1.Spanner"
_START_NS = Timestamp.parse("2024-05-01T12:00:00Z").ns

_COLUMNS = (
    ColumnType("OrderId", {"code": "INT64"}, True, 1),
    ColumnType("Customer", {"code": "STRING"}, False, 2),
    ColumnType("Amount", {"code": "NUMERIC"}, False, 3),
    ColumnType("Status", {"code": "STRING"}, False, 4),
    ColumnType("UpdatedAt", {"code": "TIMESTAMP"}, False, 5),
    ColumnType("Attributes", {"code": "JSON"}, False, 6),
)


def make_records(n: int, token: str = "bench-token", tables: int = 1) -> list[DataChangeRecord]:
    """N UPDATE records of three mods each, commit timestamps 1 µs apart (plus 7 ns), with
    typed values (what the decoder gives); with ``tables`` > 1 record i is of table
    ``Orders{i % tables}``."""
    out = []
    for i in range(n):
        ts = Timestamp.from_ns(_START_NS + i * 1000 + 7)
        mods = [
            Mod(
                {"OrderId": i * 3 + j},
                {"Customer": f"customer-{i % 97}", "Amount": Decimal(f"{i}.{j}5"),
                 "Status": "SHIPPED", "UpdatedAt": ts,
                 "Attributes": {"gift": True, "notes": "leave at door"}},
                {"Customer": f"customer-{i % 97}", "Amount": Decimal(f"{i}.{j}0"),
                 "Status": "PAID", "UpdatedAt": None, "Attributes": None},
            )
            for j in range(3)
        ]
        table = "Orders" if tables == 1 else f"Orders{i % tables}"
        out.append(DataChangeRecord(
            token, ts, "00000000", f"txn-{i}", True, table, _COLUMNS, mods, "UPDATE",
            "OLD_AND_NEW_VALUES", 1, 1, "", False,
        ))
    return out


def encoded_messages(n: int, rows_per_message: int, tables: int = 1) -> list[bytes]:
    """The serialized PartialResultSets of the change stream query's answer."""
    from cdcflow.spanner import wire

    values = [wire.encode_googlesql([r]) for r in make_records(n, tables=tables)]
    prs = wire.partial_result_sets(
        wire.row_type(wire.googlesql_column_type()), values, rows_per_message=rows_per_message
    )
    return [p.SerializeToString() for p in prs]


def postgresql_messages(n: int, rows_per_message: int, tables: int = 1) -> list[bytes]:
    """The same records as a PostgreSQL-dialect database's answer (one JSONB per row)."""
    from cdcflow.spanner import wire

    values = [wire.encode_postgresql(r) for r in make_records(n, tables=tables)]
    prs = wire.partial_result_sets(
        wire.row_type(wire.postgresql_column_type()), values, rows_per_message=rows_per_message
    )
    return [p.SerializeToString() for p in prs]


def _metadata_answer(sql: str) -> list[bytes]:
    """Answers to the client's information_schema queries."""
    from cdcflow.spanner import wire

    if "database_options" in sql:
        prs = wire.string_rows(["option_value"], [["GOOGLE_STANDARD_SQL"]])
    elif "change_stream_options" in sql:
        prs = wire.string_rows(["option_name", "option_value"], [])
    else:
        prs = wire.string_rows(["change_stream_name"], [[STREAM]])
    return [p.SerializeToString() for p in prs]


class FakeSpanner:
    """An in-process gRPC server that serves ``messages`` to every change stream query."""

    def __init__(self, messages: Sequence[bytes], port: int | None = None) -> None:
        from cdcflow.spanner.emulator import free_port

        self.messages = list(messages)
        self.port = port or free_port()
        self._server: Any = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FakeSpanner:
        import grpc
        from google.cloud.spanner_v1.types import (
            BatchCreateSessionsResponse,
            ExecuteSqlRequest,
            Session,
        )

        session_pb = Session.pb()
        sql_pb = ExecuteSqlRequest.pb()
        counter = iter(range(1, 1 << 30))

        def session(database: str) -> Any:
            return session_pb(name=f"{database}/sessions/s{next(counter)}")

        def create_session(raw: bytes, ctx: Any) -> bytes:
            from google.cloud.spanner_v1.types import CreateSessionRequest

            request = CreateSessionRequest.pb().FromString(raw)
            return bytes(session(request.database).SerializeToString())

        def batch_create(raw: bytes, ctx: Any) -> bytes:
            from google.cloud.spanner_v1.types import BatchCreateSessionsRequest

            request = BatchCreateSessionsRequest.pb().FromString(raw)
            resp = BatchCreateSessionsResponse.pb()()
            for _ in range(request.session_count):
                resp.session.append(session(request.database))
            return bytes(resp.SerializeToString())

        def get_session(raw: bytes, ctx: Any) -> bytes:
            return raw  # GetSessionRequest.name is field 1, like Session.name

        def delete_session(raw: bytes, ctx: Any) -> bytes:
            return b""

        def execute(raw: bytes, ctx: Any) -> Iterator[bytes]:
            sql = sql_pb.FromString(raw).sql
            if "READ_" in sql:
                yield from self.messages
            else:
                yield from _metadata_answer(sql)

        def unary(fn: Callable[[bytes, Any], bytes]) -> Any:
            return grpc.unary_unary_rpc_method_handler(fn)

        handler = grpc.method_handlers_generic_handler(_SERVICE, {
            "CreateSession": unary(create_session),
            "BatchCreateSessions": unary(batch_create),
            "GetSession": unary(get_session),
            "DeleteSession": unary(delete_session),
            "ExecuteStreamingSql": grpc.unary_stream_rpc_method_handler(execute),
        })
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=4),
            options=[("grpc.max_send_message_length", 64 << 20)],
        )
        self._server.add_generic_rpc_handlers((handler,))
        self._server.add_insecure_port(self.host)
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(None)
            self._server = None


# --- the three readers ----------------------------------------------------------------------


def _stock_database(host: str) -> Any:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import spanner

    client = spanner.Client(
        project="bench",
        credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
        client_options={"api_endpoint": host},
        disable_builtin_metrics=True,
    )
    return client, client.instance("bench").database("bench")  # type: ignore[no-untyped-call]


def _stock_params() -> tuple[str, dict[str, Any], dict[str, Any]]:
    from google.cloud.spanner_v1 import param_types

    sql = f"SELECT ChangeRecord FROM READ_{STREAM}(@s, @e, @t, 1000)"
    start = Timestamp.from_ns(_START_NS)
    params = {"s": start, "e": None, "t": "bench-token"}
    types = {"s": param_types.TIMESTAMP, "e": param_types.TIMESTAMP, "t": param_types.STRING}
    return sql, params, types


def read_stock(database: Any, to_model: bool) -> Iterator[Any]:
    """The stock client's rows (or the records made of them), one at a time."""
    from cdcflow.spanner.decode import records_from_stock_row

    sql, params, types = _stock_params()
    with database.snapshot() as snapshot:
        for row in snapshot.execute_sql(sql, params=params, param_types=types):
            if to_model:
                yield from records_from_stock_row(row, "bench-token")
            else:
                yield row


def read_cdcflow(client: Any) -> Iterator[Any]:
    from cdcflow.model import MAX_NS
    from cdcflow.stream import ChangeStreamQuery

    return iter(client.read(ChangeStreamQuery(STREAM, "bench-token", _START_NS, MAX_NS)))


def read_raw(host: str) -> Iterator[Any]:
    """Every PartialResultSet, parsed (the row count of each is what a reader consumes)."""
    import grpc
    from google.cloud.spanner_v1.types import ExecuteSqlRequest, PartialResultSet

    request = ExecuteSqlRequest.pb()(session="x", sql=f"SELECT ChangeRecord FROM READ_{STREAM}")
    with grpc.insecure_channel(host) as channel:
        call = channel.unary_stream(
            f"/{_SERVICE}/ExecuteStreamingSql",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=PartialResultSet.pb().FromString,
        )
        yield from call(request)


# --- running --------------------------------------------------------------------------------


@attrs.frozen
class Result:
    """A reader's records and its fastest round consumed one by one (``seconds``) and kept
    in a list (``kept_seconds``; None: not measured)."""

    name: str
    records: int
    seconds: float
    kept_seconds: float | None = None

    @property
    def rate(self) -> float:
        return self.records / self.seconds if self.seconds > 0 else float("inf")

    @property
    def kept_rate(self) -> float | None:
        if self.kept_seconds is None:
            return None
        return self.records / self.kept_seconds if self.kept_seconds > 0 else float("inf")


#: Most rounds :func:`_best` runs to fill its ``min_seconds``.
MAX_ROUNDS = 50


def _best(fn: Callable[[], Any], rounds: int, min_seconds: float = 0.0) -> tuple[Any, float]:
    """The output of the last round and the fastest round's seconds, of ``rounds`` rounds
    and more while they took less than ``min_seconds`` in all (up to MAX_ROUNDS): a fast
    reader's round lasts a few hundredths of a second, which one busy moment of the machine
    doubles, so it gets more rounds for its best to be a fair one."""
    best = float("inf")
    out: Any = None
    spent = 0.0
    done = 0
    while done < rounds or (spent < min_seconds and done < MAX_ROUNDS):
        out = None  # let the previous round's records go before timing the next
        t0 = time.perf_counter()
        out = fn()
        took = time.perf_counter() - t0
        best = min(best, took)
        spent += took
        done += 1
    return out, best


def _one_by_one(items: Iterator[Any]) -> int:
    n = 0
    for _ in items:
        n += 1
    return n


def _measure(
    name: str, read: Callable[[], Iterator[Any]], rounds: int,
    count: Callable[[Any], int] | None = None, min_seconds: float = 0.0,
) -> tuple[Result, list[Any]]:
    """``read()`` consumed one by one (``count(item)`` records per item, else 1), then
    kept in a list: the result and the kept items of the last round."""

    def one_by_one() -> int:
        if count is None:
            return _one_by_one(read())
        return sum(count(item) for item in read())

    n, secs = _best(one_by_one, rounds, min_seconds)
    kept, kept_secs = _best(lambda: list(read()), rounds, min_seconds)
    return Result(name, n, secs, kept_secs), kept


def _start_server(
    n: int, rows_per_message: int, in_process: bool
) -> tuple[str, Callable[[], None]]:
    if in_process:
        server = FakeSpanner(encoded_messages(n, rows_per_message)).start()
        return server.host, server.stop
    from cdcflow.spanner.emulator import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.bench_decode", "--serve", str(port),
         "--records", str(n), "--rows-per-message", str(rows_per_message)],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        proc.kill()
        msg = f"the benchmark server did not start (said {line!r})"
        raise RuntimeError(msg)

    def stop() -> None:
        proc.terminate()
        proc.wait(10)

    return f"127.0.0.1:{port}", stop


def run(
    n: int, *, rows_per_message: int = 1, rounds: int = 3, in_process: bool = False,
    check: bool = True, min_seconds: float = 0.0,
) -> list[Result]:
    """Read N records each way, each reader's best of ``rounds`` rounds and more while
    they took less than ``min_seconds`` (see :func:`_best`); with ``check``, prove all
    ways give the same records."""
    from cdcflow.spanner.client import SpannerChangeStreamClient

    host, stop = _start_server(n, rows_per_message, in_process)
    old_env = os.environ.get("SPANNER_EMULATOR_HOST")
    os.environ["SPANNER_EMULATOR_HOST"] = host
    stock_client, database = _stock_database(host)
    client = SpannerChangeStreamClient(DATABASE)
    try:
        with settled_heap():
            results, readers = _measure_all(host, database, client, rounds, min_seconds)
        if check:
            expected = make_records(n)
            if any(records != expected for records in readers):
                msg = "the readers disagree with the served records; the benchmark is invalid"
                raise AssertionError(msg)
        return results
    finally:
        client.close()
        stock_client.close()
        if old_env is None:
            os.environ.pop("SPANNER_EMULATOR_HOST", None)
        else:
            os.environ["SPANNER_EMULATOR_HOST"] = old_env
        stop()


def _measure_all(host: str, database: Any, client: Any, rounds: int, min_seconds: float
                 ) -> tuple[list[Result], list[list[Any]]]:
    """Every reader's result, and the records of the readers that make them."""
    raw, _ = _measure("raw grpc (PartialResultSets)", lambda: read_raw(host), rounds,
                      count=lambda prs: len(prs.values), min_seconds=min_seconds)
    rows, kept = _measure("stock execute_sql (rows)",
                          lambda: read_stock(database, to_model=False), rounds,
                          min_seconds=min_seconds)
    del kept
    stock_model, stock = _measure("stock execute_sql + model",
                                  lambda: read_stock(database, to_model=True), rounds,
                                  min_seconds=min_seconds)
    fast_result, fast = _measure("cdcflow client (model)", lambda: read_cdcflow(client),
                                 rounds, min_seconds=min_seconds)
    results = [raw, rows, stock_model, fast_result]
    readers = [stock, fast]
    if _compiled():
        with _python_decoder():
            slow_result, slow = _measure(PYTHON_CLIENT, lambda: read_cdcflow(client), rounds,
                                         min_seconds=min_seconds)
        results.append(slow_result)
        readers.append(slow)
    return results, readers


PYTHON_CLIENT = "cdcflow client, Python decoder"
PYTHON_DECODE = "full decode (typed, Python decoder)"
POSTGRESQL_DECODE = "full decode (typed, PostgreSQL)"


def _compiled() -> bool:
    from cdcflow.spanner.records import compiled_decoder

    return compiled_decoder()


@contextmanager
def _python_decoder() -> Iterator[None]:
    """cdcflow decodes with its Python decoder (not the compiled one) meanwhile."""
    from cdcflow.spanner import records

    saved = records._SPEEDUPS
    records._SPEEDUPS = None
    try:
        yield
    finally:
        records._SPEEDUPS = saved


def table(results: Sequence[Result], title: str) -> str:
    by_name = {r.name: r for r in results}
    lines = [title, f"{'reader':30} {'records':>8} {'one by one':>12} {'records/s':>10} "
                    f"{'kept in a list':>15}"]
    for r in results:
        kept = r.kept_rate
        lines.append(f"{r.name:30} {r.records:8d} {r.seconds:11.3f}s {r.rate:10,.0f} "
                     f"{'' if kept is None else f'{kept:11,.0f} /s':>15}")
    fast = by_name["cdcflow client (model)"]
    rows = by_name["stock execute_sql (rows)"]
    model = by_name["stock execute_sql + model"]
    raw = by_name["raw grpc (PartialResultSets)"]

    def kept(a: Result, b: Result) -> float:
        return (a.kept_rate or 0.0) / (b.kept_rate or 1.0)

    lines.append(
        f"cdcflow / stock rows: {fast.rate / rows.rate:.1f}x (kept: {kept(fast, rows):.1f}x)   "
        f"cdcflow / stock + model: {fast.rate / model.rate:.1f}x   "
        f"cdcflow / raw grpc: {fast.rate / raw.rate:.2f}"
    )
    slow = by_name.get(PYTHON_CLIENT)
    if slow is not None:
        lines.append(f"compiled decoder / Python decoder: {fast.rate / slow.rate:.1f}x   "
                     f"Python decoder / stock rows: {slow.rate / rows.rate:.1f}x")
    return "\n".join(lines)


def decode_only(n: int, *, tables: int = 10, rows_per_message: int = 50, rounds: int = 3,
                min_seconds: float = 0.0) -> list[Result]:
    """Decode N records spread over ``tables`` tables from their serialized messages (the
    reader's path, without a server), one message at a time, each message's records
    dropped once counted: in full (typed, then wire values), with a filter that wants one
    table, and the floor (see the module docstring). Every result counts the N records
    decoded; the filtered one checks that it kept exactly that table's. Each is the best of
    ``rounds`` rounds and more while they took less than ``min_seconds`` (:func:`_best`)."""
    from cdcflow.model import DataChangeRecord
    from cdcflow.spanner.flat import MessageDecoder
    from cdcflow.spanner.shape import RecordShaper
    from cdcflow.stream import RecordFilter

    messages = encoded_messages(n, rows_per_message, tables=tables)

    def decode(shaper: RecordShaper) -> tuple[int, int, set[str]]:
        decoder = MessageDecoder(shaper)
        count = data = 0
        names: set[str] = set()
        for message in messages:
            for record in decoder.decode(message, "bench-token"):
                count += 1
                if type(record) is DataChangeRecord:
                    data += 1
                    names.add(record.table_name)
        return count, data, names

    wanted = RecordShaper(filter=RecordFilter.build(tables=["Orders0"]))
    cases = [
        ("full decode (typed values)", RecordShaper()),
        ("full decode (wire values)", RecordShaper(typed=False)),
        (f"decode with 1 of {tables} tables wanted", wanted),
    ]
    results = []
    for name, shaper in cases:
        (count, data, names), secs = _best(lambda shaper=shaper: decode(shaper), rounds,
                                            min_seconds)
        results.append(Result(name, count, secs))
        if shaper is wanted and (data != len(range(0, n, tables)) or names != {"Orders0"}):
            msg = "the filtered decode kept the wrong records; the benchmark is invalid"
            raise AssertionError(msg)
    if _compiled():
        with _python_decoder():
            (count, _, _), secs = _best(lambda: decode(RecordShaper()), rounds, min_seconds)
        results.append(Result(PYTHON_DECODE, count, secs))
    # the same records as a PostgreSQL-dialect database sends them (one JSONB per row)
    messages = postgresql_messages(n, rows_per_message, tables=tables)
    (count, data, _), secs = _best(lambda: decode(RecordShaper()), rounds, min_seconds)
    if data != n:
        msg = "the PostgreSQL decode did not give every record; the benchmark is invalid"
        raise AssertionError(msg)
    results.append(Result(POSTGRESQL_DECODE, count, secs))
    messages = encoded_messages(n, rows_per_message, tables=tables)
    texts, secs = _best(lambda: _floor(messages), rounds, min_seconds)
    if texts != 9 * n:
        msg = f"the floor read {texts} JSON texts, not {9 * n}; the benchmark is invalid"
        raise AssertionError(msg)
    results.append(Result("floor: parse, strings, JSON", n, secs))
    return results


def _floor(messages: Sequence[bytes]) -> int:
    """What any decoder must do on this protobuf runtime, at the least: parse each message,
    pull out every string (with the merged message types of cdcflow.spanner.flat, the
    cheapest way) and parse every JSON text of every mod. Returns the texts parsed."""
    import orjson

    from cdcflow.spanner import flat

    types = flat._types()
    loads = orjson.loads
    texts = 0
    for message in messages:
        leaf = flat._leaf(flat._leaf(types.merged(message).values))
        for listed in leaf.l[1::2]:  # each record's mods (its column types come first)
            for text in types.mods(listed).values.list_value.values.s:
                loads(text)
                texts += 1
    return texts


def decode_table(results: Sequence[Result], title: str, raw: Result | None = None) -> str:
    lines = [title, f"{'decoder':34} {'records':>9} {'seconds':>8} {'records/s':>11}"]
    for r in results:
        lines.append(f"{r.name:34} {r.records:9d} {r.seconds:8.3f} {r.rate:11,.0f}")
    typed, wire, wanted, floor = (r for r in results
                                  if r.name not in (PYTHON_DECODE, POSTGRESQL_DECODE))
    lines.append(
        f"typed / wire values: {typed.rate / wire.rate:.2f}   "
        f"1 table wanted / full typed decode: {wanted.rate / typed.rate:.1f}x   "
        f"typed / floor: {typed.rate / floor.rate:.2f}"
        + (f"   floor / raw grpc: {floor.rate / raw.rate:.2f}" if raw is not None else "")
    )
    pg = next((r for r in results if r.name == POSTGRESQL_DECODE), None)
    if pg is not None:
        lines.append(f"PostgreSQL / GoogleSQL dialect, typed values: {pg.rate / typed.rate:.2f}")
    slow = next((r for r in results if r.name == PYTHON_DECODE), None)
    if slow is not None:
        lines.append(f"typed values, compiled decoder / Python decoder: "
                     f"{typed.rate / slow.rate:.1f}x")
    return "\n".join(lines)


def _serve(port: int, n: int, rows_per_message: int) -> None:
    server = FakeSpanner(encoded_messages(n, rows_per_message), port=port).start()
    print("READY", flush=True)
    try:
        while True:  # until the benchmark terminates this process
            time.sleep(3600)
    finally:
        server.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.bench_decode", description=__doc__)
    parser.add_argument("--records", type=positive_int, default=10_000)
    parser.add_argument("--rows-per-message", type=non_negative_int, default=0,
                        help="records per PartialResultSet (0: run 1 and 50)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="the fewest rounds of each reader, whose best counts")
    parser.add_argument("--min-seconds", type=non_negative_float, default=1.0,
                        help="more rounds while a reader's took less than this in all "
                             f"(at most {MAX_ROUNDS})")
    parser.add_argument("--in-process", action="store_true", help="serve from this process")
    parser.add_argument("--serve", type=non_negative_int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve(args.serve, args.records, max(1, args.rows_per_message))
        return
    print(f"load average: {os.getloadavg()[0]:.2f} (cores: {os.cpu_count()}); decoder: "
          + ("compiled (cdcflow._speedups)" if _compiled() else "Python"))
    raw: Result | None = None
    for rpm in [args.rows_per_message] if args.rows_per_message else [1, 50]:
        results = run(args.records, rows_per_message=rpm, rounds=args.rounds,
                      in_process=args.in_process, min_seconds=args.min_seconds)
        print(table(results, f"decode: {args.records} three-mod data change records, "
                             f"{rpm} per PartialResultSet"))
        print()
        if rpm == 50 or raw is None:
            raw = results[0]
    with settled_heap():  # as the engine sets the collector while batches run
        decoded = decode_only(args.records, rounds=args.rounds, min_seconds=args.min_seconds)
    print(decode_table(
        decoded,
        f"decode only: {args.records} three-mod records over 10 tables, 50 per message, "
        "serialized, no server",
        raw,
    ))
    print()


if __name__ == "__main__":
    main()
