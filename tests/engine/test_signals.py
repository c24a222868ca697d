"""A signal's handler takes no lock: a stop request reaches a run wherever it is."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from cdcflow.engine.signals import defer, deferring, settle_deferred

# The handler runs on the main thread wherever it is: here, while that thread holds the
# lock of the Event that a stop request sets (as it does, briefly, every time it waits on
# it between batches), and the lock every thread start takes (a runner's interrupt() starts
# a timer). A handler that took either waited for it for ever: the run never stopped.
HELD = """
import os, signal, sys, threading
import cdcflow as cf
from cdcflow.cli import _GracefulInterrupt
from cdcflow.engine.listener import EngineListener
from cdcflow.engine.loop import Engine
from cdcflow.metadata.memory import MemoryStore
from cdcflow.runners.in_memory import InMemoryRunner

pipeline = cf.Pipeline("p")
engine = Engine(pipeline, MemoryStore(), InMemoryRunner())
which = sys.argv[1]
if which == "cli":
    interrupt = _GracefulInterrupt(EngineListener())
    interrupt.attach(engine)
    installed = interrupt.installed()
else:
    installed = engine._signals()
with installed:
    with engine._stop._cond, threading._active_limbo_lock:
        os.kill(os.getpid(), signal.SIGINT if which == "cli" else signal.SIGTERM)
    assert engine._stop.wait(10), "no stop request"
print("stop requested", flush=True)
"""


@pytest.mark.parametrize("which", ["cli", "engine"])
def test_a_signal_while_the_main_thread_holds_a_lock_requests_the_stop(which: str) -> None:
    """The command line's Ctrl-C handler and the engine's SIGTERM handler each ask the run
    to stop, and say so, however the signal lands."""
    proc = subprocess.Popen([sys.executable, "-c", HELD, which], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the signal's handler waited for a lock the main thread held")
    assert proc.returncode == 0, err
    assert out == "stop requested\n"
    assert "stopping after the current batch" in err, err


def test_defer_runs_the_call_on_another_thread_and_settle_waits_for_it() -> None:
    ran: list[str] = []

    def call() -> None:
        time.sleep(0.2)
        ran.append(threading.current_thread().name)

    with deferring():
        defer(call)
        assert ran == []  # handed off: the caller (a handler) does not wait
        settle_deferred(5)
        assert ran == ["cdcflow-signals"]
        defer(call)
    # the block's end waited for what was deferred, and the thread is gone
    assert ran == ["cdcflow-signals"] * 2
    assert "cdcflow-signals" not in [t.name for t in threading.enumerate()]
    defer(call)  # no handler of cdcflow's is installed: it runs here
    assert ran[-1] == threading.current_thread().name


def test_a_deferred_call_that_fails_is_one_warning_and_the_thread_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[int] = []

    def fails() -> None:
        raise OSError("stderr is gone")

    with deferring():
        defer(fails)
        defer(lambda: ran.append(1))
        settle_deferred(5)
    assert ran == [1]
    assert "while answering a signal: OSError: stderr is gone" in caplog.text
