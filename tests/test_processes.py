"""process_alive: a live process, one that exited but is not reaped yet (a zombie), and
one that is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import time

from cdcflow.processes import process_alive


def test_a_killed_process_its_parent_has_not_reaped_is_not_alive() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert process_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while process_alive(child.pid):  # a zombie until reaped below
            assert time.monotonic() < deadline, "a killed, unreaped child still counts as alive"
            time.sleep(0.01)
        os.kill(child.pid, 0)  # the kernel still knows it: what os.kill alone would trust
    finally:
        child.kill()
        child.wait()
    assert not process_alive(child.pid)
    assert process_alive(os.getpid())
