"""How the Spark runner starts its session: the JVM launched first (:mod:`._launch`) so that
a start that fails is one line, on a thread of its own (PySpark takes over SIGINT on the
main thread), settings a running JVM cannot take named; and the runner's directories
under the system's temporary one, which the next start on the host sweeps once their
driver is gone."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from typing import Any

from cdcflow.errors import ConfigurationError
from cdcflow.processes import child_pids, process_alive
from cdcflow.spark._launch import (
    JvmOutput,
    failure_line,
    jvm_said,
    launch_gateway,
    said_at_start,
)

__all__ = [
    "JAVA_OPTIONS",
    "LOG_DIR_PREFIX",
    "extra_python_paths",
    "jvm_dir",
    "start_session",
    "submitted_conf",
    "sweep_log_dirs",
    "tmpdir_given",
]

_log = logging.getLogger("cdcflow.spark")


#: The runner's own directory under the system's temporary one (its log4j2 settings, and for
#: a JVM it starts Spark's scratch space, ``spark.local.dir``), named after the driver's
#: process id: a driver that was killed leaves it, and the next start on this host removes it.
#: The JVM's ``java.io.tmpdir`` is one too (:func:`jvm_dir`).
LOG_DIR_PREFIX = "cdcflow-spark-"
_LOG_DIR = re.compile(re.escape(LOG_DIR_PREFIX) + r"(\d+)-[A-Za-z0-9_]+")


def sweep_log_dirs() -> None:
    """Remove the runner directories that drivers no longer alive left behind."""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            m = _LOG_DIR.fullmatch(name)
            if m is not None and not process_alive(int(m.group(1))):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


#: The JVM options the runner sets and a user's ``--conf`` of the same key is added to.
JAVA_OPTIONS = ("spark.driver.extraJavaOptions", "spark.executor.extraJavaOptions")

#: Settings and environment variables through which a user may give the JVM its own
#: ``java.io.tmpdir``, which the runner then leaves alone.
_JAVA_OPTION_SETTINGS = ("spark.driver.extraJavaOptions", "spark.driver.defaultJavaOptions")
_JAVA_OPTION_ENV = ("PYSPARK_SUBMIT_ARGS", "SPARK_SUBMIT_OPTS", "JAVA_TOOL_OPTIONS",
                    "JDK_JAVA_OPTIONS", "JAVA_OPTIONS")

_jvm_dirs: dict[int, str] = {}  # process id -> its JVM's temporary directory


def jvm_dir() -> str:
    """The ``java.io.tmpdir`` of a JVM a runner starts: a runner directory (see
    ``LOG_DIR_PREFIX``) of its own, one per process, since PySpark keeps the JVM until the
    process exits, whichever runner started it. Left in /tmp, the JVM's files (the
    ``liblz4-java-*.so`` it unpacks, empty ``spark-*`` directories, its Python workers'
    ``.*.sock`` sockets) stayed there whenever it was killed; here the next start on the
    host sweeps them once this process is gone, and a process that exits removes the
    directory itself."""
    pid = os.getpid()
    path = _jvm_dirs.get(pid)
    if path is None or not os.path.isdir(path):
        path = tempfile.mkdtemp(prefix=f"{LOG_DIR_PREFIX}{pid}-jvm_")
        _jvm_dirs[pid] = path
        atexit.register(_remove_jvm_dir, pid, path)
    return path


def _remove_jvm_dir(pid: int, path: str) -> None:
    if os.getpid() == pid:  # not in a forked child, whose parent's JVM still runs
        shutil.rmtree(path, ignore_errors=True)


def tmpdir_given(conf: Mapping[str, str]) -> bool:
    """Whether the user gave the driver's JVM a ``java.io.tmpdir`` of their own."""
    given = [conf.get(key, "") for key in _JAVA_OPTION_SETTINGS]
    given += [os.environ.get(name, "") for name in _JAVA_OPTION_ENV]
    return any("-Djava.io.tmpdir=" in text for text in given)



def submitted_conf() -> dict[str, str]:
    """The settings spark-submit gave this driver; empty when not run by spark-submit."""
    if "PYSPARK_GATEWAY_PORT" not in os.environ:
        return {}
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()  # connects to the JVM spark-submit started
    return dict(SparkConf().getAll())


def extra_python_paths() -> list[str]:
    """Directories on the driver's ``sys.path`` beyond the interpreter's own."""
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    extra: list[str] = []
    for entry in sys.path:
        path = os.path.realpath(entry or os.getcwd())
        # a package's own directory (a script's, under spark-submit) would shadow modules
        if not os.path.isdir(path) or path in extra or os.path.exists(f"{path}/__init__.py"):
            continue
        if any(path == p or path.startswith(p + os.sep) for p in prefixes):
            continue
        extra.append(path)
    return extra


#: How often a Spark JVM launcher that died at start without a word is started again.
_LAUNCH_ATTEMPTS = 3


def start_session(builder: Any, settings: Mapping[str, str]) -> Any:
    """``builder.getOrCreate()``, the JVM started first by the runner (:mod:`._launch`) so
    that a start that fails is one line: a :class:`ConfigurationError` naming what the JVM
    or Spark said.

    A JVM launcher that died before it gave its port without saying anything (but what
    gRPC prints in a forked child: :func:`jvm_said`) is started again (up to
    :data:`_LAUNCH_ATTEMPTS` times): PySpark forks that launcher and runs Python in the
    child before it execs; in a process whose gRPC clients (a Spanner store, a
    change-stream check) already run threads, the child now and then dies right there.
    Nothing was started, so starting again is safe.

    PySpark's SparkContext takes over SIGINT (its handler cancels every job and raises
    KeyboardInterrupt); the handler that was there (cdcflow's: stop after the current
    batch) is put back."""
    from pyspark import SparkContext

    handler = signal.getsignal(signal.SIGINT)
    output: JvmOutput | None = None
    before = child_pids()
    try:
        if SparkContext._gateway is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
            output = _launch(settings)
            _jvm_settings.update({k: v for k, v in settings.items() if k in _JVM_START})
        else:
            _warn_unapplied(settings)
        try:
            session = _off_the_main_thread(builder.getOrCreate)
        except Exception as exc:
            line = failure_line(_java_text(exc))
            if line:  # Spark refused a setting: its own output was held, one line instead
                # the JVM lives on: its pipes do not close, so nothing is waited for
                said = output.discard(0) if output is not None else ""
                if said:
                    _log.debug("Spark's output while it started:\n%s", said.rstrip())
                raise ConfigurationError(f"Spark did not start: {line} (check --master and "
                                         "every --conf)") from None
            if output is not None:
                output.release()
            raise
        except BaseException:  # Ctrl-C: what the JVM says is not held back
            if output is not None:
                output.release()
            raise
        if output is not None:  # what it said while it started, in the run's log format
            output.release(said_at_start)
        _make_active(session)
        return session
    except KeyboardInterrupt:  # an abort (a second signal): the JVM it started goes too
        _end_started(before)
        raise
    finally:
        if (handler is not None and signal.getsignal(signal.SIGINT) is not handler
                and threading.current_thread() is threading.main_thread()):
            signal.signal(signal.SIGINT, handler)


def _end_started(before: set[int]) -> None:
    """Kill the processes started since ``before`` was taken (the JVM being started, its
    launcher): a start cut short by an abort left a JVM running with no parent, waiting
    for a Python side that was gone."""
    for pid in child_pids() - before:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _off_the_main_thread(make: Callable[[], Any]) -> Any:
    """``make()`` on a thread of its own, the calling thread waiting: PySpark's SparkContext
    takes over SIGINT when it is made on the main thread, and a Ctrl-C while it was being
    made ran PySpark's handler on a half-made context (about 45 lines of py4j tracebacks);
    made elsewhere, the run's own handler answers (stop once started; again to abort)."""
    if threading.current_thread() is not threading.main_thread():
        return make()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = make()
        except BaseException as exc:  # handed to the waiting thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="cdcflow-spark-start", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)  # signal handlers run on the main thread meanwhile
    if "error" in box:
        raise box["error"]
    return box["value"]


#: Settings the JVM takes only when it starts: PySpark keeps one JVM per process.
_JVM_START = frozenset({"spark.driver.memory", "spark.driver.extraClassPath",
                        "spark.driver.extraLibraryPath"})
#: Those this process's JVM was started with, when the runner started it.
_jvm_settings: dict[str, str] = {}


def _warn_unapplied(settings: Mapping[str, str]) -> None:
    """Say which JVM settings a session made in a JVM already running does not get."""
    unapplied = sorted(f"{key}={value}" for key, value in settings.items()
                       if key in _JVM_START and _jvm_settings.get(key) != value)
    if unapplied:
        _log.warning("this process's Spark JVM is running already, so %s will not apply "
                     "(PySpark keeps one JVM per process): run the pipeline in a new process "
                     "to change it", ", ".join(unapplied))


def _make_active(session: Any) -> None:
    """Make ``session`` this thread's active one, as a session made on this thread is: the
    JVM keeps the active session per thread, and it was made on a thread of its own
    (:func:`_off_the_main_thread`); code of this thread that asks for the active session
    (the runner's next ``open``, a test, a notebook) finds it."""
    from pyspark.sql import SparkSession

    session._jvm.SparkSession.setActiveSession(session._jsparkSession)
    SparkSession._activeSession = session


def _java_home_fault() -> str | None:
    """What is wrong with JAVA_HOME when it names no Java (Spark's launcher runs
    ``$JAVA_HOME/bin/java``), else None."""
    home = os.environ.get("JAVA_HOME")
    if not home or os.access(os.path.join(home, "bin", "java"), os.X_OK):
        return None
    return (f"JAVA_HOME={home} holds no bin/java: point it at a Java 17 or later install, "
            "or unset it to use java on PATH")


def _launch(settings: Mapping[str, str]) -> JvmOutput:
    """Start the JVM (the gateway PySpark's SparkContext then uses); its output, held."""
    from pyspark import SparkContext

    for attempt in range(1, _LAUNCH_ATTEMPTS + 1):
        output = JvmOutput()
        try:
            gateway = launch_gateway(settings, output)
        except Exception as exc:
            if "JAVA_GATEWAY_EXITED" not in str(exc):
                output.release()
                raise
            output_text = output.discard()
            if output_text.strip():
                _log.debug("Spark's JVM launcher said, exiting at start:\n%s",
                           output_text.rstrip())
            said = jvm_said(output_text)
            if said.strip():
                msg = (f"Spark's JVM did not start: {failure_line(said)} "
                       f"({_java_home_fault() or 'check --master and every --conf'})")
                raise ConfigurationError(msg) from None
            if attempt < _LAUNCH_ATTEMPTS:
                _log.warning("the Spark JVM launcher exited at start (attempt %d of %d); "
                             "starting it again", attempt, _LAUNCH_ATTEMPTS)
                continue
            msg = (f"Spark's JVM exited while starting, {_LAUNCH_ATTEMPTS} times, without a "
                   "word: check that Java 17 or later is installed (java on PATH, or "
                   "JAVA_HOME)")
            raise ConfigurationError(msg) from None
        except BaseException:  # Ctrl-C while it starts: what it says is not held back
            output.release()
            raise
        SparkContext._ensure_initialized(gateway=gateway)
        return output
    raise AssertionError("unreachable")


def _java_text(exc: BaseException) -> str:
    """A Py4JJavaError's Java exception as text (``Class: message``); "" for any other
    error."""
    java = getattr(exc, "java_exception", None)
    if java is None:
        return ""
    try:
        return str(java.toString())
    except Exception:
        return ""
