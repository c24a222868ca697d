"""Metrics and stuck partitions: the listener and detector on a fake clock, the HTTP server,
runs scraped over real HTTP while they read (a scripted stream whose partition hangs, and
`cdcflow run` on the emulator while a workload commits)."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import cdcflow as cf
from cdcflow.engine.listener import BatchStats
from cdcflow.errors import PipelineStopped, UserInputError
from cdcflow.launch import Listeners
from cdcflow.metadata import open_store
from cdcflow.metrics import MetricsServer, PipelineMetrics
from cdcflow.model import PartitionMetadata, PartitionState, Timestamp
from cdcflow.stuck import StuckDetector, StuckWatch, default_stuck_after
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms.base import SinkContext

S = 1_000_000_000
NOW = 1_700_000_000 * S
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class Clock:
    def __init__(self, t: int = NOW) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    labels.setdefault("pipeline", "orders")
    return samples[(name, frozenset(labels.items()))]


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse(response.read().decode())


def part(token: str, watermark: int, state: str = "RUNNING", hb: int = 1000) -> PartitionMetadata:
    return PartitionMetadata(token=token, parent_tokens=(), start=NOW - 3600 * S, end=2**62,
                             watermark=watermark, state=PartitionState(state),
                             heartbeat_millis=hb)


def batch(batch_id: int, **kw: Any) -> BatchStats:
    base: dict[str, Any] = dict(
        batch_id=batch_id, end=NOW, slices=2, records=10, bytes=1000, seconds=0.5,
        low_watermark=NOW - 2 * S, partitions={"RUNNING": 2, "FINISHED": 1},
        phases={"plan": 0.001, "execute": 0.3, "sink_commit": 0.02, "store_commit": 0.01,
                "gc": 0.0},
        counters={"elements_in/keep": 10, "elements_out/keep": 7, "sink_writes/out": 6,
                  "skipped": 1, "retries": 2, "dead_lettered": 1},
    )
    base.update(kw)
    return BatchStats(**base)


# Threads that live as long as the process, not a run: the relays of Spark's JVM's output
# last as long as that JVM, which PySpark keeps until the process exits.
_PROCESS_THREADS = frozenset({"cdcflow-jvm-output"})


def our_threads() -> list[str]:
    """The threads of cdcflow's runs that are alive (none once a run has ended)."""
    return [t.name for t in threading.enumerate()
            if t.name.startswith("cdcflow-") and t.name not in _PROCESS_THREADS]


# -- the listener, on a fake clock -----------------------------------------------------------


def test_batches_add_up_into_counters_and_histograms() -> None:
    clock = Clock()
    metrics = PipelineMetrics("orders", clock=clock)
    metrics.on_batch(batch(1, commit_times=(NOW - 3 * S, NOW - 1 * S), sinks_committed_at=NOW))
    metrics.on_batch(batch(2, replayed=True, splits=1, merges=2))
    got = parse(metrics.exposition().decode())
    assert value(got, "cdcflow_records_read_total") == 20
    assert value(got, "cdcflow_bytes_read_total") == 2000
    assert value(got, "cdcflow_elements_total", step="keep", direction="in") == 20
    assert value(got, "cdcflow_elements_total", step="keep", direction="out") == 14
    assert value(got, "cdcflow_sink_writes_total", sink="out") == 12
    assert value(got, "cdcflow_skipped_total") == 2
    assert value(got, "cdcflow_retries_total") == 4
    assert value(got, "cdcflow_dead_lettered_total") == 2
    assert value(got, "cdcflow_splits_total") == 1
    assert value(got, "cdcflow_merges_total") == 2
    assert value(got, "cdcflow_batches_total", replayed="false") == 1
    assert value(got, "cdcflow_batches_total", replayed="true") == 1
    assert value(got, "cdcflow_partitions", state="RUNNING") == 2
    assert value(got, "cdcflow_partitions", state="CREATED") == 0
    assert value(got, "cdcflow_batch_phase_seconds_count", phase="execute") == 2
    assert value(got, "cdcflow_batch_phase_seconds_sum", phase="execute") == pytest.approx(0.6)
    assert value(got, "cdcflow_batch_phase_seconds_bucket", phase="execute", le="0.25") == 0
    assert value(got, "cdcflow_batch_phase_seconds_bucket", phase="execute", le="0.5") == 2
    # commit -> sink: 3 s and 1 s
    assert value(got, "cdcflow_commit_to_sink_seconds_count") == 2
    assert value(got, "cdcflow_commit_to_sink_seconds_sum") == pytest.approx(4.0)
    assert value(got, "cdcflow_commit_to_sink_seconds_bucket", le="1.0") == 1
    assert value(got, "cdcflow_commit_to_sink_seconds_bucket", le="5.0") == 2
    assert value(got, "cdcflow_last_batch_timestamp_seconds") == NOW / S
    assert value(got, "cdcflow_stuck_partitions") == 0
    # every sample is labelled with the pipeline
    assert all(dict(labels).get("pipeline") == "orders" for _, labels in got)


def test_lags_are_measured_at_scrape_time_and_bounded() -> None:
    clock = Clock()
    metrics = PipelineMetrics("orders", clock=clock)
    assert ("cdcflow_low_watermark_lag_seconds", frozenset({("pipeline", "orders")})) not in \
        parse(metrics.exposition().decode())  # nothing known before the first commit
    parts = [part(f"t{i:02d}", NOW - i * S) for i in range(12)]
    parts.append(part("done", NOW - 999 * S, "FINISHED"))
    metrics.on_partitions(parts, NOW)
    got = parse(metrics.exposition().decode())
    assert value(got, "cdcflow_low_watermark_lag_seconds") == 11
    assert value(got, "cdcflow_low_watermark_timestamp_seconds") == (NOW - 11 * S) / S
    assert value(got, "cdcflow_partition_watermark_lag_seconds_gcount") == 12  # not FINISHED
    assert value(got, "cdcflow_partition_watermark_lag_seconds_gsum") == sum(range(12))
    assert value(got, "cdcflow_partition_watermark_lag_seconds_bucket", le="5.0") == 6
    top = {dict(labels)["token"]: v for (name, labels), v in got.items()
           if name == "cdcflow_partition_watermark_lag_top_seconds"}
    assert top == {"t11": 11, "t10": 10, "t09": 9, "t08": 8, "t07": 7}
    clock.t += 30 * S  # no commit since: the lag keeps growing
    got = parse(metrics.exposition().decode())
    assert value(got, "cdcflow_low_watermark_lag_seconds") == 41
    metrics.on_partitions([part("t00", NOW, "FINISHED")], NOW + 30 * S)
    got = parse(metrics.exposition().decode())
    assert value(got, "cdcflow_low_watermark_lag_seconds") == 0  # all finished: no lag
    assert value(got, "cdcflow_partition_watermark_lag_seconds_gcount") == 0


def test_stuck_gauge_reads_the_detector() -> None:
    clock = Clock()
    detector = StuckDetector(10, pipeline="orders")
    metrics = PipelineMetrics("orders", detector=detector, clock=clock)
    detector.observe([part("a", NOW - S), part("b", NOW - S)], NOW)
    detector.observe([part("a", NOW + 11 * S), part("b", NOW - S)], NOW + 11 * S)
    assert value(parse(metrics.exposition().decode()), "cdcflow_stuck_partitions") == 1


# -- stuck partitions, on a fake clock -------------------------------------------------------


def test_a_partition_that_stops_is_reported_once_and_cleared_when_it_moves(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="cdcflow.stuck")
    detector = StuckDetector(30, pipeline="orders")
    t = NOW
    assert detector.observe([part("a", t - S), part("b", t - S)], t) == []
    for step in range(1, 8):  # "a" advances every 5 s, "b" never does
        now = t + step * 5 * S
        found = detector.observe([part("a", now - S), part("b", t - S)], now)
        assert [s.token for s in found] == (["b"] if step == 6 else [])
    assert [s.token for s in detector.stuck()] == ["b"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per episode, not once per check
    message = warnings[0].getMessage()
    assert "partition b" in message and "has not advanced for 30.0s" in message
    assert Timestamp.from_ns(t - S).rfc3339() in message
    assert detector.check(t + 60 * S) == []  # still stuck: not reported again
    detector.observe([part("a", t + 60 * S), part("b", t + 59 * S)], t + 60 * S)
    assert detector.stuck() == []
    assert "partition b is moving again" in caplog.records[-1].getMessage()
    assert caplog.records[-1].levelno == logging.INFO


def test_no_report_while_the_clock_stands_still_or_behind_the_watermark() -> None:
    detector = StuckDetector(5)
    detector.observe([part("a", NOW - S)], NOW)
    assert detector.check(NOW) == []  # the engine's clock did not move
    # a partition that starts in the future cannot advance before the clock gets there
    detector.observe([part("a", NOW - S), part("later", NOW + 100 * S, "CREATED")], NOW)
    assert [s.token for s in detector.check(NOW + 50 * S)] == ["a"]
    assert [s.token for s in detector.check(NOW + 106 * S)] == ["later"]


def test_finished_or_deleted_partitions_end_their_episode() -> None:
    detector = StuckDetector(5)
    detector.observe([part("a", NOW), part("b", NOW)], NOW)
    assert len(detector.check(NOW + 10 * S)) == 2
    detector.observe([part("a", NOW, "FINISHED")], NOW + 11 * S)  # "b" garbage collected
    assert detector.stuck() == []


def test_default_threshold_is_ten_heartbeats_at_least_thirty_seconds() -> None:
    assert default_stuck_after(1000) == 30
    assert default_stuck_after(10_000) == 100
    assert default_stuck_after(100, batch_interval=20) == 60  # 3 batches of an idle pipeline
    detector = StuckDetector()
    detector.observe([part("fast", NOW, hb=500), part("slow", NOW, hb=6000)], NOW)
    assert [s.token for s in detector.check(NOW + 31 * S)] == ["fast"]
    assert [s.token for s in detector.check(NOW + 61 * S)] == ["slow"]
    with pytest.raises(ValueError, match="more than 0"):
        StuckDetector(0)


def test_watch_checks_on_its_own_and_names_the_batch_in_flight(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    watch = StuckWatch(StuckDetector(1), clock=clock, interval=0.01)
    watch.on_partitions([part("a", NOW)], NOW)
    watch.on_planned(cf.model.BatchPlan(7, NOW, ()), False)
    with watch:
        assert "cdcflow-stuck-watch" in our_threads()
        clock.t += 2 * S
        deadline = time.monotonic() + 5
        while not watch.detector.stuck() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert "cdcflow-stuck-watch" not in our_threads()
    assert [s.token for s in watch.detector.stuck()] == ["a"]
    assert "batch 7 has been running for" in caplog.records[-1].getMessage()


# -- the server ------------------------------------------------------------------------------


def test_server_serves_then_stops_and_a_second_one_serves_on_the_same_port() -> None:
    metrics = PipelineMetrics("orders", clock=Clock())
    metrics.on_batch(batch(1))
    with MetricsServer(metrics.registry) as server:
        assert server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        assert value(scrape(server.url), "cdcflow_records_read_total") == 10
        port = server.port
    assert our_threads() == []
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    with MetricsServer(metrics.registry, port) as again:
        assert value(scrape(again.url), "cdcflow_records_read_total") == 10
    assert our_threads() == []


def test_a_port_in_use_names_the_fix() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserInputError, match=f"metrics port {port} is in use.*0 for a free"):
            MetricsServer(PipelineMetrics("x").registry, port).start()


def test_a_port_in_use_by_a_second_start_of_the_run_names_the_run(tmp_path: Path) -> None:
    """The same command started twice (a duplicated unit) has the same metrics port: the
    second start said the port is in use, and only once given another port that the
    pipeline is being run. It now names the run that holds the pipeline; a port taken by
    anything else is still the port's error."""
    from cdcflow.errors import LeaseHeldError

    url = f"sqlite:///{tmp_path / 'state.db'}"
    store = open_store(url)
    now = Timestamp.now().ns
    store.acquire_lease("twice", "otherhost:4242", "run-1", 30 * 10**9)
    store.close()
    pipeline, _ = _scripted("twice", now, now + 10**9)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(LeaseHeldError, match=r"'twice' is being run by otherhost:4242 "
                                                 r"\(run run-1.*--takeover"):
            pipeline.run("memory", url, metrics_port=port)
        free, _ = _scripted("free", now, now + 10**9)
        with pytest.raises(UserInputError, match=f"metrics port {port} is in use"):
            free.run("memory", url, metrics_port=port)


def _scripted(name: str, origin: int, end: int, **kw: Any) -> tuple[cf.Pipeline, cf.Collect]:
    stream = ScriptedChangeStream("Orders", partitions=2, origin=origin)
    for i in range(40):
        stream.write("Orders", {"id": i}, "DELETE" if i % 4 == 0 else "INSERT", {"n": i},
                     at=origin + (i + 1) * 100_000_000)
    out = cf.Collect()
    pipeline = cf.Pipeline(name, **kw)
    (pipeline
     | cf.DetectPartitions(stream="Orders", start_at=origin, end_at=end, client=stream)
     | cf.ReadPartition(heartbeat="100ms")
     | "keep" >> cf.Filter(lambda r: r.mod_type != "DELETE")
     | "boom" >> cf.Map(_explode_on_7)
     | out)
    return pipeline, out


def _explode_on_7(record: Any) -> Any:
    if record.mods[0].keys["id"] == 7:
        msg = "no 7s"
        raise ValueError(msg)
    return record


def test_a_failed_run_leaves_no_server_or_thread_behind() -> None:
    pipeline, _ = _scripted("fails", NOW, NOW + 10 * S,
                            error_policy=cf.ErrorPolicy(retries=0, then="stop"))
    urls: list[str] = []
    with pytest.raises(PipelineStopped):
        pipeline.run("memory", "memory://", metrics_port=0, on_metrics=urls.append,
                     batch_interval=0)
    assert our_threads() == []
    with pytest.raises(OSError):
        urllib.request.urlopen(urls[0], timeout=2)


def test_observer_options_are_checked_before_anything_runs() -> None:
    pipeline, _ = _scripted("bad", NOW, NOW + 10 * S)
    with pytest.raises(UserInputError, match="metrics_port=70000"):
        pipeline.run("memory", "memory://", metrics_port=70000)
    with pytest.raises(UserInputError, match=r"stuck_after=.soon.: not a duration"):
        pipeline.run("memory", "memory://", stuck_after="soon")
    with pytest.raises(UserInputError, match=r"valid: .*metrics_port.*stuck_after"):
        pipeline.run("memory", "memory://", metrics_prot=1)


# -- live runs, scraped over HTTP --------------------------------------------------------------


class _Scraper(threading.Thread):
    def __init__(self, urls: list[str], every: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.urls, self.every = urls, every
        self.scrapes: list[tuple[float, Samples]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            if self.urls:
                with contextlib.suppress(OSError):  # the run just ended
                    self.scrapes.append((time.monotonic(), scrape(self.urls[0])))
            self.done.wait(self.every)


def test_a_hanging_partition_is_flagged_while_it_hangs_and_cleared_after(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="cdcflow.stuck")
    began = time.monotonic()
    now = time.time_ns()
    origin = now - 20 * S
    stream = ScriptedChangeStream("Orders", partitions=2, origin=origin)
    for i in range(50):
        stream.write("Orders", {"id": i}, "INSERT", {"n": i}, at=origin + (i + 1) * 300_000_000)
    client = stream.stall("p1", 4.0, after=origin + 5 * S)
    out = cf.Collect()
    pipeline = cf.Pipeline("hangs")
    (pipeline
     | cf.DetectPartitions(stream="Orders", start_at=origin, end_at=now + 7 * S, client=client)
     | cf.ReadPartition(heartbeat="100ms")
     | out)
    urls: list[str] = []
    scraper = _Scraper(urls)
    scraper.start()
    try:
        summary = pipeline.run("memory", "memory://", metrics_port=0, on_metrics=urls.append,
                               stuck_after="1s", batch_interval="100ms", max_batch_span="1s",
                               idle_read_interval=0)
    finally:
        scraper.done.set()
        scraper.join()
    assert summary.reason == "end reached"
    assert len(out.items) == 50
    stuck = [(t - began, value(s, "cdcflow_stuck_partitions", pipeline="hangs"))
             for t, s in scraper.scrapes]
    flagged = [t for t, n in stuck if n >= 1]
    assert flagged, stuck
    # flagged during the hang (4 s from the start), and cleared once p1 answered again
    assert 1.0 <= flagged[0] <= 4.5, stuck
    assert any(n == 0 for t, n in stuck if t > flagged[-1]), stuck
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    p1 = [m for m in warnings if "partition p1 " in m]
    assert len(p1) == 1, warnings
    assert "has not advanced for" in p1[0] and "its watermark is still" in p1[0]
    assert re.search(r"batch \d+ has been running for", p1[0])
    assert any("partition p1 is moving again" in r.getMessage() for r in caplog.records)
    assert our_threads() == []


PIPELINE = """
import os
import cdcflow as cf
from cdcflow.transforms import DetectPartitions, Filter, Map, ReadPartition, WriteFiles


def check(record):
    # Some orders fail deterministically; the error policy skips them.
    if int(record.mods[0].keys["OrderId"]) % 7 == 0:
        raise ValueError("order ids divisible by 7 are refused")
    return record


pipeline = cf.Pipeline(os.environ["M_NAME"], error_policy=cf.ErrorPolicy(retries=0, then="skip"))
(pipeline
 | DetectPartitions(database=os.environ["M_DB"], stream="OrdersStream",
                    start_at=os.environ["M_START"], end_at=os.environ["M_END"])
 | ReadPartition(heartbeat="250ms")
 | "no deletes" >> Filter(lambda r: r.mod_type != "DELETE")
 | "check" >> Map(check)
 | "files" >> WriteFiles(os.environ["M_OUT"], format="jsonl"))
"""


@pytest.mark.emulator
def test_live_run_on_the_emulator_scraped_over_http(spanner_emulator: Any, tmp_path: Path) -> None:
    from cdcflow.spanner.workload import Workload, create_shop_database

    name = f"metrics{os.getpid() % 1000}"
    database = create_shop_database(spanner_emulator, name)
    file = tmp_path / "pipeline.py"
    file.write_text(PIPELINE)
    store_url = f"sqlite:///{tmp_path / 'state.db'}"
    workload = Workload(database, rate=15, seed=random.randrange(1 << 30))
    start = Timestamp.now()
    env = dict(os.environ, SPANNER_EMULATOR_HOST=spanner_emulator.host, M_NAME=name,
               M_DB=spanner_emulator.database_path(name), M_START=start.rfc3339(),
               M_END=Timestamp.from_ns(start.ns + 16 * S).rfc3339(),
               M_OUT=str(tmp_path / "out"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "cdcflow", "run", str(file), "--metadata", store_url,
         "--batch-interval", "250ms", "--metrics-port", "0", "--stuck-after", "5s"],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )
    urls: list[str] = []
    lines: list[str] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            found = re.search(r"metrics at (http://\S+)", line)
            if found:
                urls.append(found.group(1))

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    scraper = _Scraper(urls, every=0.5)
    scraper.start()
    began = time.monotonic()
    try:
        workload.run(seconds=7)
        assert proc.wait(timeout=240) == 0, "".join(lines)
    finally:
        scraper.done.set()
        scraper.join()
        if proc.poll() is None:
            proc.kill()
        reader.join(10)
    text = "".join(lines)
    assert urls and urls[0].startswith("http://127.0.0.1:"), text
    scrapes = scraper.scrapes
    assert len(scrapes) >= 10, text

    def v(samples: Samples, metric: str, **labels: str) -> float:
        return value(samples, metric, pipeline=name, **labels)

    # While the workload commits, records go up and the lag stays bounded.
    during = [s for t, s in scrapes if t - began < 7 and
              ("cdcflow_low_watermark_lag_seconds", frozenset({("pipeline", name)})) in s]
    reads = [v(s, "cdcflow_records_read_total") for s in during]
    assert reads == sorted(reads) and len(set(reads)) >= 3, reads
    assert max(v(s, "cdcflow_low_watermark_lag_seconds") for s in during) < 10
    assert all(v(s, "cdcflow_stuck_partitions") == 0 for _, s in scrapes)
    assert "has not advanced" not in text
    # The last scrape came after everything was read: every record is accounted for.
    last = scrapes[-1][1]
    read = v(last, "cdcflow_records_read_total")
    written = v(last, "cdcflow_sink_writes_total", sink="files")
    filtered = (v(last, "cdcflow_elements_total", step="no deletes", direction="in")
                - v(last, "cdcflow_elements_total", step="no deletes", direction="out"))
    skipped = v(last, "cdcflow_skipped_total")
    lines_out = sum(len(f.read_text().splitlines()) for f in (tmp_path / "out").glob("*.jsonl"))
    assert read > 30 and filtered > 0 and skipped > 0
    assert written == lines_out
    assert read == written + filtered + skipped
    # step by step: what enters a step left the one before it; "check" loses only skips
    assert v(last, "cdcflow_elements_total", step="no deletes", direction="in") == read
    assert v(last, "cdcflow_elements_total", step="check", direction="in") == read - filtered
    assert v(last, "cdcflow_elements_total", step="check", direction="out") == written
    # the reader's queries were measured on the executors' side and reached the scrape
    queries = v(last, "cdcflow_spanner_query_seconds_count")
    assert queries >= v(last, "cdcflow_batches_total", replayed="false")
    assert v(last, "cdcflow_spanner_first_response_seconds_count") > 0
    assert 0 < v(last, "cdcflow_spanner_query_seconds_sum") < queries * 60
    store = open_store(store_url)
    try:
        assert read == sum(b.records for b in store.batches(name, limit=100_000))
    finally:
        store.close()
    # and the run's summary line counts the skipped elements too
    assert f"{int(skipped):,} skipped, 0 retried, 0 dead-lettered" in text


# -- examples/monitoring ---------------------------------------------------------------------

_MONITORING = Path(__file__).resolve().parents[1] / "examples" / "monitoring"


def _exported_names() -> set[str]:
    detector = StuckDetector(10)
    detector.observe([part("a", NOW - S)], NOW)
    detector.check(NOW + 20 * S)  # "a" is stuck: its per-token gauge is exported too
    metrics = PipelineMetrics("orders", detector=detector, clock=Clock())
    metrics.on_partitions([part("a", NOW - S)], NOW)
    counters = {**batch(1).counters, "spanner_errors/UNAVAILABLE": 1}
    # what a WriteTables sink reports (its real metric names)
    tables = cf.WriteTables(f"memory://exported-{os.getpid()}")
    tables.setup(SinkContext("orders", "lake", "/"))
    try:
        numbers = tables.metrics()
    finally:
        tables.close()
    metrics.on_batch(batch(1, commit_times=(NOW - S,), sinks_committed_at=NOW,
                           counters=counters, sink_metrics={"lake": numbers}))
    return {name for name, _ in parse(metrics.exposition().decode())}


def test_the_dashboard_and_alerts_use_only_exported_metrics() -> None:
    import json

    exported = _exported_names()
    dashboard = json.loads((_MONITORING / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Low-watermark lag", "Records and bytes read", "Batch phases (p90)",
            "Retried, skipped, dead-lettered elements", "Partitions by state",
            "Stuck partitions", "Change stream query latency (p90)", "Spanner errors by code",
            "In-flight bytes and quota waits", "Sink files cut and uploaded",
            "Sink spool"} <= titles
    alerts = (_MONITORING / "cdcflow-alerts.yml").read_text()
    used = set(re.findall(r"cdcflow_[a-z_]+", " ".join(exprs) + alerts))
    assert used and used <= exported, used - exported
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert "rule_files" in (_MONITORING / "prometheus.yml").read_text()


def test_a_first_batch_that_hangs_is_reported_from_its_plan() -> None:
    clock = Clock()
    watch = StuckWatch(StuckDetector(5), clock=clock)
    watch.on_planned(cf.model.BatchPlan(1, NOW, (cf.model.Slice("p0", NOW - S, NOW),)), False)
    clock.t += 6 * S
    assert [(s.token, s.watermark) for s in watch.check()] == [("p0", NOW - S)]
    watch.on_partitions([part("p0", NOW)], clock.t)  # the batch committed after all
    assert watch.detector.stuck() == []


@pytest.mark.spark
def test_spark_and_the_memory_runner_report_the_same_counters() -> None:
    def counters(runner: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        pipeline, _ = _scripted(f"same-{runner}", NOW, NOW + 10 * S,
                                  error_policy=cf.ErrorPolicy(retries=1, backoff=0, then="skip"))
        metrics = PipelineMetrics(pipeline.name, clock=Clock())
        pipeline.run(runner, "memory://", listener=metrics, batch_interval=0,
                     max_batch_span="2s", **({"master": "local[2]"} if runner == "spark" else {}))
        wanted = ("cdcflow_records_read_total", "cdcflow_elements_total",
                  "cdcflow_sink_writes_total", "cdcflow_skipped_total", "cdcflow_retries_total",
                  "cdcflow_batches_total")
        return {(name, frozenset((k, v) for k, v in labels if k != "pipeline")): value
                for (name, labels), value in parse(metrics.exposition().decode()).items()
                if name in wanted}

    memory, spark = counters("memory"), counters("spark")
    assert memory == spark
    assert memory[("cdcflow_records_read_total", frozenset())] == 40
    assert memory[("cdcflow_skipped_total", frozenset())] == 1  # id 7
    assert memory[("cdcflow_retries_total", frozenset())] == 1


def test_batches_run_again_are_counted_by_the_errors_class() -> None:
    """An outage fails a batch's reads until their retries are spent: the batch runs again,
    and the metrics say so (the failed attempts' own counters never reach the driver)."""
    stream = ScriptedChangeStream("Orders", partitions=1, origin=NOW)
    for i in range(5):
        stream.write("Orders", {"id": i}, "INSERT", {"n": i}, at=NOW + (i + 1) * 100_000_000)
    stream.fail_reads(2, token="p0")  # a TransientError, as the reader's spent retries raise
    pipeline = cf.Pipeline("outage")
    (pipeline
     | cf.DetectPartitions(stream="Orders", start_at=NOW, end_at=NOW + 2 * S, client=stream)
     | cf.ReadPartition() | cf.Collect())
    metrics = PipelineMetrics(pipeline.name, clock=Clock())
    pipeline.run("memory", "memory://", listener=metrics, batch_interval=0, retry_backoff=0)
    got = parse(metrics.exposition().decode())
    assert value(got, "cdcflow_batch_retries_total", error="TransientError",
                 pipeline="outage") == 2
    assert value(got, "cdcflow_batch_retries_total", error="any", pipeline="outage") == 2
    assert value(got, "cdcflow_records_read_total", pipeline="outage") == 5


def test_a_restarted_run_shows_its_stored_partitions_and_lag_before_its_first_batch(
    tmp_path: Path,
) -> None:
    """A restart far behind (after an outage) may take long for its first batch: the
    partitions and the lag are what the store holds from the start, not zeros and no lag
    (an alert on "no running partition" fired on every restart, a lag alert saw nothing)."""
    t0 = time.time_ns() - 600 * S
    stream = ScriptedChangeStream("S", partitions=2, origin=t0)
    for i in range(10):
        stream.write("T", {"id": i}, "INSERT", {"v": i}, at=t0 + (i + 1) * S)
    url = f"sqlite:///{tmp_path / 'state.db'}"

    def pipeline() -> cf.Pipeline:
        p = cf.Pipeline("restarted")
        (p | cf.DetectPartitions(stream="S", start_at=t0, client=stream)
         | cf.ReadPartition() | cf.Collect())
        return p

    pipeline().run("memory", url, batch_interval=0, max_batch_span="1s", max_batches=3)
    metrics = PipelineMetrics("restarted")
    seen: list[Samples] = []

    class AtFirstPlan(cf.EngineListener):
        def on_planned(self, plan: Any, replay: bool) -> None:
            if not seen:
                seen.append(parse(metrics.exposition().decode()))

    pipeline().run("memory", url, listener=Listeners(metrics, [AtFirstPlan()]),
                   batch_interval=0, max_batch_span="1s", max_batches=1)
    first = seen[0]
    assert value(first, "cdcflow_partitions", pipeline="restarted", state="RUNNING") == 2
    lag = value(first, "cdcflow_low_watermark_lag_seconds", pipeline="restarted")
    assert 590 < lag < 700, lag
