"""`cdcflow status`: text, --json, --watch and --lineage over a real SQLite store that a
scripted pipeline with a split and a merge wrote."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import cdcflow as cf
from cdcflow.engine.lifecycle import count_states, low_watermark
from cdcflow.engine.ownership import Ownership
from cdcflow.errors import UserInputError
from cdcflow.metadata import open_store
from cdcflow.model import BatchPlan, Slice, Timestamp
from cdcflow.status import (
    render_lineage,
    render_status,
    render_svg,
    status_document,
    watch_status,
)
from cdcflow.testing import ScriptedChangeStream

S = 1_000_000_000
T0 = 1_700_000_000 * S
NOW = T0 + 60 * S


def _pipeline(name: str, end: int) -> cf.Pipeline:
    stream = ScriptedChangeStream("Orders", partitions=2, origin=T0)
    for i in range(20):
        stream.write("Orders", {"id": i}, "INSERT", {"n": i}, at=T0 + (i + 1) * 100_000_000)
    stream.split("p0", at=T0 + 700_000_000, into=["p0a", "p0b"])
    stream.merge(["p0b", "p1"], at=T0 + 1_400_000_000, into="m")
    pipeline = cf.Pipeline(name)
    (pipeline
     | cf.DetectPartitions(stream="Orders", start_at=T0, end_at=end, client=stream)
     | cf.ReadPartition(heartbeat="100ms")
     | cf.Collect())
    return pipeline


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    """A store holding "done" (read to its end) and "live" (stopped after 6 batches, with
    partitions still running, and a pending batch planned and not committed)."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    _pipeline("done", T0 + 3 * S).run("memory", url, batch_interval=0, max_batch_span="500ms")
    _pipeline("live", T0 + 3600 * S).run("memory", url, batch_interval=0,
                                         max_batch_span="500ms", max_batches=6)
    store = open_store(url)
    try:
        parts = store.partitions("live")
        end = low_watermark(parts) + S
        slices = [Slice(p.token, p.watermark, end) for p in parts if p.state.value == "RUNNING"]
        store.write_plan("live", BatchPlan(store.last_batch_id("live") + 1, end, slices,
                                           planned_at=NOW - 5 * S), {})
    finally:
        store.close()
    return url


def cdcflow(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cdcflow", *args], capture_output=True,
                          text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)


def test_json_matches_the_store(store_url: str) -> None:
    result = cdcflow("status", "--metadata", store_url, "--json", "--batches", "3")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["store"] == store_url
    by_name = {p["name"]: p for p in doc["pipelines"]}
    assert sorted(by_name) == ["done", "live"]
    store = open_store(store_url)
    try:
        for name, got in by_name.items():
            parts = store.partitions(name)
            lease = store.lease(name)
            assert lease is not None  # the runs released their lease when they ended
            assert got["run"]["alive"] is False and got["run"]["run_id"] == lease.run_id
            assert got["run"]["owner"] == lease.owner
            assert got["low_watermark_ns"] == low_watermark(parts)
            assert got["partitions_by_state"] == count_states(parts)
            assert [(p["token"], p["state"], p["watermark_ns"], p["parents"])
                    for p in got["partitions"]] == [
                (p.token, p.state.value, p.watermark, list(p.parent_tokens)) for p in parts]
            batches = store.batches(name, limit=3)
            assert [(b["batch_id"], b["records"], b["slices"]) for b in got["recent_batches"]] \
                == [(b.batch_id, b.records, b.slices) for b in batches]
        assert by_name["done"]["finished"] is True and by_name["done"]["lag_seconds"] == 0
        assert by_name["done"]["pending_batch"] is None
        live = by_name["live"]
        assert live["finished"] is False
        # the scripted stream is in 2023: the lag is measured against today's clock
        assert live["lag_seconds"] > 3600
        pending = store.pending_plan("live")
        assert pending is not None
        assert live["pending_batch"]["batch_id"] == pending.batch_id
        assert [s["token"] for s in live["pending_batch"]["slices"]] == [
            s.token for s in pending.slices]
        running = [p for p in live["partitions"] if p["state"] == "RUNNING"]
        assert running and all(p["lag_seconds"] > 0 for p in running)
        done = [b for b in by_name["done"]["recent_batches"] if b["committed_at"]]
        assert done and all(b["seconds"] >= 0 for b in done)
    finally:
        store.close()


def test_document_and_text_at_a_fixed_time(store_url: str) -> None:
    store = open_store(store_url)
    try:
        doc = status_document(store, "live", now_ns=NOW)
        (live,) = doc["pipelines"]
        assert live["lag_seconds"] == (NOW - live["low_watermark_ns"]) / S
        assert live["low_watermark"] == Timestamp.from_ns(live["low_watermark_ns"]).rfc3339()
        text = render_status(store, "live", now_ns=NOW)
        assert "run            not running (last run " in text
        assert "pending batch  7: " in text and "(the next run replays it)" in text
        # while a run is alive, its pending batch is the one it is committing
        owner = Ownership(store, "live", 60.0, lambda: None)
        owner.acquire(takeover=False)
        try:
            text = render_status(store, "live")
            assert "pending batch  7: " in text
            assert "(the running run is reading or committing it)" in text
        finally:
            owner.release()
        with pytest.raises(UserInputError, match=r"no pipeline named 'nope'.*done, live"):
            status_document(store, "nope")
    finally:
        store.close()


def test_active_partitions_are_listed_furthest_behind_first(tmp_path: Path) -> None:
    from cdcflow.model import MAX_NS, PartitionMetadata

    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        marks = {f"p{i}": T0 + (i * 7 % 12) * S for i in range(12)}  # p10 before p2 as text
        store.insert_partitions("wide", [PartitionMetadata(t, (), T0, MAX_NS, w, "RUNNING")
                                         for t, w in marks.items()])
        text = render_status(store, "wide", now_ns=NOW)
    finally:
        store.close()
    listed = [line.split()[0] for line in text.splitlines()
              if line.strip().startswith("p") and " running " in line]
    assert listed == sorted(marks, key=lambda t: marks[t])
    assert "active partitions (furthest behind first):" in text


def test_the_source_and_an_end_at_applied_on_resume(tmp_path: Path) -> None:
    """Status shows the source a pipeline goes on with, and partition ends as its runs see
    them: after an earlier end_at was applied, a stored partition's end is the new one."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    _pipeline("live", T0 + 3600 * S).run("memory", url, batch_interval=0,
                                         max_batch_span="100ms", max_batches=3)
    end = T0 + 2 * S
    # applied: the run goes on to the new end_at (the pipeline stops after one batch)
    _pipeline("live", end).run("memory", url, batch_interval=0, max_batch_span="100ms",
                               max_batches=1)
    store = open_store(url)
    try:
        assert any(p.end > end + 1 for p in store.partitions("live"))  # stored as they were
        (live,) = status_document(store, "live", now_ns=NOW)["pipelines"]
        assert live["source"]["end_at"] == Timestamp.from_ns(end).rfc3339()
        assert live["source"]["end_at_ns"] == end
        assert live["source"]["start_at"] == Timestamp.from_ns(T0).rfc3339()
        ends = {p["end"] for p in live["partitions"] if p["state"] != "FINISHED"}
        assert ends == {Timestamp.from_ns(end + 1).rfc3339()}
        text = render_status(store, "live", now_ns=NOW)
        assert ("source         stream Orders of <ScriptedChangeStream>, from "
                f"{Timestamp.from_ns(T0).rfc3339()} to {Timestamp.from_ns(end).rfc3339()}"
                in text)
    finally:
        store.close()


def test_lineage_shows_the_split_and_the_merge(store_url: str) -> None:
    result = cdcflow("status", "--metadata", store_url, "--pipeline", "done", "--lineage", "dot")
    assert result.returncode == 0, result.stderr
    dot = result.stdout
    ids = dict(re.findall(r'^  (p\d+) \[label="([^\\"]+)', dot, re.M))
    names = {v: k for k, v in ids.items()}
    edges = set(re.findall(r"^  (\w+) -> (\w+);", dot, re.M))
    assert {(names["p0"], names["p0a"]), (names["p0"], names["p0b"])} <= edges  # a split
    assert {(names["p0b"], names["m"]), (names["p1"], names["m"])} <= edges  # a merge
    assert dot.startswith('digraph "done" {') and dot.rstrip().endswith("}")
    several = cdcflow("status", "--metadata", store_url, "--lineage", "dot")
    assert several.returncode == 2
    assert "choose one with --pipeline NAME" in several.stderr


def test_lineage_marks_collected_parents(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'gc.db'}"
    _pipeline("gc", T0 + 3 * S).run("memory", url, batch_interval=0, max_batch_span="500ms",
                                    gc_ttl=0)
    store = open_store(url)
    try:
        tokens = {p.token for p in store.partitions("gc")}
        dot = render_lineage(store)
    finally:
        store.close()
    assert "p0" not in tokens  # collected once its children started
    assert re.search(r'\[label="p0\\ncollected", style=dashed', dot)


def test_lineage_svg_without_dot_names_the_fix(store_url: str, tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path)}  # no `dot` here
    result = cdcflow("status", "--metadata", store_url, "--pipeline", "done", "--lineage",
                     "svg", env=env)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "apt-get install graphviz" in result.stderr and "--lineage dot" in result.stderr


@pytest.mark.skipif(shutil.which("dot") is None,
                    reason="Graphviz is not installed (apt-get install graphviz)")
def test_lineage_svg_with_dot(store_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cdcflow", "status", "--metadata", store_url, "--pipeline",
         "done", "--lineage", "svg"], capture_output=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    svg = result.stdout.decode()
    assert "<svg" in svg and svg.rstrip().endswith("</svg>")
    assert "p0a" in svg and "(root query)" in svg
    store = open_store(store_url)
    try:
        assert render_svg(render_lineage(store, "done")).startswith(b"<?xml")
    finally:
        store.close()


def test_watch_refreshes_a_given_number_of_times(store_url: str) -> None:
    result = cdcflow("status", "--metadata", store_url, "--pipeline", "live", "--watch", "0.1",
                     "--watch-count", "3")
    assert result.returncode == 0, result.stderr
    frames = result.stdout.split("--- every 0.1s: cdcflow status at ")
    assert len(frames) == 4 and frames[0] == ""
    assert all("pipeline live" in f for f in frames[1:])
    usage = cdcflow("status", "--metadata", store_url, "--watch-count", "3")
    assert usage.returncode == 2 and "--watch-count needs --watch" in usage.stderr


def test_watch_on_a_terminal_redraws_in_place_until_ctrl_c(store_url: str) -> None:
    main, child = pty.openpty()
    # As a shell starts it: Ctrl-C's SIGINT neither ignored nor blocked, whatever this test
    # process's threads and libraries did with theirs (inherited through exec).
    as_from_a_shell = (
        "import runpy, signal, sys; "
        "signal.signal(signal.SIGINT, signal.default_int_handler); "
        "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
        f"sys.argv = ['cdcflow', 'status', '--metadata', {store_url!r}, '--watch', '0.2']; "
        "runpy.run_module('cdcflow', run_name='__main__')"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", as_from_a_shell],
        stdin=child, stdout=child, stderr=child, close_fds=True,
    )
    os.close(child)
    out = b""
    try:
        deadline = time.monotonic() + 60
        while out.count(b"\x1b[H") < 4 and time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 1)
            if ready:
                out += os.read(main, 65536)
        proc.send_signal(signal.SIGINT)
        # Read on until it exits: a terminal nobody reads fills up, and the watch's last
        # write would wait for it (under load, frames written before Ctrl-C filled it).
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 0.2)
            if ready:
                try:
                    out += os.read(main, 65536)
                except OSError:  # the child's side closed
                    break
        # Its terminal closed (the read above fails with EIO once the child has closed
        # it): the interpreter may still be finishing, which takes seconds under load.
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            with open(f"/proc/{proc.pid}/status") as f:
                masks = [line.strip() for line in f if line.startswith("Sig")]
            pytest.fail(f"no exit 90 s after Ctrl-C; {masks}; last output {out[-300:]!r}")
        assert code == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(main)
    text = out.decode(errors="replace")
    assert text.startswith("\x1b[2J\x1b[H")  # the screen is cleared once
    frames = text.split("\x1b[H")[1:]
    assert len(frames) >= 4
    for frame in frames[:3]:  # each redraw starts at the top and clears what it overwrites
        assert frame.startswith("every 0.2s: cdcflow status at ")
        assert "pipeline done\x1b[K" in frame and "pipeline live\x1b[K" in frame
        assert frame.endswith("\x1b[J")


def test_watch_stops_quietly_on_keyboard_interrupt() -> None:
    calls: list[int] = []

    def render() -> str:
        calls.append(1)
        return "frame\n"

    def sleep(seconds: float) -> Any:
        if len(calls) == 2:
            raise KeyboardInterrupt
        return None

    class Out:
        text = ""

        def write(self, s: str) -> int:
            self.text += s
            return len(s)

        def flush(self) -> None:
            return None

        def isatty(self) -> bool:
            return False

    out = Out()
    assert watch_status(render, 5, stream=out, sleep=sleep) == 2  # type: ignore[arg-type]
    assert out.text.count("frame\n") == 2


def test_a_batch_held_past_stuck_after_flags_its_partitions_while_the_run_lives(
    store_url: str,
) -> None:
    import socket

    store = open_store(store_url)
    try:
        pending = store.pending_plan("live")
        assert pending is not None and pending.planned_at == NOW - 5 * S
        held = sorted(s.token for s in pending.slices)

        def stuck(now: int, after: float | None = None) -> tuple[list[str], list[str]]:
            (doc,) = status_document(store, "live", now_ns=now, stuck_after=after)["pipelines"]
            return doc["stuck_partitions"], sorted(p["token"] for p in doc["partitions"]
                                                   if p["stuck"])

        # the run ended: nothing is stuck, the run is not alive (and says so)
        assert stuck(NOW + 3600 * S) == ([], [])
        lease = store.acquire_lease("live", f"{socket.gethostname()}:{os.getpid()}", "r1",
                                    3600 * S)
        # planned 5 s ago: not yet past the default (10 heartbeats, at least 30 s)
        assert stuck(NOW) == ([], [])
        assert stuck(NOW, after=1.0) == (held, held)
        assert stuck(NOW + 40 * S) == (held, held)
        assert "running (stuck)" in render_status(store, "live", now_ns=NOW + 40 * S)
        assert "running (stuck)" not in render_status(store, "live", now_ns=NOW)
        assert "running (stuck)" in render_status(store, "live", now_ns=NOW, stuck_after=1.0)
        # the command line gives the run's threshold too (the clock is today: long past)
        text = cdcflow("status", "--metadata", store_url, "--pipeline", "live",
                       "--stuck-after", "1s")
        assert text.returncode == 0 and "running (stuck)" in text.stdout, text.stderr
        # finished partitions and partitions outside the batch are never flagged
        doc = status_document(store, "live", now_ns=NOW + 40 * S)["pipelines"][0]
        assert all(not p["stuck"] for p in doc["partitions"] if p["token"] not in held)
        store.release_lease("live", lease)
        assert stuck(NOW + 40 * S) == ([], [])
    finally:
        store.close()


def test_recent_batches_show_phase_times_and_what_the_error_policy_did(tmp_path: Path) -> None:
    stream = ScriptedChangeStream("Orders", origin=T0)
    for i in range(12):
        stream.write("Orders", {"id": i}, "INSERT", {"n": i}, at=T0 + (i + 1) * 100_000_000)

    def poison(r: cf.DataChangeRecord) -> cf.DataChangeRecord:
        if r.mods[0].keys["id"] % 4 == 0:  # ids 0, 4, 8
            raise ValueError("poison")
        return r

    dead: cf.Collect[Any] = cf.Collect()
    policy = cf.ErrorPolicy(retries=1, backoff="1ms", then="skip", dead_letter=dead)
    pipeline = cf.Pipeline("errors", error_policy=policy)
    (pipeline
     | cf.ReadChangeStream(stream="Orders", start_at=T0, end_at=T0 + 2 * S, client=stream)
     | cf.Map(poison)
     | cf.Collect())
    url = f"sqlite:///{tmp_path / 'state.db'}"
    pipeline.run("memory", url, batch_interval=0, max_batch_span="500ms")

    result = cdcflow("status", "--metadata", url, "--json", "--batches", "20")
    assert result.returncode == 0, result.stderr
    batches = json.loads(result.stdout)["pipelines"][0]["recent_batches"]
    assert len(batches) >= 4
    assert sum(b["skipped"] for b in batches) == 3
    assert sum(b["dead_lettered"] for b in batches) == 3
    assert sum(b["retried"] for b in batches) == 3  # one retry each
    assert sum(b["bytes"] for b in batches) > 0
    for b in batches:
        assert set(b["phases"]) == {"plan", "execute", "sink_commit"}
        assert all(0 <= s < 30 for s in b["phases"].values())
        assert b["seconds"] >= b["phases"]["execute"]
    text = cdcflow("status", "--metadata", url, "--batches", "20").stdout
    header = next(line for line in text.splitlines() if "BATCH" in line)
    assert header.split() == ["BATCH", "END", "SLICES", "RECORDS", "PLANNED", "TOOK", "PLAN",
                              "READ", "SINKS", "RETRIED", "SKIPPED", "DEAD"]
    rows = [line.split() for line in text.splitlines()[text.splitlines().index(header) + 1:]]
    assert sum(int(row[-2]) for row in rows) == 3  # the SKIPPED column


def test_watch_into_a_reader_that_goes_away_ends_quietly(store_url: str) -> None:
    """`cdcflow status --watch | head -1`: the reader has read what it wanted; the watch
    ends with exit 0 and says nothing, as `cdcflow run ... | head` does."""
    command = [sys.executable, "-m", "cdcflow", "status", "--metadata", store_url,
               "--pipeline", "live", "--watch", "0.05", "--watch-count", "200"]
    watch = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert watch.stdout is not None and watch.stderr is not None
    assert watch.stdout.readline()  # the first line, then the reader goes away
    watch.stdout.close()
    try:
        code = watch.wait(timeout=60)
    finally:
        watch.kill()
    err = watch.stderr.read().decode()
    assert code == 0 and err == "", err


def test_a_staging_sink_s_durable_mark_and_the_batches_it_owes(tmp_path: Path) -> None:
    """A staging sink (WriteTables) makes output durable after the store commits it: status
    shows through which batch it is durable, and how many committed batches it still owes
    (what a crash now would leave to the next run to write again)."""
    url = f"sqlite:///{tmp_path / 'state.db'}"
    stream = ScriptedChangeStream("Orders", origin=T0)
    for i in range(6):
        stream.write("Orders", {"id": i}, "INSERT", {"n": i}, at=T0 + (i + 1) * 100_000_000)
    pipeline = cf.Pipeline("tables")
    (pipeline
     | cf.ReadChangeStream(stream="Orders", start_at=T0, end_at=T0 + S, client=stream)
     | cf.WriteTables(str(tmp_path / "out")))
    summary = pipeline.run("memory", url, batch_interval=0, max_batch_span="200ms")
    store = open_store(url)
    try:
        last = store.last_batch_id("tables")
        label = next(iter(store.durable_marks("tables")))
        # a graceful end made everything durable
        doc = status_document(store, "tables")["pipelines"][0]
        assert doc["staging_sinks"] == [{"sink": label, "durable_through": last,
                                         "owed_batches": 0}]
        assert f"staging sink   {label}: durable through batch {last}\n" in \
            render_status(store, "tables") + "\n"
        # as a crash before the last flushes leaves it (the mark is behind the batch log)
        store.reset("tables")  # forgets the marks; batch ids go on
        store.mark_durable("tables", {label: last - 3})
        doc = status_document(store, "tables")["pipelines"][0]
        assert doc["staging_sinks"] == [{"sink": label, "durable_through": last - 3,
                                         "owed_batches": 3}]
        assert (f"staging sink   {label}: durable through batch {last - 3}; 3 committed "
                "batches after it staged, not durable yet") in render_status(store, "tables")
    finally:
        store.close()
    assert summary.batches >= 4
    # a pipeline without a staging sink shows none
    plain = cf.Pipeline("plain")
    (plain
     | cf.ReadChangeStream(stream="Orders", start_at=T0, end_at=T0 + S, client=stream)
     | cf.Collect())
    plain.run("memory", url, batch_interval=0)
    store = open_store(url)
    try:
        assert status_document(store, "plain")["pipelines"][0]["staging_sinks"] == []
        assert "staging sink" not in render_status(store, "plain")
    finally:
        store.close()
