"""Starting Spark's JVM so that a start that fails is said in one line.

PySpark starts the JVM (``spark-submit``) with this process's stdout and stderr. A JVM that
refuses its settings prints there: ``spark-submit``'s usage (about 290 lines) for an
``-Xmx`` in the Java options, the JVM's own error for ``spark.driver.memory=abc`` (on
stdout for a heap it cannot reserve), a stack trace for a SparkContext that cannot be made.
Here the JVM is started by the runner instead (PySpark's ``launch_gateway``, with the same
settings) with its stdout and stderr on pipes that :class:`JvmOutput` relays to this
process's, holding them back while the session starts: on success what was held is logged
(:func:`said_at_start`: in the run's log format, stack traces at DEBUG) and the relay goes
on for the JVM's life (Spark's later errors and the Python workers' output, which inherit
the JVM's stderr); on failure the held text gives the runner its one line (and is logged
at DEBUG).

The JVM's notice that Spark uses an incubator module (``WARNING: Using incubator modules``)
is dropped: nothing can be done about it, and it was the one line that was not JSON under
``--log-format json``."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from cdcflow.errors import ConfigurationError

__all__ = [
    "JvmOutput",
    "failure_line",
    "jvm_said",
    "launch_gateway",
    "refuse_heap_options",
    "said_at_start",
]

_log = logging.getLogger("cdcflow.spark")

_DROPPED = (b"WARNING: Using incubator modules",)
_HEAP = re.compile(r"(?:^|\s)(-Xmx\S*)")


class _Relay:
    """A pipe for one of the JVM's output streams, and the thread that relays it to this
    process's ``target`` file descriptor (1 or 2), holding lines until :meth:`take`."""

    def __init__(self, target: int) -> None:
        self._target = target
        self._read, self.fd = os.pipe()
        self._lock = threading.Lock()
        self._held: list[bytes] | None = []
        self.ended = threading.Event()
        self._thread = threading.Thread(target=self._relay, name="cdcflow-jvm-output",
                                        daemon=True)
        self._thread.start()

    def launched(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def take(self) -> list[bytes]:
        """Stop holding; the lines held so far (relayed as they come from now on)."""
        with self._lock:
            held, self._held = self._held, None
        return held or []

    def write(self, data: bytes) -> None:
        _write(self._target, data)

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
            self.ended.set()

    def _put(self, lines: list[bytes]) -> None:
        kept = [line for line in lines if not line.startswith(_DROPPED)]
        if not kept:
            return
        with self._lock:
            if self._held is not None:
                self._held.extend(kept)
                return
        _write(self._target, b"".join(kept))


class JvmOutput:
    """The JVM's stdout and stderr, each on a pipe that a thread relays to this process's
    (``fds``: what to give the JVM; :meth:`launched` closes this process's copies once the
    JVM has them). What the JVM says is held until :meth:`release` (what was held goes to
    ``said``, or is written out; then lines are relayed as they come) or :meth:`discard`
    (what was held is returned, not written)."""

    def __init__(self) -> None:
        self._out = _Relay(1)
        self._err = _Relay(2)

    @property
    def fds(self) -> dict[str, int]:
        return {"stdout": self._out.fd, "stderr": self._err.fd}

    def launched(self) -> None:
        self._out.launched()
        self._err.launched()

    def release(self, said: Callable[[list[str]], None] | None = None) -> None:
        """Stop holding: what was held is given to ``said`` as lines of text (None: written
        out as it came); from now on each line is relayed as it comes."""
        for relay in (self._out, self._err):
            held = relay.take()
            if not held:
                continue
            if said is None:
                relay.write(b"".join(held))
            else:
                said(b"".join(held).decode("utf-8", "replace").splitlines())

    def discard(self, wait: float = 5.0) -> str:
        """Stop holding, without writing out what was held, and return it as text (the
        JVM's stdout, then its stderr); wait up to ``wait`` seconds for the JVM's ends of
        the pipes to close (a JVM that exited has said everything)."""
        deadline = time.monotonic() + wait
        for relay in (self._out, self._err):
            relay.ended.wait(max(0.0, deadline - time.monotonic()))
        return "".join(b"".join(relay.take()).decode("utf-8", "replace")
                       for relay in (self._out, self._err))


def _write(target: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(target, data):]
    except OSError:
        pass  # closed: the JVM's output has nowhere to go


def launch_gateway(settings: Mapping[str, str], output: JvmOutput) -> Any:
    """PySpark's ``launch_gateway`` with ``settings`` (given to ``spark-submit`` as the
    session's builder would give them), the JVM's stdout and stderr on ``output``."""
    from pyspark import SparkConf
    from pyspark.java_gateway import launch_gateway as launch

    conf = SparkConf(loadDefaults=False)
    for key, value in settings.items():
        conf.set(key, value)
    try:
        return launch(conf, popen_kwargs=output.fds)  # type: ignore[no-untyped-call]
    finally:
        output.launched()


# What gRPC (abseil's log format) prints in a forked child of a process whose gRPC clients
# run threads: "E1128 00:48:39.661057    8427 ev_epoll1_linux.cc:373] ...". A launcher that
# dies before it execs the JVM says only that; it is not the JVM's word.
_GRPC_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]]+\] ")


def jvm_said(text: str) -> str:
    """``text`` without the lines a forked launcher's gRPC printed before it died."""
    return "".join(line for line in text.splitlines(keepends=True)
                   if not _GRPC_LINE.match(line))


# What the JVM says around the line that tells why it did not start.
_GENERIC = ("Error occurred during initialization of VM",
            "Error: Could not create the Java Virtual Machine.",
            "Error: A fatal exception has occurred. Program will exit.")


def failure_line(text: str) -> str:
    """The line that says why the JVM (or SparkContext) did not start: a Java exception's
    message when there is one, else the first line said that is not one of the JVM's
    generic ones; "" when nothing was."""
    lines = [re.sub(r'^Exception in thread "[^"]*" ', "", ln.strip())
             for ln in text.splitlines() if ln.strip()]
    lines = [ln for ln in lines if ln not in _GENERIC] or lines
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


# A line of a Java stack trace (or a note of one), after the line that names the error.
_STACK = re.compile(r"^(\s|at |\.\.\. \d+ more|Caused by: |Suppressed: )")


def said_at_start(lines: list[str]) -> None:
    """What the JVM said while a session started that did start (a warning about a setting,
    an error it went on from): each line that says something as a WARNING of
    ``cdcflow.spark`` (so that it has the run's log format), the stack traces at DEBUG."""
    for line in lines:
        if not line.strip():
            continue
        if _STACK.match(line):
            _log.debug("Spark: %s", line.rstrip())
        else:
            _log.warning("Spark: %s", line.strip())
