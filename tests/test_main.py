"""The ``cdcflow`` command's entry point: a Ctrl-C or SIGTERM while the command line loads
is one line and exit 130, not Python's traceback of the import under way."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# The command, with the import of one module cdcflow.cli needs made slow (it says when it
# has begun): the signal then lands while the command line loads, every time.
_SLOW_LOAD = """
import importlib.abc, sys, time
FLAG = sys.argv[1]
class Slow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "cdcflow.launch":
            open(FLAG, "w").close()
            time.sleep(60)
        return None
sys.meta_path.insert(0, Slow())
from cdcflow.__main__ import main
sys.argv[1:] = ["status", "--help"]
sys.exit(main())
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_command_line_loads_is_one_line(tmp_path: Path,
                                                           sig: signal.Signals) -> None:
    began = tmp_path / "loading"
    child = subprocess.Popen([sys.executable, "-c", _SLOW_LOAD, str(began)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not began.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert began.exists()
    child.send_signal(sig)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 130
    assert err == "\ncdcflow: interrupted\n" and out == ""


def test_python_m_cdcflow_is_the_command() -> None:
    done = subprocess.run([sys.executable, "-m", "cdcflow", "--version"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("cdcflow ")
