"""What sinks report (Sink.metrics()) as cdcflow_sink_* metrics: the listener's families, and
a live run into WriteTables scraped over real HTTP."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import cdcflow as cf
from cdcflow.metrics import PipelineMetrics
from cdcflow.testing import ScriptedChangeStream
from tests.test_metrics import NOW, Clock, S, _Scraper, batch, parse, value


def test_sink_numbers_become_counters_and_gauges_by_sink() -> None:
    metrics = PipelineMetrics("orders", clock=Clock())
    metrics.on_batch(batch(1, sink_metrics={
        "lake": {"files_uploaded_total": 2, "spool_memory_bytes": 4096},
        "copy": {"files_uploaded_total": 1, "Bad-Name": 1, "writes_total": 9}}))
    metrics.on_batch(batch(2, sink_metrics={"lake": {"files_uploaded_total": 5,
                                                     "spool_memory_bytes": 0}}))
    got = parse(metrics.exposition().decode())
    # a sink reports running totals and current values: the latest report counts
    assert value(got, "cdcflow_sink_files_uploaded_total", sink="lake") == 5
    assert value(got, "cdcflow_sink_files_uploaded_total", sink="copy") == 1
    assert value(got, "cdcflow_sink_spool_memory_bytes", sink="lake") == 0
    names = {name for name, _ in got}
    assert not any("Bad" in n for n in names)  # not a metric name: left out
    # the engine's own family keeps its name and its counts
    assert value(got, "cdcflow_sink_writes_total", sink="out") == 12
    text = metrics.exposition().decode()
    assert "# TYPE cdcflow_sink_files_uploaded_total counter" in text
    assert "# TYPE cdcflow_sink_spool_memory_bytes gauge" in text


def test_a_live_run_reports_what_write_tables_cut_and_uploaded(tmp_path: Path) -> None:
    origin = NOW
    stream = ScriptedChangeStream("Orders", partitions=2, origin=origin)
    for i in range(300):
        stream.write("Orders", {"id": i}, "INSERT", {"n": i, "note": "x" * 40},
                     at=origin + (i + 1) * 10_000_000)
    out = tmp_path / "lake"

    def slow(record: Any) -> Any:
        time.sleep(0.004)
        return record

    pipeline = cf.Pipeline("sinkmetrics")
    (pipeline
     | cf.ReadChangeStream(stream="Orders", start_at=origin, end_at=origin + 4 * S,
                           client=stream)
     | cf.Filter(slow)
     | "lake" >> cf.WriteTables(str(out), format="jsonl", file_size="2KiB",
                                flush_interval="1h"))
    urls: list[str] = []
    scraper = _Scraper(urls, every=0.05)
    scraper.start()
    try:
        summary = pipeline.run("memory", "memory://", metrics_port=0, on_metrics=urls.append,
                               max_batch_span="200ms", batch_interval=0)
    finally:
        scraper.done.set()
        scraper.join()
    assert summary.reason == "end reached"
    files = sorted(out.glob("Orders/part-*.jsonl"))
    lines = sum(len(f.read_bytes().splitlines()) for f in files)
    assert lines == 300

    def sample(samples: Any, name: str) -> float | None:
        try:
            return value(samples, name, pipeline="sinkmetrics", sink="lake")
        except KeyError:
            return None

    seen = [(sample(s, "cdcflow_sink_files_uploaded_total"),
             sample(s, "cdcflow_sink_files_cut_size_total"),
             sample(s, "cdcflow_sink_uploaded_bytes_total"))
            for _, s in scraper.scrapes]
    seen = [row for row in seen if row[0] is not None]
    assert seen, f"no scrape saw the sink's metrics ({len(scraper.scrapes)} scrapes)"
    uploaded = [row[0] for row in seen]
    assert uploaded == sorted(uploaded)  # a running total
    assert 1 <= uploaded[-1] <= len(files), (uploaded, len(files))
    assert seen[-1][1] is not None and seen[-1][1] >= uploaded[-1]  # cut before uploaded
    size = sum(f.stat().st_size for f in files)
    assert 0 < (seen[-1][2] or 0) <= size
