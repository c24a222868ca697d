"""The JVM's stderr relay and the line a failed start is said in (the CLI's side is in
test_runner.py: bad settings are one line, exit 2)."""

from __future__ import annotations

import logging
import subprocess
import time

import pytest

from cdcflow.errors import ConfigurationError
from cdcflow.spark._launch import (
    JvmOutput,
    failure_line,
    jvm_said,
    refuse_heap_options,
    said_at_start,
)

_JVM = "Invalid maximum heap size: -Xmxabc\nError: Could not create the Java Virtual Machine.\n"
_SUBMIT = ('Exception in thread "main" org.apache.spark.SparkException: Executor cores must '
           "be a positive number\n\tat org.apache.spark.deploy.SparkSubmitArguments.x(A.scala:1)\n")
_CONTEXT = ("org.apache.spark.SparkException: The number of cores per executor (=0) has to be "
            ">= 1.\n\tat org.apache.spark.SparkContext.<init>(SparkContext.scala:603)\n")


@pytest.mark.parametrize(("text", "line"), [
    (_JVM, "Invalid maximum heap size: -Xmxabc"),
    ("Error occurred during initialization of VM\nCould not reserve enough space for "
     "1048575999KB object heap\n", "Could not reserve enough space for 1048575999KB object heap"),
    (_SUBMIT, "Executor cores must be a positive number"),
    (_CONTEXT, "The number of cores per executor (=0) has to be >= 1."),
    ("\nError: Unrecognized option: --bogus\nUsage: spark-submit [options]\n",
     "Unrecognized option: --bogus"),
    ("", ""),
])
def test_failure_line_is_the_message_not_the_stack(text: str, line: str) -> None:
    assert failure_line(text) == line


def test_what_is_held_is_written_out_on_release_then_lines_flow(
        capfd: pytest.CaptureFixture[str]) -> None:
    output = JvmOutput()
    child = subprocess.Popen(
        ["sh", "-c", "echo first >&2; echo out; echo 'WARNING: Using incubator modules: x' >&2; "
                     "read _; echo later >&2"],
        stdin=subprocess.PIPE, text=True, **output.fds)
    output.launched()
    assert child.stdin is not None
    deadline = time.monotonic() + 10
    while (b"first" not in b"".join(output._err._held or [])
           and time.monotonic() < deadline):
        time.sleep(0.01)
    assert capfd.readouterr() == ("", "")  # held while the session starts
    output.release()
    child.stdin.write("go\n")
    child.stdin.close()
    child.wait(timeout=10)
    for relay in (output._out, output._err):  # both relays, each on its own thread
        assert relay.ended.wait(10)
    assert capfd.readouterr() == ("out\n", "first\nlater\n")  # the incubator notice dropped


def test_a_failed_start_keeps_what_was_said_back(capfd: pytest.CaptureFixture[str]) -> None:
    output = JvmOutput()
    subprocess.run(["sh", "-c", f"echo 'to stdout'; printf '{_JVM}' >&2"], check=True,
                   **output.fds)
    output.launched()
    assert output.discard() == "to stdout\n" + _JVM  # stdout (a heap it cannot reserve) too
    assert capfd.readouterr() == ("", "")


def test_what_a_session_that_started_said_is_logged_stacks_at_debug(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="cdcflow.spark")
    said_at_start(["Warning: Ignoring non-Spark config property: foo.bar", "",
                   "26/11/28 ERROR SparkContext: Failed to add /x.jar",
                   "java.io.FileNotFoundException: Jar /x.jar not found",
                   "\tat org.apache.spark.SparkContext.addLocalJarFile$1(SparkContext.scala:2)",
                   "Caused by: java.io.IOException: no", "\t... 3 more"])
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [m for level, m in said if level == logging.WARNING] == [
        "Spark: Warning: Ignoring non-Spark config property: foo.bar",
        "Spark: 26/11/28 ERROR SparkContext: Failed to add /x.jar",
        "Spark: java.io.FileNotFoundException: Jar /x.jar not found",
    ]
    assert len([m for level, m in said if level == logging.DEBUG]) == 3


@pytest.mark.parametrize("role", ["driver", "executor"])
def test_a_heap_size_in_the_java_options_names_the_memory_setting(role: str) -> None:
    key = f"spark.{role}.extraJavaOptions"
    refuse_heap_options({key: "-XX:+UseG1GC"})
    with pytest.raises(ConfigurationError, match=rf"use --conf spark\.{role}\.memory=2g"):
        refuse_heap_options({key: "-Dx=1 -Xmx2g"})


def test_what_grpc_prints_in_a_forked_launcher_is_not_the_jvm_s_word() -> None:
    grpc = ("E1128 00:48:39.661057    8427 ev_epoll1_linux.cc:373] (event_engine) "
            "Epoll1Poller:0x555d6bb00d60 encountered epoll_wait error: Bad file descriptor\n")
    assert jvm_said(grpc) == ""
    assert jvm_said(grpc + _JVM) == _JVM
