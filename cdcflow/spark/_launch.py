"""Starting Spark's JVM so that a start that fails is said in one line.

PySpark starts the JVM (``spark-submit``) with this process's stderr. A JVM that refuses
its settings prints there: ``spark-submit``'s usage (about 290 lines) for an ``-Xmx`` in
the Java options, the JVM's own error for ``spark.driver.memory=abc``, a stack trace for a
SparkContext that cannot be made. Here the JVM is started by the runner instead (PySpark's
``launch_gateway``, with the same settings) with its stderr on a pipe that
:class:`JvmStderr` relays to this process's stderr, holding it back while the session
starts: on success what was held is written out and the relay goes on for the JVM's life
(Spark's later errors and the Python workers' output, which inherit the JVM's stderr); on
failure the held text gives the runner its one line (and is logged at DEBUG).

The JVM's notice that Spark uses an incubator module (``WARNING: Using incubator modules``)
is dropped: nothing can be done about it, and it was the one line that was not JSON under
``--log-format json``.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Mapping
from typing import Any

from cdcflow.errors import ConfigurationError

__all__ = ["JvmStderr", "failure_line", "jvm_said", "launch_gateway", "refuse_heap_options"]

_log = logging.getLogger("cdcflow.spark")

_DROPPED = (b"WARNING: Using incubator modules",)
_HEAP = re.compile(r"(?:^|\s)(-Xmx\S*)")


class JvmStderr:
    """A pipe for the JVM's stderr, and the thread that relays it to fd 2.

    ``fd`` is the write end to give the JVM; :meth:`launched` closes this process's copy
    once the JVM has it. Lines are held until :meth:`release` (written out, then relayed
    as they come) or :meth:`discard` (kept back; what was held is returned)."""

    def __init__(self) -> None:
        self._read, self.fd = os.pipe()
        self._lock = threading.Lock()
        self._held: list[bytes] | None = []
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._relay, name="cdcflow-jvm-stderr",
                                        daemon=True)
        self._thread.start()

    def launched(self) -> None:
        """The JVM has its copy of the write end (or was never started): close ours, so
        the relay ends when the JVM does."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def release(self) -> None:
        """Write out what was held; from now on relay each line as it comes."""
        with self._lock:
            held, self._held = self._held, None
            if held:
                _write(b"".join(held))

    def discard(self, wait: float = 5.0) -> str:
        """Stop holding, without writing out what was held, and return it as text; wait up
        to ``wait`` seconds for the JVM's end of the pipe to close (a JVM that exited has
        said everything)."""
        self._ended.wait(wait)
        with self._lock:
            held, self._held = self._held, None
        return b"".join(held or []).decode("utf-8", "replace")

    def _relay(self) -> None:
        pending = b""
        try:
            while True:
                chunk = os.read(self._read, 65536)
                if not chunk:
                    break
                lines = (pending + chunk).split(b"\n")
                pending = lines.pop()
                self._put([line + b"\n" for line in lines])
            if pending:
                self._put([pending])
        except OSError:
            pass
        finally:
            os.close(self._read)
            self._ended.set()

    def _put(self, lines: list[bytes]) -> None:
        kept = [line for line in lines if not line.startswith(_DROPPED)]
        if not kept:
            return
        with self._lock:
            if self._held is not None:
                self._held.extend(kept)
                return
        _write(b"".join(kept))


def _write(data: bytes) -> None:
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:
        pass  # stderr closed: the JVM's output has nowhere to go


def launch_gateway(settings: Mapping[str, str], stderr: JvmStderr) -> Any:
    """PySpark's ``launch_gateway`` with ``settings`` (given to ``spark-submit`` as the
    session's builder would give them) and ``stderr`` as the JVM's stderr."""
    from pyspark import SparkConf
    from pyspark.java_gateway import launch_gateway as launch

    conf = SparkConf(loadDefaults=False)
    for key, value in settings.items():
        conf.set(key, value)
    try:
        return launch(conf, popen_kwargs={"stderr": stderr.fd})  # type: ignore[no-untyped-call]
    finally:
        stderr.launched()


# What gRPC (abseil's log format) prints in a forked child of a process whose gRPC clients
# run threads: "E1128 00:48:39.661057    8427 ev_epoll1_linux.cc:373] ...". A launcher that
# dies before it execs the JVM says only that; it is not the JVM's word.
_GRPC_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]]+\] ")


def jvm_said(text: str) -> str:
    """``text`` without the lines a forked launcher's gRPC printed before it died."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not _GRPC_LINE.match(line))


def failure_line(text: str) -> str:
    """The line that says why the JVM (or SparkContext) did not start: a Java exception's
    message when there is one, else the first line said; "" when nothing was."""
    lines = [re.sub(r'^Exception in thread "[^"]*" ', "", ln.strip())
             for ln in text.splitlines() if ln.strip()]
    for line in lines:
        match = re.match(r"^(?:Caused by: )?[\w.$]+(?:Exception|Error): (.+)$", line)
        if match and not line.startswith("Error: "):
            return match.group(1)
    return lines[0].removeprefix("Error: ") if lines else ""


def refuse_heap_options(settings: Mapping[str, str]) -> None:
    """Refuse a heap size in the Java options (Spark refuses it, with its usage text)."""
    for role in ("driver", "executor"):
        key = f"spark.{role}.extraJavaOptions"
        match = _HEAP.search(settings.get(key, ""))
        if match:
            msg = (f"{key} may not set the heap size ({match.group(1)}): use "
                   f"--conf spark.{role}.memory={match.group(1)[4:] or '4g'} instead")
            raise ConfigurationError(msg)
