"""The decode benchmark's harness works and its three readers agree (no timing asserts)."""

from __future__ import annotations

from bench import bench_decode


def test_in_process_run_agrees_and_reports() -> None:
    results = bench_decode.run(40, rows_per_message=7, rounds=1, in_process=True, check=True)
    compiled = bench_decode._compiled()
    assert [r.name for r in results] == [
        "raw grpc (PartialResultSets)", "stock execute_sql (rows)",
        "stock execute_sql + model", "cdcflow client (model)",
        *([bench_decode.PYTHON_CLIENT] if compiled else []),
    ]
    assert all(r.records == 40 for r in results)
    text = bench_decode.table(results, "decode")
    assert "cdcflow / stock rows:" in text
    assert ("compiled decoder / Python decoder:" in text) == compiled


def test_best_runs_more_rounds_until_their_seconds_are_spent() -> None:
    import time

    calls: list[int] = []

    def round_() -> int:
        calls.append(1)
        time.sleep(0.01)
        return len(calls)

    out, best = bench_decode._best(round_, 2)
    assert (out, len(calls)) == (2, 2)  # no minimum: exactly the rounds asked
    assert best >= 0.01
    calls.clear()
    out, _ = bench_decode._best(round_, 2, min_seconds=0.1)
    assert 2 < len(calls) <= 10 and out == len(calls)  # rounds of 0.01 s or more, to 0.1 s
    calls.clear()
    bench_decode._best(lambda: calls.append(1), 1, min_seconds=3600)
    assert len(calls) == bench_decode.MAX_ROUNDS  # a fast round stops at the cap


def test_served_messages_decode_to_the_records() -> None:
    from google.cloud.spanner_v1.types import PartialResultSet

    from cdcflow.spanner.decode import row_decoder
    from cdcflow.spanner.transport import assemble_rows

    messages = [PartialResultSet.pb().FromString(m)
                for m in bench_decode.encoded_messages(5, rows_per_message=2)]
    assert len(messages) == 3
    rows = list(assemble_rows(iter(messages)))
    decode = row_decoder(rows[0][0].fields[0].type_)
    got = [r for _, row in rows for r in decode(row[0], "bench-token")]
    assert got == bench_decode.make_records(5)
    assert all(len(getattr(r, "mods", ())) == 3 for r in got)


def test_postgresql_messages_decode_to_the_same_records() -> None:
    from cdcflow.spanner.flat import MessageDecoder
    from cdcflow.spanner.shape import RecordShaper

    decoder = MessageDecoder(RecordShaper())
    got = [r for m in bench_decode.postgresql_messages(5, rows_per_message=2)
           for r in decoder.decode(m, "bench-token")]
    assert got == bench_decode.make_records(5)


def test_decode_only_counts_every_record_and_its_floor() -> None:
    results = bench_decode.decode_only(30, tables=3, rows_per_message=7, rounds=1)
    compiled = bench_decode._compiled()
    assert [r.records for r in results] == [30] * (6 if compiled else 5)
    assert results[-1].name.startswith("floor")
    assert results[-2].name == bench_decode.POSTGRESQL_DECODE
    text = bench_decode.decode_table(results, "decode only", results[0])
    assert "typed / floor:" in text and "floor / raw grpc:" in text
    assert "PostgreSQL / GoogleSQL dialect, typed values:" in text
    assert ("compiled decoder / Python decoder:" in text) == compiled
