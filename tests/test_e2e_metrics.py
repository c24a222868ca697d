"""Metrics and the stuck detector of a snapshot + GroupTransactions run, through the CLI on
the emulator: ``--metrics-port`` is scraped over HTTP while the run lasts.

At every scrape, what was read is what GroupTransactions took in, and what it emitted is
what the sink got; once the stream is idle the counters equal the committed output (the
snapshot's records counted as read). With ``--stuck-after 1s`` and a snapshot that takes
seconds, neither the root partition waiting for the snapshot nor a snapshot partition is
reported stuck.
"""

from __future__ import annotations

import random
import signal
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cdcflow.spanner.emulator import Emulator, free_port
from cdcflow.spanner.workload import Workload
from tests.e2e_features import Feature, TableWriter, bulk_insert_orders, create_feature_database
from tests.e2e_helpers import unique
from tests.test_e2e_transactions import PIPELINE

pytestmark = pytest.mark.emulator

S = 1_000_000_000
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples | None:
    """Every sample (name, sorted labels but ``pipeline``) -> value; None if not serving."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "pipeline"))
            samples[(s.name, labels)] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def check_identity(samples: Samples) -> tuple[float, float]:
    """Records read = GroupTransactions' input; its output = the Map's = the sink's."""
    read = value(samples, "cdcflow_records_read_total")
    into = value(samples, "cdcflow_elements_total", step="GroupTransactions", direction="in")
    out = value(samples, "cdcflow_elements_total", step="GroupTransactions", direction="out")
    mapped = value(samples, "cdcflow_elements_total", step="summary", direction="out")
    written = value(samples, "cdcflow_sink_writes_total", sink="WriteFiles")
    steps = {k: v for k, v in samples.items() if k[0] in (
        "cdcflow_elements_total", "cdcflow_sink_writes_total")}
    assert read == into, f"read {read}, GroupTransactions took {into}: {steps}"
    assert out == mapped == written, f"emitted {out}, mapped {mapped}, written {written}"
    return read, written


def test_metrics_add_up_and_no_false_stuck_warnings_during_a_snapshot(
    spanner_emulator: Emulator, tmp_path: Path
) -> None:
    name = unique("met")
    db = create_feature_database(spanner_emulator, name)
    start = bulk_insert_orders(db, 30_000)
    feature = Feature(spanner_emulator, tmp_path, name, PIPELINE)
    feature.env["E2E_SNAPSHOT"] = "1"
    # No end: the run lasts until the stream has been idle for a while, then is stopped.
    feature.window(start, start + 3600 * 1_000_000_000)
    port = free_port()
    log = tmp_path / "stderr.txt"
    seed = random.randrange(1 << 20)
    with log.open("w") as err:
        proc = feature.start("--metrics-port", str(port), "--stuck-after", "1s",
                             "--set", "max_batch_span=1s", stderr=err)
    workload = Workload(db, rate=12, seed=seed)
    writer = TableWriter(db, rate=4, seed=seed)
    try:
        thread = workload.start(seconds=4)
        writer.start(4)
        scrapes: list[Samples] = []
        deadline = time.monotonic() + 60
        settled = None
        while proc.poll() is None and time.monotonic() < deadline:
            samples = scrape(port)
            if samples is not None:
                scrapes.append(samples)
                counts = check_identity(samples)
                # Done once the low watermark has passed every write (every transaction
                # is then emitted) and two scrapes agree.
                last = max(t.commit_ns for t in [*workload.committed, *writer.committed])
                low = value(samples, "cdcflow_low_watermark_timestamp_seconds")
                done = not thread.is_alive() and writer.idle() and low * S > last
                if done and settled == counts:
                    break
                settled = counts if done else None
            time.sleep(0.5)
        assert proc.poll() is None, log.read_text()
        final = scrapes[-1]
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
        workload.stop()
        writer.stop()
    stderr = log.read_text()
    assert len(scrapes) >= 5
    read, written = check_identity(final)
    out = [e for _, _, e in feature.output()]
    snapshot_records = sum(e["records"] for e in out if e["snapshot"])
    assert snapshot_records >= 30  # 30k rows, at most 1000 per record
    assert written == len(out)
    assert read == sum(e["records"] for e in out)
    assert sum(e["rows"] for e in out if e["snapshot"]) == 30_000
    assert sum(1 for e in out if not e["snapshot"]) == len(workload.committed) + len(
        writer.committed)
    # The snapshot took seconds, longer than --stuck-after: nothing waiting for it, and
    # no snapshot read, is reported stuck.
    # (A stream partition may be named: 1 s is shorter than some batches of a busy run.)
    warned = [line for line in stderr.splitlines() if "has not advanced" in line]
    assert not [w for w in warned if "snapshot/" in w or "(created)" in w], warned
