"""SparkRunner: run a batch's tasks as one Spark job, a few Spark tasks per executor core.

``run_tasks`` broadcasts the program once, then runs
``sc.parallelize(list(enumerate(tasks)), n).mapPartitions(...)`` with
``n = min(len(tasks), tasks_per_core * defaultParallelism)``: every Spark task runs its
group of cdcflow tasks one after the other, each through
:func:`cdcflow.engine.task.execute_task` where it runs (an executor's Python worker), sinks
write from there, and only the small result bytes come back to the driver. Grouping keeps
the per-Spark-task cost (scheduling, shipping, a worker's gc) to a few per core per batch
however many partitions are active; a group's slices are retried together.

This module and :mod:`._session` (how the session starts) are the only ones that import
pyspark, and they do so inside functions, so ``import cdcflow`` stays light; driver-side
code that needs the session (the WriteSpark sink's commit) gets it from
:func:`active_session`.

Failures. A task that raises an ordinary exception, or whose Python worker dies, is retried
by Spark (``local[N,F]`` gives local mode F attempts; clusters use
``spark.task.maxFailures``). Errors that another attempt cannot fix — the pipeline's error
policy said stop (:class:`~cdcflow.errors.PipelineStopped`), bad user input, a change stream
or tracker error — are handed back to the driver as they are and raised there, as the
in-memory runner would. When Spark gives up, :class:`SparkTaskError` names the task;
a :class:`~cdcflow.errors.TransientError` (a SinkIOError, Spanner that kept failing) is
raised on the driver as itself instead, so the engine's batch retries see what it is.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import gc
import hashlib
import logging
import os
import pickle
import re
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from cdcflow.errors import (
    BatchInterrupted,
    CdcflowError,
    ChangeStreamError,
    ConfigurationError,
    PipelineStopped,
    SparkTaskError,
    TaskAttemptError,
    TrackerError,
    TransientError,
    UserInputError,
    caused_by,
)
from cdcflow.logformat import WORKER_LOG_ENV, configure_worker_logging
from cdcflow.model import Timestamp
from cdcflow.processes import settle_collector
from cdcflow.spark._launch import (
    refuse_heap_options,
)
from cdcflow.spark._quiet import quiet_jvm_death
from cdcflow.spark._session import (
    JAVA_OPTIONS,
    LOG_DIR_PREFIX,
    extra_python_paths,
    jvm_dir,
    start_session,
    submitted_conf,
    sweep_log_dirs,
    tmpdir_given,
)

__all__ = [
    "DEFAULT_LOCAL_CONF",
    "SparkRunner",
    "SparkTaskError",
    "active_session",
    "local_master",
]

_log = logging.getLogger("cdcflow.spark")

#: Attempts per task in local mode (Spark's own default for clusters is 4 as well).
_LOCAL_TASK_ATTEMPTS = 4

#: Settings for local masters (``local...`` and ``local-cluster[...]``); the user's ``conf``
#: wins over every one of them.
DEFAULT_LOCAL_CONF: Mapping[str, str] = {
    # Python workers talk to the JVM over a Unix socket: about half the per-task overhead.
    "spark.python.unix.domain.socket.enabled": "true",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "4",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
}

#: Settings for every master.
_ALWAYS_CONF: Mapping[str, str] = {
    # A reused Python worker keeps its process-wide caches (Spanner clients) across tasks.
    "spark.python.worker.reuse": "true",
    # PySpark's daemon, without a traceback for a worker whose socket closed at shutdown.
    "spark.python.daemon.module": "cdcflow.spark.daemon",
}

#: Errors another attempt of the same task cannot fix: raised on the driver as they are.
_FINAL_ERRORS: tuple[type[BaseException], ...] = (
    PipelineStopped,
    UserInputError,
    ChangeStreamError,
    TrackerError,
)

_LOCAL = re.compile(r"^local(?:\[(\*|\d+)\])?$")
_LOCAL_FORMS = re.compile(r"^local(\[(\*|\d+)(,\d+)?\])?$|^local-cluster\[\d+, *\d+, *\d+\]$")
_CLUSTER_MASTERS = ("spark://", "yarn", "k8s://", "mesos://")
_SPARK_TASK = re.compile(r"Task (\d+) in stage \S+ failed (\d+) times")
_CDCFLOW_TASK = re.compile(r"cdcflow task (\d+) failed")
# A transient error travels to the driver in the failure's text, pickled, as [carried:...]:
# Spark hands the driver only the text of the last attempt's error.
_CARRIED = re.compile(r" ?\[carried:([A-Za-z0-9+/=]+)\]")

_QUIET_LOG4J2 = """\
# The root level stays WARN, the shell's default, so Spark does not announce a level change;
# the console shows errors only.
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.filter.threshold.type = ThresholdFilter
appender.console.filter.threshold.level = error
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
"""

# A failed task: cdcflow names it and its cause in one line of its own, where Spark's
# executor and scheduler print the Python traceback of every attempt (hundreds of lines).
# Kept with --debug.
_QUIET_TASK_FAILURES = """logger.executor.name = org.apache.spark.executor.Executor
logger.executor.level = off
logger.tasks.name = org.apache.spark.scheduler.TaskSetManager
logger.tasks.level = off
"""


def local_master(master: str | None) -> str:
    """The master to use: ``local[*]`` by default, and a bare ``local``/``local[N]`` gets
    task retries (``local[N,4]``) since plain local mode never retries a failed task."""
    master = master or "local[*]"
    match = _LOCAL.match(master)
    if match is None:
        return master
    if (match.group(1) or "1").strip("0") == "":
        msg = f"{master!r} gives Spark no cores: use local[*] or local[N] with N >= 1"
        raise ConfigurationError(msg)
    return f"local[{match.group(1) or '1'},{_LOCAL_TASK_ATTEMPTS}]"


def check_master(master: str) -> None:
    """Refuse at once, in one line, a ``local`` master Spark cannot parse, and a
    ``spark://`` master none of whose hosts accepts a connection (Spark itself tries for a
    minute, then fails with pages of Java stack traces)."""
    fix = "is it running, and is the host:port right?"
    if master.startswith("local") or not master.startswith(_CLUSTER_MASTERS):
        if not _LOCAL_FORMS.match(master):
            msg = (f"{master!r} is not a Spark master: use local[*], local[N], "
                   "spark://HOST:PORT, yarn or k8s://https://HOST:PORT")
            raise ConfigurationError(msg)
        return
    if not master.startswith("spark://"):
        return
    failures = []
    for where in master[len("spark://"):].split(","):
        host, _, port = where.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
            return
        except (OSError, ValueError) as exc:
            failures.append(f"{where}: {exc}")
    msg = f"cannot reach the Spark master {master} ({'; '.join(failures)}); {fix}"
    raise ConfigurationError(msg)


def active_session() -> Any:
    """The active SparkSession of this driver (a ``pyspark.sql.SparkSession``), or None."""
    from pyspark.sql import SparkSession

    return SparkSession.getActiveSession()


def _is_local(master: str) -> bool:
    return master.startswith("local")


def _groups(count: int, groups: int) -> list[range]:
    """``range(count)`` cut into ``groups`` contiguous runs whose lengths differ by at most 1."""
    return [range(g * count // groups, (g + 1) * count // groups) for g in range(groups)]


def _run_partition(
    program: Any, groups: Iterable[list[tuple[int, bytes]]]
) -> Iterator[Any]:
    """Executor side: run the partition's group of tasks, one after the other; yields
    ``(index, ok, payload)`` per task.

    ``ok`` False means ``payload`` is a pickled error that retrying cannot fix.
    """
    from cdcflow.engine.task import execute_task

    configure_worker_logging()  # the driver's log format (JSON lines), not bare text
    code: bytes = program.value
    for index, task in (item for group in groups for item in group):
        try:
            result = execute_task(code, task)
        except _FINAL_ERRORS as exc:
            yield index, False, _pickle_error(exc)
            continue
        except Exception as exc:
            notes = "".join(f"; {n}" for n in getattr(exc, "__notes__", ()))
            msg = f"cdcflow task {index} failed: {type(exc).__name__}: {exc}{notes}"
            if isinstance(exc, TransientError):
                msg += f" [carried:{base64.b64encode(_pickle_transient(exc)).decode()}]"
            raise TaskAttemptError(msg) from exc
        yield index, True, result
    # A reused PySpark worker runs a full gc.collect() after every task; with the cached
    # program and client in the heap that costs up to a second per task. Collecting the
    # task's garbage now and freezing what survives keeps those collections small (and
    # the next task's young collections rare, as on the driver).
    gc.collect()
    settle_collector()


def _pickle_error(exc: BaseException) -> bytes:
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:
        # An exception whose arguments do not survive pickling: keep its type's name and text.
        data = pickle.dumps(PipelineStopped(f"{type(exc).__name__}: {exc}"))
    return data


def _pickle_transient(exc: TransientError) -> bytes:
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
    except Exception:
        data = pickle.dumps(TransientError(f"{type(exc).__name__}: {exc}"))
    return data


def _carried(text: str) -> BaseException | None:
    """The transient error a failed task's text carries, or None."""
    found = _CARRIED.findall(text)
    if not found:
        return None
    try:
        error = pickle.loads(base64.b64decode(found[-1]))
    except Exception:
        return None
    return error if isinstance(error, TransientError) else None


def _describe_task(task: bytes, index: int) -> str:
    """``task 3 (batch 7, partition tok, slice [a, b))``, as much as the bytes tell."""
    try:
        decoded = pickle.loads(task)
        sl = decoded.slice
        start, end = Timestamp.from_ns(sl.start), Timestamp.from_ns(sl.end)
        return (
            f"task {index} (batch {decoded.batch_id}, partition {sl.token}, "
            f"slice [{start}, {end}))"
        )
    except Exception:
        return f"task {index}"


def _check_parallelism(sc: Any) -> None:
    """Read what every batch reads, ``defaultParallelism``, once the session started: Spark
    reads ``spark.default.parallelism`` only then, so a bad one failed the first batch
    (exit 1, and a supervisor restarting the run) instead of the start."""
    try:
        sc.defaultParallelism  # noqa: B018 (read for its check)
    except Exception as exc:
        said = str(getattr(exc, "java_exception", exc)).splitlines()[0]
        said = re.sub(r"^[\w.$]+(?:Exception|Error): ", "", said)
        msg = f"Spark did not start: {said} (check --master and every --conf)"
        raise ConfigurationError(msg) from None


def _raise_if_gone(exc: BaseException) -> None:
    """Raise what a call into the JVM that failed with ``exc`` means, when it is not the
    call's own failure: an abort (a second Ctrl-C) that cut py4j's wait short (py4j then
    says the JVM's answer was empty, as when the JVM is gone), or the JVM gone."""
    if caused_by(exc, KeyboardInterrupt):
        raise KeyboardInterrupt from None
    if _jvm_gone(exc):
        msg = (f"Spark's JVM is gone ({type(exc).__name__}: {exc}): it was killed, or ran "
               "out of memory (raise spark.driver.memory with --conf)")
        raise SparkTaskError(msg) from None


def _jvm_gone(exc: BaseException) -> bool:
    """Whether a call into Spark failed because its JVM no longer answers."""
    from py4j.protocol import Py4JNetworkError  # type: ignore[import-untyped]

    return caused_by(exc, (Py4JNetworkError, ConnectionRefusedError, ConnectionResetError))


def _cause_text(exc: BaseException) -> str:
    """The most telling line of a Spark job failure: the Python error when there is one."""
    text = str(exc)
    for line in text.splitlines():
        match = _CDCFLOW_TASK.search(line)
        if match:
            return line[match.end() :].strip().removeprefix(":").strip()
    if "Python worker exited unexpectedly" in text:
        return ("its Python worker exited unexpectedly (killed, out of memory, or os._exit "
                "in a user function)")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Exit)\b", ln)]
    cause = errors[-1] if errors else lines[0] if lines else type(exc).__name__
    return _CARRIED.sub("", cause)[:500].rstrip(".")


# What setJobGroup sets on the submitting thread; restored after each job.
_JOB_PROPERTIES = ("spark.jobGroup.id", "spark.job.description", "spark.job.interruptOnCancel")


class SparkRunner:
    """Runs each batch as one Spark job.

    ``master``: a Spark master URL; default ``local[*]`` (with task retries), or the master
    spark-submit configured when running under it. ``conf``: extra Spark settings; they win
    over the local defaults (:data:`DEFAULT_LOCAL_CONF`).

    ``tasks_per_core``: a batch runs as at most this many Spark tasks per core of the
    cluster (``defaultParallelism``), each running a group of slices in turn; a batch with
    fewer slices runs one Spark task per slice.

    ``open`` uses the active SparkSession when there is one (e.g. in a notebook), else
    builds one named after the pipeline; ``close`` stops only a session it built.

    Every Spark job of a run is in one job group (:attr:`job_group`), whichever thread
    submits it: the group set on the thread that opened the run, else ``cdcflow-<name>``.
    ``sparkContext.cancelJobGroup(runner.job_group)`` cancels the run's jobs.

    Executors cannot see a stop request, so :meth:`interrupt` (called by the engine when
    the run is asked to stop) cancels the batch still running ``stop_grace`` seconds later
    (a task retrying calls to a downstream that is down, say): ``run_tasks`` then raises
    :class:`~cdcflow.errors.BatchInterrupted`, the run ends as stopped, and the next run
    replays the batch.
    """

    name = "spark"

    def __init__(
        self,
        master: str | None = None,
        conf: Mapping[str, str] | None = None,
        *,
        tasks_per_core: int = 2,
        stop_grace: float = 10.0,
    ) -> None:
        if tasks_per_core < 1:
            msg = f"SparkRunner(tasks_per_core={tasks_per_core}): use 1 or more"
            raise ValueError(msg)
        if not stop_grace >= 0:
            msg = f"SparkRunner(stop_grace={stop_grace}): use 0 seconds or more"
            raise ValueError(msg)
        self.stop_grace = stop_grace
        self._jobs = 0  # Spark jobs running now (a batch, and one read ahead)
        self._cancelled = False  # interrupt() cancelled the run's jobs
        self._grace: threading.Timer | None = None
        self._lock = threading.RLock()  # interrupt() may run in a signal handler
        self.master = master
        self.conf: dict[str, str] = dict(conf or {})
        self.tasks_per_core = tasks_per_core
        self._session: Any = None
        self._owns_session = False
        self._broadcasts: dict[bytes, Any] = {}
        self._log_dir: tempfile.TemporaryDirectory[str] | None = None
        self.job_group = ""

    @property
    def session(self) -> Any:
        """The SparkSession of this run (after ``open``)."""
        if self._session is None:
            msg = "SparkRunner.session is used before open(); call open(app_name) first"
            raise CdcflowError(msg)
        return self._session

    def open(self, app_name: str) -> None:
        if self._session is not None:
            return
        # Workers must run the project's interpreter (the one with cdcflow installed).
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            _log.debug("using the active SparkSession (master %s)", active.sparkContext.master)
            self._session, self._owns_session = active, False
            self._pick_job_group(app_name)
            return
        settings = self._settings(app_name)
        check_master(settings["spark.master"])
        refuse_heap_options(settings)
        builder = SparkSession.builder
        for key, value in settings.items():
            builder = builder.config(key, value)
        began = time.monotonic()
        self._session = start_session(builder, settings)
        self._owns_session = True
        _check_parallelism(self._session.sparkContext)
        quiet_jvm_death(self._session.sparkContext)
        if _is_local(self._session.sparkContext.master):
            self._session.sparkContext.setLogLevel("ERROR")
        # Start-up is most of a short run's time on Spark: say what it cost.
        _log.info("Spark session started in %.1fs (master %s)", time.monotonic() - began,
                  self._session.sparkContext.master)
        self._pick_job_group(app_name)

    def _pick_job_group(self, app_name: str) -> None:
        # Job groups are per thread (pinned threads) and batches may be run from a
        # read-ahead thread: keep the opener's group and set it on every job.
        current = self._session.sparkContext.getLocalProperty("spark.jobGroup.id")
        self.job_group = current or f"cdcflow-{app_name}"

    def _settings(self, app_name: str) -> dict[str, str]:
        """Spark settings for a session this runner builds.

        Under spark-submit, what spark-submit was given wins over the defaults here (the
        driver JVM is already running), and the runner's own ``master``/``conf`` win over both.
        """
        submitted = submitted_conf()
        settings: dict[str, str] = {"spark.app.name": app_name, **_ALWAYS_CONF}
        master = self.master or self.conf.get("spark.master") or submitted.get("spark.master")
        settings["spark.master"] = local_master(master)
        for name in ("SPANNER_EMULATOR_HOST", *WORKER_LOG_ENV):
            if os.environ.get(name):
                settings[f"spark.executorEnv.{name}"] = os.environ[name]
        if _is_local(settings["spark.master"]):
            settings.update(DEFAULT_LOCAL_CONF)
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            # Same machine: user modules the driver imports from extra paths (the pipeline
            # file's directory, tests) are importable by the workers too.
            paths = extra_python_paths()
            if paths:
                settings["spark.executorEnv.PYTHONPATH"] = os.pathsep.join(paths)
            if not submitted:  # the driver JVM starts with this session: quiet it
                log_file = self._quiet_log_config()
                option = f"-Dlog4j2.configurationFile=file:{log_file}"
                if not tmpdir_given(self.conf):
                    # the JVM's own temporary files (liblz4-java-*.so, spark-*): see jvm_dir
                    option += f" -Djava.io.tmpdir={jvm_dir()}"
                settings["spark.driver.extraJavaOptions"] = option
                settings["spark.executor.extraJavaOptions"] = option
                # Spark's scratch space (blockmgr-*, spark-*) in the runner's own directory:
                # a driver that is killed leaves it, and the next start on this host sweeps it
                settings["spark.local.dir"] = os.path.join(self._runner_dir(), "local")
        for key in submitted:
            if key != "spark.master":
                settings.pop(key, None)
        for key, value in self.conf.items():
            ours = settings.get(key)
            if key in JAVA_OPTIONS and ours and not value.strip():
                continue  # nothing of the user's: the runner's stay
            if key in JAVA_OPTIONS and ours and ours not in value:
                # the user's options after the runner's: theirs win for a property both set
                # (the JVM takes the last), and the runner's quiet logging and temporary
                # directory stay
                value = f"{ours} {value}"
            settings[key] = value
        if self.master:
            settings["spark.master"] = local_master(self.master)
        _log.debug("Spark settings: %s", settings)
        return settings

    def _runner_dir(self) -> str:
        """This runner's directory (see ``LOG_DIR_PREFIX``), made on first use after the
        ones of drivers no longer alive are swept."""
        if self._log_dir is None:
            sweep_log_dirs()
            self._log_dir = tempfile.TemporaryDirectory(prefix=f"{LOG_DIR_PREFIX}{os.getpid()}-")
        return self._log_dir.name

    def _quiet_log_config(self) -> str:
        path = os.path.join(self._runner_dir(), "log4j2.properties")
        debug = logging.getLogger("cdcflow").isEnabledFor(logging.DEBUG)
        with open(path, "w", encoding="utf-8") as f:
            f.write(_QUIET_LOG4J2 if debug else _QUIET_LOG4J2 + _QUIET_TASK_FAILURES)
        return path

    def _broadcast(self, program: bytes) -> Any:
        key = hashlib.sha256(program).digest()
        bc = self._broadcasts.get(key)
        if bc is None:
            # One program per run in practice: release older ones so executors drop them.
            for old in self._broadcasts.values():
                old.unpersist(blocking=False)
            self._broadcasts.clear()
            bc = self._session.sparkContext.broadcast(program)
            self._broadcasts[key] = bc
        return bc

    def run_tasks(self, program: bytes, tasks: Sequence[bytes]) -> list[bytes]:
        """Run every task as one Spark job; results in task order.

        Raises :class:`SparkTaskError` naming the task when Spark gave up on one, or the
        task's own error when another attempt could not fix it (e.g. ``PipelineStopped``).
        """
        if not tasks:
            return []
        try:  # the calls into the JVM before the job's: a JVM gone fails them first
            sc = self.session.sparkContext
            bc = self._broadcast(program)
            n = min(len(tasks), self.tasks_per_core * max(1, sc.defaultParallelism))
            groups = _groups(len(tasks), n)
            # One element per Spark partition (parallelize would batch a flat list its own
            # way): Spark task g runs group g, so a failure names its slices.
            elements = [[(i, tasks[i]) for i in group] for group in groups]
            before = {key: sc.getLocalProperty(key) for key in _JOB_PROPERTIES}
            sc.setJobGroup(self.job_group, f"cdcflow: {len(tasks)} tasks in {n} Spark tasks")
            rdd = sc.parallelize(elements, n).mapPartitions(
                functools.partial(_run_partition, bc))
        except Exception as exc:
            _raise_if_gone(exc)
            raise
        with self._lock:
            self._jobs += 1
        try:
            collected: list[tuple[int, bool, bytes]] = rdd.collect()
        except Exception as exc:
            if self._cancelled:
                msg = (f"the batch was still running {self.stop_grace:g}s after the stop "
                       "request, so its Spark job was cancelled")
                raise BatchInterrupted(msg) from None
            if self._grace is not None:
                # Asked to stop: the signal most likely reached the JVM and the workers
                # too (a supervisor signals the whole process group, or cgroup).
                msg = (f"the batch's Spark job failed after the stop request "
                       f"({_cause_text(exc)})")
                raise BatchInterrupted(msg) from None
            _raise_if_gone(exc)
            raise self._task_error(exc, tasks, groups) from exc
        finally:
            with self._lock:
                self._jobs -= 1
            with contextlib.suppress(Exception):  # (not when the JVM is gone)
                for key, value in before.items():
                    sc.setLocalProperty(key, value)
        collected.sort(key=lambda item: item[0])
        if [index for index, _, _ in collected] != list(range(len(tasks))):
            msg = (
                f"Spark returned {len(collected)} results for {len(tasks)} tasks; "
                "the batch is not committed and will be replayed"
            )
            raise SparkTaskError(msg)
        for index, ok, payload in collected:
            if not ok:
                error = pickle.loads(payload)
                if isinstance(error, BaseException):
                    error.add_note(f"in Spark {_describe_task(tasks[index], index)}")
                    raise error
        return [payload for _, _, payload in collected]

    def _task_error(
        self, exc: BaseException, tasks: Sequence[bytes], groups: Sequence[range]
    ) -> BaseException:
        text = str(exc)
        # A cdcflow task's index when its error says it; else the Spark task's (a group)
        ours = _CDCFLOW_TASK.search(text)
        spark = _SPARK_TASK.search(text)
        attempts = f" after {spark.group(2)} attempts" if spark else (
            " on every attempt Spark allowed"
        )
        if ours and 0 <= int(ours.group(1)) < len(tasks):
            index = int(ours.group(1))
            which = _describe_task(tasks[index], index)
        elif spark and 0 <= int(spark.group(1)) < len(groups):
            group = groups[int(spark.group(1))]
            shown = [_describe_task(tasks[i], i) for i in group[:3]]
            more = f" and {len(group) - 3} more" if len(group) > 3 else ""
            which = f"task running {'; '.join(shown)}{more}"
        else:
            which = "job"
        carried = _carried(text)
        if carried is not None:
            carried.add_note(f"in Spark {which}, failed{attempts}")
            return carried
        msg = (
            f"Spark {which} failed{attempts}: {_cause_text(exc)}. Nothing of the batch was "
            "committed; fix the cause (the executor log has the traceback; with a local "
            "master, --debug prints it) and run again to replay it"
        )
        return SparkTaskError(msg)

    def interrupt(self) -> None:
        """The run was asked to stop: cancel its Spark jobs still running ``stop_grace``
        seconds from now (see the class docstring)."""
        with self._lock:
            if self._grace is not None or self._session is None:
                return
            self._grace = threading.Timer(self.stop_grace, self._cancel)
            self._grace.daemon = True
            self._grace.start()

    def _cancel(self) -> None:
        with self._lock:
            if self._jobs == 0 or self._session is None:
                return
            self._cancelled = True
            session = self._session
        _log.warning("the batch is still running %gs after the stop request: cancelling its "
                     "Spark job (the next run replays it)", self.stop_grace)
        with contextlib.suppress(Exception):  # the session may be stopping
            session.sparkContext.cancelJobGroup(self.job_group)

    def close(self) -> None:
        with self._lock:
            if self._grace is not None:
                self._grace.cancel()
        for bc in self._broadcasts.values():
            # the session may already be gone; nothing to release then
            with contextlib.suppress(Exception):
                bc.unpersist(blocking=False)
        self._broadcasts.clear()
        if self._session is not None and self._owns_session:
            try:
                self._session.stop()
            except Exception as exc:  # its JVM is gone (killed): nothing is left to stop
                if not _jvm_gone(exc):
                    raise
        self._session, self._owns_session = None, False
        if self._log_dir is not None:
            self._log_dir.cleanup()
            self._log_dir = None
