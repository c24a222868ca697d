"""Metrics fed by the tasks' counters: Spanner query latency and errors, in-flight bytes and
quota waits. Unit checks on the listener, then runs on the in-memory runner whose counters
travel in the task results, scraped over real HTTP."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import cdcflow as cf
from cdcflow.engine.listener import BatchStats, EngineListener, RunSummary
from cdcflow.metrics import PipelineMetrics
from cdcflow.model import ChangeRecord
from cdcflow.spanner.retry import QUERY_BUCKETS, ObservedRead, QueryStats
from cdcflow.stream import ChangeStreamQuery, StreamInfo
from cdcflow.testing import ScriptedChangeStream
from tests.test_metrics import NOW, Clock, S, batch, parse, scrape, value


def test_query_histograms_errors_and_inflight_come_from_task_counters() -> None:
    metrics = PipelineMetrics("orders", clock=Clock())
    stats = QueryStats()
    stats.query(0.02, 0.005)
    stats.query(0.2, None)
    stats.error(_Unavailable())
    counters = {**stats.counters, "inflight_bytes_peak": 4096, "quota_waits": 3,
                "quota_wait_us": 1_500_000}
    metrics.on_batch(batch(1, counters=counters))
    metrics.on_batch(batch(2, counters={**stats.counters, "inflight_bytes_peak": 1024}))
    s = parse(metrics.exposition().decode())
    assert value(s, "cdcflow_spanner_query_seconds_count") == 4
    assert value(s, "cdcflow_spanner_query_seconds_sum") == 0.44
    assert value(s, "cdcflow_spanner_query_seconds_bucket", le="0.025") == 2
    assert value(s, "cdcflow_spanner_query_seconds_bucket", le="0.1") == 2
    assert value(s, "cdcflow_spanner_query_seconds_bucket", le="0.25") == 4
    assert value(s, "cdcflow_spanner_query_seconds_bucket", le="+Inf") == 4
    assert value(s, "cdcflow_spanner_first_response_seconds_count") == 2
    assert value(s, "cdcflow_spanner_first_response_seconds_bucket", le="0.01") == 2
    assert value(s, "cdcflow_spanner_errors_total", code="UNAVAILABLE") == 2
    assert value(s, "cdcflow_inflight_bytes") == 1024  # the last batch's peak: a gauge
    assert value(s, "cdcflow_quota_waits_total") == 3
    assert value(s, "cdcflow_quota_wait_seconds_total") == 1.5
    buckets = [k for k in s if k[0] == "cdcflow_spanner_query_seconds_bucket"]
    assert len(buckets) == len(QUERY_BUCKETS) + 1


class _Unavailable(Exception):
    """Shaped like an api_core error: ``grpc_status_code`` names the status."""

    class _Code:
        name = "UNAVAILABLE"

    grpc_status_code = _Code()


# -- counters that travel from the tasks --------------------------------------------------------

_reads_lock = threading.Lock()
_reads: list[str] = []


class _MeasuredStream:
    """A scripted stream that measures its reads as the Spanner reader does (QueryStats in
    an ObservedRead): one query per read, a retried UNAVAILABLE on p1's first read."""

    def __init__(self, inner: ScriptedChangeStream) -> None:
        self.inner = inner

    def describe_stream(self, stream: str) -> StreamInfo:
        return self.inner.describe_stream(stream)

    def read(self, query: ChangeStreamQuery) -> ObservedRead:
        stats = QueryStats()
        with _reads_lock:
            first_p1 = query.partition_token == "p1" and "p1" not in _reads
            _reads.append(query.partition_token or "")
        if first_p1:
            stats.error(_Unavailable())
            stats.query(0.001, None)
        return ObservedRead(self._timed(query, stats), stats)

    def _timed(self, query: ChangeStreamQuery, stats: QueryStats) -> Iterator[ChangeRecord]:
        began = time.perf_counter()
        try:
            yield from self.inner.read(query)
        finally:
            stats.query(time.perf_counter() - began, None)

    def close(self) -> None:
        self.inner.close()


def _run(name: str, read: cf.ReadPartition, *steps: Any) -> tuple[dict[Any, float], int]:
    stream = ScriptedChangeStream("Orders", partitions=2, origin=NOW)
    for i in range(40):
        stream.write("Orders", {"id": i}, "INSERT", {"n": i}, at=NOW + (i + 1) * 100_000_000)
    out = cf.Collect()
    pipeline = cf.Pipeline(name)
    chain: Any = (pipeline
                  | cf.DetectPartitions(stream="Orders", start_at=NOW, end_at=NOW + 6 * S,
                                        client=_MeasuredStream(stream))
                  | read)
    for step in steps:
        chain = chain | step
    chain | out
    urls: list[str] = []
    pipeline.run("memory", "memory://", metrics_port=0, on_metrics=urls.append,
                 batch_interval=0, max_batch_span="2s", idle_read_interval=0,
                 listener=_KeepServing(name, urls))
    assert len(out.items) == 40
    return _last_scrape[name], len(out.items)


_last_scrape: dict[str, dict[Any, float]] = {}


_peaks: dict[str, list[int]] = {}


class _KeepServing(EngineListener):
    """Notes each batch's in-flight peak, and scrapes the run's metrics over HTTP as it
    stops (the server still serves then)."""

    def __init__(self, name: str, urls: list[str]) -> None:
        self.urls = urls
        self.peaks = _peaks[name] = []

    def on_batch(self, stats: BatchStats) -> None:
        self.peaks.append(stats.counters.get("inflight_bytes_peak", 0))

    def on_stop(self, summary: RunSummary) -> None:
        _last_scrape[summary.pipeline] = scrape(self.urls[0])


def test_query_counters_travel_in_task_results_to_the_scrape() -> None:
    del _reads[:]
    s, _ = _run("queries", cf.ReadPartition(heartbeat="100ms"))
    reads = len(_reads)  # every planned slice is read once (no batch was retried)

    def v(metric: str, **labels: str) -> float:
        return value(s, metric, pipeline="queries", **labels)

    assert v("cdcflow_spanner_errors_total", code="UNAVAILABLE") == 1
    assert v("cdcflow_spanner_query_seconds_count") == reads + 1
    assert 0 < v("cdcflow_spanner_query_seconds_sum") < 10
    assert v("cdcflow_inflight_bytes") == 0  # max_inflight 1: nothing in flight
    assert v("cdcflow_inflight_bytes_limit") == 256 << 20  # the default quota
    assert v("cdcflow_quota_waits_total") == 0
    # a few KB a batch: the span doubles up to max_batch_span and stays there
    assert v("cdcflow_batch_span_seconds") == 2.0


def test_the_quota_of_a_pipeline_with_a_batch_step_is_the_process_s_once() -> None:
    # The step's downstream chain reports the same process quota as the tasks: a level,
    # the largest, not a count (it read 2 x 256 MiB, 3 x with two steps).
    from cdcflow.transforms import GroupTransactions

    s, _ = _run("stepped", cf.ReadPartition(heartbeat="100ms"), GroupTransactions())
    assert value(s, "cdcflow_inflight_bytes_limit", pipeline="stepped") == 256 << 20


def _slow(record: Any) -> Any:
    time.sleep(0.004)
    return record


def test_inflight_bytes_and_quota_waits_of_a_bounded_reader() -> None:
    # One byte of quota: a record is admitted only once nothing else is in flight, so every
    # record after a task's first waits for the one before it (4 ms in the Map).
    read = cf.ReadPartition(heartbeat="100ms", max_inflight=4, max_inflight_bytes=1)
    s, records = _run("bounded", read, "slow" >> cf.Map(_slow))

    def v(metric: str) -> float:
        return value(s, metric, pipeline="bounded")

    waits = v("cdcflow_quota_waits_total")
    assert records / 2 <= waits < records, waits
    assert v("cdcflow_quota_wait_seconds_total") >= waits * 0.001
    # a gauge of the last batch's peak (the last batches read no data: 0 then)
    peaks = _peaks["bounded"]
    assert max(peaks) > 0 and v("cdcflow_inflight_bytes") == peaks[-1]
    assert v("cdcflow_inflight_bytes_limit") == 1


_release = threading.Event()


def _held_back(record: Any) -> Any:
    _release.wait(60)  # until the test has scraped the run mid-batch
    return record


def _live_mid_batch(name: str, metric: str, read: cf.ReadPartition) -> float:
    """Run 20 records of 1 KB through ``read`` into a step that holds them until the test
    has scraped ``metric`` above 0 mid-batch (or 30 s passed); its value then. The run's
    end then delivers every record."""
    _release.clear()
    stream = ScriptedChangeStream("Orders", partitions=1, origin=NOW)
    for i in range(20):
        stream.write("Orders", {"id": i}, "INSERT", {"n": "x" * 1000}, at=NOW + (i + 1) * 1000)
    pipeline = cf.Pipeline(name)
    out = cf.Collect()
    (pipeline
     | cf.DetectPartitions(stream="Orders", start_at=NOW, end_at=NOW + S, client=stream)
     | read | cf.Map(_held_back) | out)
    urls: list[str] = []
    run = threading.Thread(target=pipeline.run, args=("memory", "memory://"), kwargs=dict(
        metrics_port=0, on_metrics=urls.append, batch_interval=0, max_batch_span="2s"))
    run.start()
    try:
        deadline = time.monotonic() + 30
        seen = 0.0
        while seen == 0 and time.monotonic() < deadline:
            if urls:
                seen = value(scrape(urls[0]), metric, pipeline=name)
            time.sleep(0.05)
    finally:
        _release.set()
        run.join(60)
    assert len(out.items) == 20
    return seen


def test_the_quota_in_use_is_live_within_a_long_batch() -> None:
    """A step that holds a batch back (a slow sink facing a backlog): the per-batch
    in-flight figures wait for the batch's end, the quota's live use does not."""
    held = _live_mid_batch("held", "cdcflow_quota_used_bytes",
                           cf.ReadPartition(heartbeat="100ms", max_inflight=4))
    assert held >= 1000  # records read, waiting in the Map, seen before the batch ends


def test_reads_waiting_for_the_quota_are_live_within_a_long_batch() -> None:
    """A quota smaller than what a held-back step keeps: the read waiting for room shows
    at once in the live gauge, long before the batch ends and counts its wait."""
    waiting = _live_mid_batch("waiting", "cdcflow_quota_waiting", cf.ReadPartition(
        heartbeat="100ms", max_inflight=4, max_inflight_bytes=2500))
    assert waiting == 1  # the one reader, blocked: the Map holds what the quota has


def _every_third_fails(record: Any) -> None:
    if record.mods[0].new_values["n"] % 3 == 0:
        msg = f"bad {record.mods[0].new_values['n']}"
        raise ValueError(msg)


def test_a_sink_that_skips_keeps_the_accounting_of_records_exact() -> None:
    """Consume took every element (its writes) and skipped some (the pipeline's skipped
    count, and its own skipped_total): the README's identity holds with what sinks
    skipped taken out, and the dead-letter sink's writes apart."""
    stream = ScriptedChangeStream("Orders", partitions=2, origin=NOW)
    for i in range(30):
        stream.write("Orders", {"id": i}, "INSERT", {"n": i}, at=NOW + (i + 1) * 100_000_000)
    dead = cf.Collect()
    pipeline = cf.Pipeline("skipping", error_policy=cf.ErrorPolicy(
        then="skip", retries=0, dead_letter="dead" >> dead))
    (pipeline
     | cf.DetectPartitions(stream="Orders", start_at=NOW, end_at=NOW + 6 * S, client=stream)
     | cf.ReadPartition(heartbeat="100ms")
     | "not one" >> cf.Filter(lambda r: r.mods[0].new_values["n"] != 1)
     | "consume" >> cf.Consume(_every_third_fails, max_inflight=4))
    urls: list[str] = []
    pipeline.run("memory", "memory://", metrics_port=0, on_metrics=urls.append,
                 batch_interval=0, max_batch_span="2s", idle_read_interval=0,
                 listener=_KeepServing("skipping", urls))
    s = _last_scrape["skipping"]

    def v(metric: str, **labels: str) -> float:
        return value(s, metric, pipeline="skipping", **labels)

    read = v("cdcflow_records_read_total")
    written = v("cdcflow_sink_writes_total", sink="consume")
    dropped = (v("cdcflow_elements_total", step="not one", direction="in")
               - v("cdcflow_elements_total", step="not one", direction="out"))
    sink_skipped = v("cdcflow_sink_skipped_total", sink="consume")
    assert (read, dropped, sink_skipped) == (30, 1, 10)
    assert v("cdcflow_skipped_total") == 10 and v("cdcflow_sink_acked_total", sink="consume") == 19
    assert read == written + dropped + v("cdcflow_skipped_total") - sink_skipped
