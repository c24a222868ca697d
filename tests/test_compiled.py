"""cdcflow.compiled: the optional compiled module is built by the install, and can be
turned off."""

from __future__ import annotations

import os
import subprocess
import sys

from cdcflow.compiled import speedups


def test_the_install_built_the_compiled_module() -> None:
    # Installing the project compiles it (setup.py); without it the decoder and the JSON
    # writer would run in Python only, and the benchmarks would measure that.
    if os.environ.get("CDCFLOW_PURE_PYTHON", "") not in ("", "0"):
        return
    module = speedups()
    assert module is not None
    assert callable(module.decode) and callable(module.non_finite)


def test_cdcflow_pure_python_turns_it_off() -> None:
    code = ("from cdcflow.compiled import speedups; from cdcflow.spanner import records; "
            "print(speedups() is None, records.compiled_decoder())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "CDCFLOW_PURE_PYTHON": "1"})
    assert out.stdout.split() == ["True", "False"]
