"""Prometheus metrics of a run: :class:`PipelineMetrics` (a listener) and
:class:`MetricsServer` (serves them over HTTP while the run lasts).

Every metric carries a ``pipeline`` label. A scrape sees whole batches: the listener
updates its totals under one lock in ``on_batch`` and the registry's collector reads them
under the same lock, so every counter of a scrape stops at the same batch (records read
equal elements written + filtered + skipped, less what sinks skipped after taking it, in a
linear pipeline, at every scrape). Lags
are computed at scrape time from the last committed watermarks and the clock, so they
keep growing while a run is stuck.

Metrics (type; labels besides ``pipeline``):

- ``cdcflow_low_watermark_lag_seconds`` (gauge), ``cdcflow_low_watermark_timestamp_seconds``
  (gauge);
- ``cdcflow_partition_watermark_lag_seconds`` (a gauge histogram: one observation per
  partition that is not FINISHED, so its labels stay bounded) and
  ``cdcflow_partition_watermark_lag_top_seconds{token}`` (gauge, the 5 largest lags only);
- ``cdcflow_batch_phase_seconds{phase}`` (histogram: plan, execute, sink_commit,
  store_commit, gc);
- counters ``cdcflow_records_read_total``, ``cdcflow_bytes_read_total``,
  ``cdcflow_elements_total{step,direction}`` (direction in/out),
  ``cdcflow_sink_writes_total{sink}``, ``cdcflow_retries_total``, ``cdcflow_skipped_total``,
  ``cdcflow_dead_lettered_total``, ``cdcflow_splits_total``, ``cdcflow_merges_total``,
  ``cdcflow_batches_total{replayed}`` (true/false);
- ``cdcflow_partitions{state}`` (gauge), ``cdcflow_stuck_partitions`` (gauge),
  ``cdcflow_stuck_partition_seconds{token}`` (gauge: how long each stuck partition has not
  advanced, the 5 longest only), ``cdcflow_last_batch_timestamp_seconds`` (gauge);
- ``cdcflow_commit_to_sink_seconds`` (histogram over a sample of each batch's records:
  Spanner commit -> the batch's sink commit);
- ``cdcflow_spanner_query_seconds`` and ``cdcflow_spanner_first_response_seconds``
  (histograms: each change stream query's duration, and its time to the first row),
  ``cdcflow_spanner_errors_total{code}`` (counter: errors of those queries by gRPC status,
  retried ones included; an error that fails its task returns no counters and shows as
  the batch's retry instead), ``cdcflow_batch_retries_total{error}`` (counter: batches
  run again after a transient failure, by the error's class, and ``error="any"``);
- ``cdcflow_inflight_bytes`` (gauge: the most bytes one task of the last batch held of
  its process's byte quota: records read and not yet taken by every sink; what a sink
  keeps, such as Consume's queue, is charged to the quota but not counted here),
  ``cdcflow_quota_used_bytes`` (gauge, live: what this process's quota holds at the
  scrape, within a long batch too, Consume's queue included; the in-memory runner's tasks
  run in this process, Spark executors' do not), ``cdcflow_quota_waiting`` (gauge, live
  the same way: reads waiting for room in that quota now),
  ``cdcflow_inflight_bytes_limit`` (gauge: that quota, ``max_inflight_bytes``),
  ``cdcflow_quota_waits_total`` and ``cdcflow_quota_wait_seconds_total`` (counters: reads
  that waited for room in the quota, and how long, counted when their batch ends);
- ``cdcflow_batch_span_seconds`` (gauge: the span of commit time the next batch plans,
  ``max_batch_span`` paced by ``max_task_bytes``);
- ``cdcflow_sink_<name>{sink}``: what each sink reports after a batch (``Sink.metrics()``;
  a counter for a name ending in ``_total``, else a gauge), e.g. WriteTables' files cut by
  reason, uploads, spool bytes and durable batch.

Spanner and in-flight numbers come from the tasks' counters (see
:class:`~cdcflow.spanner.retry.QueryStats` and :meth:`cdcflow.engine.chain.Chain.counters`),
so both runners report them alike.
"""

from __future__ import annotations

import errno
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from socketserver import ThreadingMixIn
from types import TracebackType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from cdcflow.engine.lifecycle import all_finished, count_states, low_watermark
from cdcflow.engine.listener import BatchStats, EngineListener
from cdcflow.engine.quota import current_quota
from cdcflow.errors import UserInputError
from cdcflow.model import PartitionMetadata, PartitionState
from cdcflow.spanner.retry import QUERY_BUCKETS, query_bucket_labels
from cdcflow.stuck import StuckDetector

__all__ = [
    "COMMIT_BUCKETS", "LAG_BUCKETS", "PHASE_BUCKETS", "QUERY_BUCKETS", "MetricsServer",
    "PipelineMetrics",
]

_NS = 1_000_000_000
_TOP = 5
_PHASES = ("plan", "execute", "sink_commit", "store_commit", "gc")

#: Bucket bounds (seconds) of the histograms.
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
COMMIT_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LAG_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 86400.0)

# Task counter key -> the query histogram it feeds; "<key>/<le>" are its bucket counts.
_QUERY_HISTOGRAMS = {
    "spanner_query_seconds": "spanner_query_us",
    "spanner_first_response_seconds": "spanner_first_response_us",
}
_QUERY_LE = {le: i for i, le in enumerate(query_bucket_labels())}


class _Histogram:
    """Cumulative bucket counts and a sum, as Prometheus histograms keep them."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.total += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def add(self, index: int, count: int) -> None:
        """Add ``count`` observations to bucket ``index`` (their sum is added apart)."""
        self.counts[index] += count

    def buckets(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out


class PipelineMetrics(EngineListener):
    """Keeps a run's metrics in a private :class:`CollectorRegistry` (``registry``).

    ``pipeline`` is the value of every metric's ``pipeline`` label. ``detector`` (a
    :class:`~cdcflow.stuck.StuckDetector` fed by someone else, e.g.
    :class:`~cdcflow.stuck.StuckWatch`) gives ``cdcflow_stuck_partitions``. ``clock`` (ns
    since the epoch, the engine's clock) dates lags at scrape time.
    """

    def __init__(
        self,
        pipeline: str,
        *,
        detector: StuckDetector | None = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.pipeline = pipeline
        self.detector = detector
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._elements: Counter[tuple[str, str]] = Counter()
        self._sink_writes: Counter[str] = Counter()
        self._sink_numbers: dict[str, dict[str, float]] = {}  # label -> Sink.metrics()
        self._batches: Counter[str] = Counter()
        self._states: dict[str, int] = {}
        self._phases = {phase: _Histogram(PHASE_BUCKETS) for phase in _PHASES}
        self._commit_to_sink = _Histogram(COMMIT_BUCKETS)
        self._queries = {key: _Histogram(QUERY_BUCKETS) for key in _QUERY_HISTOGRAMS}
        self._spanner_errors: Counter[str] = Counter()
        self._batch_retries: Counter[str] = Counter()  # by error class
        self._inflight_bytes = 0
        self._inflight_limit = 0
        self._span_ns = 0
        self._last_batch_ns: int | None = None
        # From the last on_partitions: watermarks of the partitions that are not FINISHED.
        self._watermarks: tuple[tuple[str, int], ...] = ()
        self._low: int | None = None
        self._done = False
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    # -- the engine's side ------------------------------------------------------------------

    def on_batch(self, stats: BatchStats) -> None:
        with self._lock:
            counts = self._counts
            counts["records"] += stats.records
            counts["bytes"] += stats.bytes
            counts["splits"] += stats.splits
            counts["merges"] += stats.merges
            task = stats.counters
            for key in ("retries", "skipped", "dead_lettered", "quota_waits", "quota_wait_us"):
                counts[key] += task.get(key, 0)
            self._inflight_bytes = task.get("inflight_bytes_peak", 0)
            self._span_ns = stats.next_span_ns
            self._inflight_limit = task.get("inflight_bytes_limit", self._inflight_limit)
            for kind, us_key in _QUERY_HISTOGRAMS.items():
                self._queries[kind].total += task.get(us_key, 0) / 1e6
            for key, value in task.items():
                kind, sep, label = key.partition("/")
                if not sep:
                    continue
                if kind == "elements_in":
                    self._elements[(label, "in")] += value
                elif kind == "elements_out":
                    self._elements[(label, "out")] += value
                elif kind == "sink_writes":
                    self._sink_writes[label] += value
                elif kind == "spanner_errors":
                    self._spanner_errors[label] += value
                elif kind in self._queries and label in _QUERY_LE:
                    self._queries[kind].add(_QUERY_LE[label], value)
            for label, numbers in stats.sink_metrics.items():
                self._sink_numbers[label] = dict(numbers)
            self._batches["true" if stats.replayed else "false"] += 1
            self._states = dict(stats.partitions)
            for phase, seconds in stats.phases.items():
                hist = self._phases.get(phase)
                if hist is None:  # a phase this version does not know: keep it anyway
                    hist = self._phases[phase] = _Histogram(PHASE_BUCKETS)
                hist.observe(seconds)
            if stats.sinks_committed_at:
                for committed in stats.commit_times:
                    self._commit_to_sink.observe(
                        max(0, stats.sinks_committed_at - committed) / _NS
                    )
            self._last_batch_ns = self._clock()

    def on_batch_retry(self, batch_id: int, error: BaseException) -> None:
        with self._lock:
            self._batch_retries[type(error).__name__] += 1

    def on_partitions(self, partitions: Sequence[PartitionMetadata], now_ns: int) -> None:
        active = tuple(
            (p.token, p.watermark) for p in partitions if p.state != PartitionState.FINISHED
        )
        low = low_watermark(partitions)
        done = all_finished(partitions)
        states = count_states(partitions)
        with self._lock:
            self._watermarks, self._low, self._done = active, low, done
            self._states = states

    # -- reading ----------------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format (what a scrape returns)."""
        return generate_latest(self.registry)

    def _families(self) -> Iterator[Any]:
        name = self.pipeline
        now = self._clock()
        with self._lock:
            counts = Counter(self._counts)
            elements = dict(self._elements)
            sink_writes = dict(self._sink_writes)
            sink_numbers = {label: dict(n) for label, n in self._sink_numbers.items()}
            batches = dict(self._batches)
            states = dict(self._states)
            phases = {p: (h.buckets(), h.total) for p, h in self._phases.items()}
            commit = (self._commit_to_sink.buckets(), self._commit_to_sink.total)
            queries = {k: (h.buckets(), h.total) for k, h in self._queries.items()}
            spanner_errors = dict(self._spanner_errors)
            batch_retries = dict(self._batch_retries)
            inflight_bytes = self._inflight_bytes
            inflight_limit = self._inflight_limit
            span_ns = self._span_ns
            last_batch, watermarks = self._last_batch_ns, self._watermarks
            low, done = self._low, self._done
        p = ["pipeline"]

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=p)
            family.add_metric([name], value)
            return family

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=p)
            family.add_metric([name], value)
            return family

        if low is not None:
            lag = 0.0 if done else max(0, now - low) / _NS
            yield gauge("cdcflow_low_watermark_lag_seconds",
                        "Seconds between the clock and the pipeline's low watermark "
                        "(0 once every partition finished).", lag)
            yield gauge("cdcflow_low_watermark_timestamp_seconds",
                        "The pipeline's low watermark, in seconds since the epoch.", low / _NS)
            lags = sorted(((max(0, now - wm) / _NS, token) for token, wm in watermarks),
                          reverse=True)
            hist = _Histogram(LAG_BUCKETS)
            for value, _ in lags:
                hist.observe(value)
            family = GaugeHistogramMetricFamily(
                "cdcflow_partition_watermark_lag_seconds",
                "Watermark lag of the partitions that are not finished, now (a gauge "
                "histogram: one observation per partition).", labels=p)
            family.add_metric([name], hist.buckets(), hist.total)
            yield family
            top = GaugeMetricFamily(
                "cdcflow_partition_watermark_lag_top_seconds",
                f"Watermark lag of the {_TOP} partitions that lag most, by token.",
                labels=[*p, "token"])
            for value, token in lags[:_TOP]:
                top.add_metric([name, token], value)
            yield top
        phase_family = HistogramMetricFamily(
            "cdcflow_batch_phase_seconds",
            "Seconds each batch spent per phase (plan, execute, sink_commit, store_commit, gc).",
            labels=[*p, "phase"])
        for phase, (buckets, total) in phases.items():
            phase_family.add_metric([name, phase], buckets, total)
        yield phase_family
        yield counter("cdcflow_records_read", "Data change records read.", counts["records"])
        yield counter("cdcflow_bytes_read", "Bytes of data change records read (approximate).",
                      counts["bytes"])
        elements_family = CounterMetricFamily(
            "cdcflow_elements", "Elements into and out of each step.",
            labels=[*p, "step", "direction"])
        for (step, direction), value in sorted(elements.items()):
            elements_family.add_metric([name, step, direction], value)
        yield elements_family
        sinks_family = CounterMetricFamily(
            "cdcflow_sink_writes", "Elements handed to each sink.", labels=[*p, "sink"])
        for sink, value in sorted(sink_writes.items()):
            sinks_family.add_metric([name, sink], value)
        yield sinks_family
        yield from _sink_families(name, sink_numbers)
        yield counter("cdcflow_retries", "Element retries under the error policy.",
                      counts["retries"])
        yield counter("cdcflow_skipped", "Elements the error policy skipped (dead-lettered "
                      "ones included).", counts["skipped"])
        yield counter("cdcflow_dead_lettered", "Skipped elements written to the dead-letter "
                      "sink.", counts["dead_lettered"])
        states_family = GaugeMetricFamily("cdcflow_partitions", "Stored partitions by state.",
                                          labels=[*p, "state"])
        for state in PartitionState:
            states_family.add_metric([name, state.value], states.get(state.value, 0))
        yield states_family
        yield counter("cdcflow_splits", "Partitions that split.", counts["splits"])
        yield counter("cdcflow_merges", "Partitions born of a merge.", counts["merges"])
        commit_family = HistogramMetricFamily(
            "cdcflow_commit_to_sink_seconds",
            "Seconds from a record's commit in Spanner to its batch's sink commit (a sample "
            "of each batch's records).", labels=p)
        commit_family.add_metric([name], commit[0], commit[1])
        yield commit_family
        batches_family = CounterMetricFamily("cdcflow_batches", "Committed batches.",
                                             labels=[*p, "replayed"])
        for replayed in ("false", "true"):
            batches_family.add_metric([name, replayed], batches.get(replayed, 0))
        yield batches_family
        if last_batch is not None:
            yield gauge("cdcflow_last_batch_timestamp_seconds",
                        "When the last batch committed, in seconds since the epoch.",
                        last_batch / _NS)
        for kind, doc in (
            ("spanner_query_seconds", "Seconds each change stream query took, from issue "
             "to its end (time the pipeline held its records excluded)."),
            ("spanner_first_response_seconds", "Seconds from issuing each change stream "
             "query to its first row."),
        ):
            query_family = HistogramMetricFamily(f"cdcflow_{kind}", doc, labels=p)
            query_family.add_metric([name], queries[kind][0], queries[kind][1])
            yield query_family
        errors_family = CounterMetricFamily(
            "cdcflow_spanner_errors", "Errors of change stream queries by gRPC status code, "
            "retried ones included.", labels=[*p, "code"])
        for code, value in sorted(spanner_errors.items()):
            errors_family.add_metric([name, code], value)
        yield errors_family
        retries_family = CounterMetricFamily(
            "cdcflow_batch_retries", "Batches run again after a transient failure (a "
            "reader's retries spent, a sink's storage fault), by the error's class.",
            labels=[*p, "error"])
        retries_family.add_metric([name, "any"], sum(batch_retries.values()))
        for error, value in sorted(batch_retries.items()):
            retries_family.add_metric([name, error], value)
        yield retries_family
        yield gauge("cdcflow_inflight_bytes", "The most bytes one task of the last batch "
                    "held of its process's byte quota.", inflight_bytes)
        quota = current_quota()
        yield gauge("cdcflow_quota_used_bytes", "Bytes of this process's byte quota held now "
                    "(read and not taken by every sink, and what sinks keep charged): live, "
                    "within a batch too; the tasks of this process only (the in-memory "
                    "runner's; not Spark executors').", 0 if quota is None else quota.used)
        yield gauge("cdcflow_quota_waiting", "Reads of this process's tasks waiting for room "
                    "in its byte quota now: live, within a batch too (the in-memory runner's "
                    "tasks; not Spark executors').", 0 if quota is None else quota.waiting)
        yield gauge("cdcflow_inflight_bytes_limit", "The byte quota of the processes that "
                    "run the tasks (max_inflight_bytes; 0 before the first batch).",
                    inflight_limit)
        yield counter("cdcflow_quota_waits", "Reads that waited for in-flight room "
                      "(max_inflight, max_inflight_bytes), counted when their batch ends.",
                      counts["quota_waits"])
        yield counter("cdcflow_quota_wait_seconds", "Seconds reads waited for in-flight room.",
                      counts["quota_wait_us"] / 1e6)
        yield gauge("cdcflow_batch_span_seconds", "The span of commit time the next batch "
                    "plans (max_batch_span, paced by max_task_bytes; 0 before the first "
                    "batch).", span_ns / 1e9)
        stuck = self.detector.stuck() if self.detector is not None else []
        yield gauge("cdcflow_stuck_partitions",
                    "Partitions whose watermark has not advanced for stuck_after.", len(stuck))
        stuck_family = GaugeMetricFamily(
            "cdcflow_stuck_partition_seconds",
            f"Seconds each stuck partition has not advanced, by token (the {_TOP} longest).",
            labels=[*p, "token"])
        for partition in stuck[:_TOP]:
            stuck_family.add_metric([name, partition.token], partition.seconds(now))
        yield stuck_family


#: What a sink's metric name may be (Sink.metrics()), and the names the engine's own
#: families take already.
_SINK_NAME = re.compile(r"[a-z][a-z0-9_]*")
_SINK_TAKEN = frozenset({"writes", "writes_total"})


def _sink_families(pipeline: str, numbers: Mapping[str, Mapping[str, float]]) -> Iterator[Any]:
    """``cdcflow_sink_<name>{pipeline, sink}`` for what sinks report (``Sink.metrics()``):
    a counter for a name ending in ``_total``, else a gauge; a name that is no metric
    name, or one the engine's families take, is left out."""
    by_name: dict[str, list[tuple[str, float]]] = {}
    for label, values in sorted(numbers.items()):
        for key, value in values.items():
            if _SINK_NAME.fullmatch(key) and key not in _SINK_TAKEN:
                by_name.setdefault(key, []).append((label, float(value)))
    for key, samples in sorted(by_name.items()):
        doc = f"{key.removesuffix('_total').replace('_', ' ')}, as each sink reports it."
        family: CounterMetricFamily | GaugeMetricFamily
        if key.endswith("_total"):
            family = CounterMetricFamily(f"cdcflow_sink_{key[:-6]}", doc,
                                         labels=["pipeline", "sink"])
        else:
            family = GaugeMetricFamily(f"cdcflow_sink_{key}", doc, labels=["pipeline", "sink"])
        for label, value in samples:
            family.add_metric([pipeline, label], value)
        yield family


class _Collector(Collector):
    def __init__(self, metrics: PipelineMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        return self._metrics._families()


# -- serving -------------------------------------------------------------------------------


class _Handler(WSGIRequestHandler):
    # A client that connects and sends nothing must not keep the server from closing.
    timeout = 5.0

    def log_message(self, format: str, *args: Any) -> None:
        return None  # scrapes are not worth a log line each


class _Server(ThreadingMixIn, WSGIServer):
    # Request threads are joined by server_close(): nothing outlives the run.
    daemon_threads = False
    block_on_close = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """Serves ``registry`` over HTTP at ``http://HOST:PORT/metrics`` from :meth:`start` to
    :meth:`stop` (a context manager does both).

    ``port`` 0 picks a free port (``port`` and ``url`` tell which, once started). ``host``
    is the address to listen on: ``127.0.0.1`` (default) for this machine only, ``0.0.0.0``
    (or ``::``) for a Prometheus elsewhere. A port in use raises UserInputError naming the
    fix. :meth:`stop` shuts the server down and joins its threads, so a second server can
    serve in the same process, on the same port too.
    """

    def __init__(self, registry: CollectorRegistry, port: int = 0, host: str = "127.0.0.1") -> None:
        self.registry = registry
        self.host = host
        self.port = port
        self._httpd: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = self.host
        if host in ("", "0.0.0.0", "::"):  # listening everywhere: this machine is one place
            host = "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> MetricsServer:
        if self._httpd is not None:
            return self
        server_class = _Server6 if ":" in self.host else _Server
        try:
            httpd = make_server(
                self.host, self.port, make_wsgi_app(self.registry), server_class, _Handler
            )
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                msg = (
                    f"metrics port {self.port} is in use on {self.host or 'every address'}; "
                    "pick another --metrics-port (metrics_port=), or 0 for a free one"
                )
            else:
                msg = (
                    f"cannot serve metrics on {self.host}:{self.port}: {e.strerror}; check "
                    "--metrics-host and --metrics-port"
                )
            raise UserInputError(msg) from None
        self._httpd = httpd
        self.port = httpd.server_address[1]
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
            name="cdcflow-metrics", daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and wait for the server's threads (idempotent)."""
        httpd, thread = self._httpd, self._thread
        self._httpd = self._thread = None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join()

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
