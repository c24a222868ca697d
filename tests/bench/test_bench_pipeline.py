"""The pipeline benchmark's harness: every reader reads every record (no speed asserts)."""

from __future__ import annotations

from bench import bench_pipeline


def test_every_reader_gets_every_record_and_the_table_says_the_target() -> None:
    results = bench_pipeline.run(120, rounds=1)
    assert [r.name for r in results] == [
        "decode only", "Read -> count", "Read -> Map", "Read -> Map -> WriteFiles",
    ]
    assert all(r.records == 120 and r.seconds > 0 for r in results)
    assert "target >= 0.60 of the decode-only rate per core" in bench_pipeline.table(results)
