"""The emulator launcher: free ports, start/stop, and a clear error when it is missing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from cdcflow.errors import CdcflowError, ConfigurationError
from cdcflow.spanner.emulator import (
    Emulator,
    EmulatorNotFoundError,
    find_emulator_binary,
    free_port,
)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.emulator
def test_start_serve_and_stop() -> None:
    with Emulator() as emu:
        assert emu.host == f"127.0.0.1:{emu.port}"
        assert _listening(emu.port)
        db = emu.create_database("probe", ["CREATE TABLE T (Id INT64) PRIMARY KEY (Id)"])
        with db.snapshot() as snap:
            assert list(snap.execute_sql("SELECT 1")) == [[1]]
        port = emu.port
        assert emu.log_path is not None
        log = Path(emu.log_path)  # asking for it does not keep it (the CLI prints it)
        assert log.exists()
    assert not _listening(port)
    assert not log.exists()  # it stopped cleanly: the log goes with it


@pytest.mark.emulator
def test_the_log_of_an_emulator_that_stopped_answering_stays() -> None:
    emu = Emulator().start()
    try:
        assert emu.pid is not None
        os.kill(emu.pid, signal.SIGKILL)
        with pytest.raises(CdcflowError, match="stopped answering") as failed:
            emu.wait_while_answering(every=0.1)
    finally:
        emu.stop()
    named = Path(str(failed.value).rsplit("see ", 1)[1])
    assert named.name.startswith("spanner-emulator-")
    assert named.exists()  # the error named it: it stays for the user to read
    named.unlink()


@pytest.mark.emulator
def test_two_emulators_get_different_ports(spanner_emulator: Emulator) -> None:
    other = Emulator().start()
    try:
        assert other.port != spanner_emulator.port
        assert _listening(other.port) and _listening(spanner_emulator.port)
    finally:
        other.stop()
    assert _listening(spanner_emulator.port)


def test_missing_binary_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CDCFLOW_SPANNER_EMULATOR", str(tmp_path / "nowhere" / "emulator_main"))
    hint = "apt-get install google-cloud-cli-spanner-emulator"
    with pytest.raises(EmulatorNotFoundError, match=hint):
        find_emulator_binary()
    with pytest.raises(EmulatorNotFoundError, match=r"CDCFLOW_SPANNER_EMULATOR=.*nowhere"):
        Emulator()


def test_directory_without_binary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CDCFLOW_SPANNER_EMULATOR", str(tmp_path))
    with pytest.raises(EmulatorNotFoundError, match="not an executable emulator_main"):
        find_emulator_binary()


def test_binary_that_exits_at_start(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "emulator_main"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CDCFLOW_SPANNER_EMULATOR", str(fake))
    logs = tmp_path / "logs"  # the logs that stay are here, not in /tmp
    logs.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(logs))
    emu = Emulator()
    with pytest.raises(Exception, match="exited with code 3") as failed:
        emu.start(timeout=10)
    emu.stop()
    named = str(failed.value).rsplit("see its log ", 1)[1]
    assert Path(named).exists()  # the error named it: it stays
    Path(named).unlink()
    runs = tmp_path / "runs"
    emu = Emulator()
    with pytest.raises(Exception, match="exited with code 3") as failed:
        emu.start(timeout=10, attempts=2)
    emu.stop()
    named = str(failed.value).rsplit("see its log ", 1)[1]
    assert list(logs.iterdir()) == [Path(named)]  # the first attempt's went: nobody read it
    fake.write_text(f"#!/bin/sh\necho run >> {runs}\nexit 3\n")
    with pytest.raises(Exception, match="exited with code 3"):
        Emulator().start(timeout=10, attempts=2)
    assert runs.read_text().splitlines() == ["run", "run"]  # started twice, then the error


def test_a_binary_that_aborts_once_at_start_is_started_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # what the real emulator does now and then: abort (SIGABRT) right after it starts
    real = find_emulator_binary()
    flag = tmp_path / "aborted"
    fake = tmp_path / "emulator_main"
    fake.write_text(f"#!/bin/sh\nif [ ! -e {flag} ]; then touch {flag}; kill -ABRT $$; fi\n"
                    f'exec {real} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CDCFLOW_SPANNER_EMULATOR", str(fake))
    emu = Emulator()
    first = emu.port
    try:
        emu.start(timeout=60)
        assert flag.exists() and _listening(emu.port)
        assert emu.port != first  # a port of its own choosing: a fresh one
    finally:
        emu.stop()


@pytest.mark.emulator
def test_an_emulator_ends_with_the_process_that_started_it(tmp_path: Path) -> None:
    # A killed test session or demo never leaves an emulator behind (and starting it runs
    # no code between fork and exec in a process with threads, which could abort it).
    script = (
        "import sys, threading, time\n"
        "from cdcflow.spanner.emulator import Emulator\n"
        "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "emu = Emulator().start()\n"
        "print(emu._proc.pid, emu.port, flush=True)\n"
        "time.sleep(60)\n"
    )
    # its log, which a killed process cannot remove, in tmp_path rather than /tmp
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(tmp_path)})
    assert parent.stdout is not None
    pid, port = (int(v) for v in parent.stdout.readline().split())
    assert _listening(port)
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert b"emulator_main" in f.read()  # the trampoline became the emulator
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _listening(port):
        time.sleep(0.1)
    assert not _listening(port)


def test_a_port_that_is_taken_is_refused_before_the_emulator_starts() -> None:
    # The emulator would fail to bind it and exit (a listener), or bind it beside another
    # emulator (gRPC reuses ports): clients would reach either at random.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigurationError, match=f"port {port} on 127.0.0.1 is taken"):
            Emulator(port=port).start()
    with pytest.raises(ConfigurationError, match="70000 is not a TCP port"):
        Emulator(port=70000).start()
