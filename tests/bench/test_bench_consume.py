"""The Consume benchmark's harness works and its checks catch what they check (no timing
asserts: the speedup is measured by ``make bench``)."""

from __future__ import annotations

import pytest

from bench import bench_consume


def test_both_settings_run_and_report() -> None:
    results = [
        run(30, 5, 0.0, n)
        for run in (bench_consume.run_writer, bench_consume.run_pipeline)
        for n in (1, 16)
    ]
    assert [(r.setting, r.max_inflight, r.elements) for r in results] == [
        ("writer", 1, 30), ("writer", 16, 30), ("pipeline", 1, 30), ("pipeline", 16, 30),
    ]
    text = bench_consume.table(results, "consume")
    assert "max_inflight=16 / 1 (target >= 10x): writer: " in text and "pipeline: " in text


def test_the_check_catches_reordering_overlap_and_loss() -> None:
    expected = [("k", "a"), ("k", "b")]
    bench_consume._CALLS["order"] = [("k", "b", 0.0, 1.0), ("k", "a", 2.0, 3.0)]
    with pytest.raises(AssertionError, match="out of order"):
        bench_consume._check("order", expected)
    bench_consume._CALLS["overlap"] = [("k", "a", 0.0, 2.0), ("k", "b", 1.0, 3.0)]
    with pytest.raises(AssertionError, match="two calls at once"):
        bench_consume._check("overlap", expected)
    bench_consume._CALLS["lost"] = [("k", "a", 0.0, 1.0)]
    with pytest.raises(AssertionError, match="exactly once"):
        bench_consume._check("lost", expected)
    bench_consume._CALLS["fine"] = [("k", "a", 0.0, 1.0), ("k", "b", 1.0, 2.0)]
    bench_consume._check("fine", expected)
