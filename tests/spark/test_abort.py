"""An abort (a second Ctrl-C or SIGTERM) while a Spark job runs: the KeyboardInterrupt the
signal handler raised inside py4j's wait comes back as py4j's "Answer from Java side is
empty", the error of a JVM that is gone; the run said the JVM was killed or out of memory
(exit 1). No JVM needed: the runner's session is a stand-in whose job fails that way."""

from __future__ import annotations

from typing import Any

import pytest
from py4j.protocol import Py4JNetworkError  # type: ignore[import-untyped]

from cdcflow.errors import BatchInterrupted, SparkTaskError
from cdcflow.spark.runner import SparkRunner


class _Job:
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def mapPartitions(self, fn: Any) -> _Job:  # PySpark's names, as they are
        return self

    def collect(self) -> list[Any]:
        raise self.error


class _Context:
    defaultParallelism = 2

    def __init__(self, error: BaseException, before_the_job: bool = False) -> None:
        self.error = error
        self.before_the_job = before_the_job  # the broadcast fails, not the job

    def getLocalProperty(self, key: str) -> None:
        return None

    def setLocalProperty(self, key: str, value: Any) -> None:
        return None

    def setJobGroup(self, group: str, description: str) -> None:
        return None

    def broadcast(self, value: bytes) -> Any:
        if self.before_the_job:
            raise self.error
        return value

    def parallelize(self, elements: Any, n: int) -> _Job:
        return _Job(self.error)


class _Session:
    def __init__(self, error: BaseException, before_the_job: bool) -> None:
        self.sparkContext = _Context(error, before_the_job)


def _failing_with(error: BaseException, before_the_job: bool = False) -> SparkRunner:
    runner = SparkRunner()
    runner._session = _Session(error, before_the_job)
    return runner


def _empty_answer(cause: BaseException | None) -> Py4JNetworkError:
    try:
        try:
            if cause is not None:
                raise cause
            raise ConnectionResetError("connection reset")
        except BaseException as exc:
            raise Py4JNetworkError("Answer from Java side is empty") from exc
    except Py4JNetworkError as err:
        return err


def test_an_abort_inside_a_spark_job_is_an_interrupt_not_a_lost_jvm() -> None:
    with pytest.raises(KeyboardInterrupt):
        _failing_with(_empty_answer(KeyboardInterrupt())).run_tasks(b"program", [b"task"])
    with pytest.raises(SparkTaskError, match="Spark's JVM is gone"):  # a JVM that went away
        _failing_with(_empty_answer(None)).run_tasks(b"program", [b"task"])


def test_a_jvm_gone_before_the_job_starts_is_said_so() -> None:
    # killed between batches: the broadcast of the next batch's program is the call that
    # fails, with a bare ConnectionRefusedError (it was the run's whole last line)
    with pytest.raises(SparkTaskError, match="Spark's JVM is gone"):
        _failing_with(ConnectionRefusedError(111, "Connection refused"),
                      before_the_job=True).run_tasks(b"program", [b"task"])
    with pytest.raises(KeyboardInterrupt):
        _failing_with(_empty_answer(KeyboardInterrupt()),
                      before_the_job=True).run_tasks(b"program", [b"task"])


def test_a_job_that_fails_after_the_stop_request_interrupts_the_batch() -> None:
    # A supervisor's SIGTERM to the whole process group (or cgroup) reaches the JVM and the
    # Python workers too: the job then fails. The run was asked to stop: the batch is not
    # committed and the next run reads it again (exit 130), not "fix the cause" (exit 1).
    runner = _failing_with(_empty_answer(None))
    runner.interrupt()
    try:
        with pytest.raises(BatchInterrupted, match="failed after the stop request"):
            runner.run_tasks(b"program", [b"task"])
    finally:
        assert runner._grace is not None
        runner._grace.cancel()
