"""InMemoryRunner: tasks as pickled bytes on a thread pool, results in task order."""

from __future__ import annotations

import pickle
import threading
from typing import Any

import cloudpickle
import pytest

import cdcflow as cf
from cdcflow.engine.runner import Runner, Task, TaskResult
from cdcflow.engine.task import TaskProgram
from cdcflow.errors import PipelineStopped
from cdcflow.model import Slice
from cdcflow.plugins import load_plugin
from cdcflow.policy import ErrorPolicy
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import Collect, DetectPartitions, Map, ReadPartition

S = 1_000_000_000
T0 = 1_700_000_000 * S


def _program(*steps: Any, policy: ErrorPolicy | None = None) -> bytes:
    s = ScriptedChangeStream("S", partitions=4, buckets=16, origin=T0)
    for i in range(40):
        s.write("T", i, "INSERT", {"v": i}, at=T0 + i * S // 4)
    p = cf.Pipeline("mem", error_policy=policy)
    pc = p | DetectPartitions(stream="S", start_at=T0, client=s) | ReadPartition()
    for step in steps:
        pc = pc | step
    pc | Collect()
    p.validate()
    return bytes(cloudpickle.dumps(TaskProgram.from_pipeline(p)))


def _tasks(tokens: list[str]) -> list[bytes]:
    return [pickle.dumps(Task("mem", 1, Slice(t, T0, T0 + 20 * S))) for t in tokens]


def test_is_a_registered_runner() -> None:
    runner = InMemoryRunner(workers=2)
    assert isinstance(runner, Runner) and runner.name == "memory"
    assert load_plugin("cdcflow.runners", "memory") is InMemoryRunner


def test_results_come_back_in_task_order_as_pickled_bytes() -> None:
    runner = InMemoryRunner(workers=3)
    runner.open("mem")
    tokens = ["p3", "p0", "p2", "p1", "p0"]
    raw = runner.run_tasks(_program(), _tasks(tokens))
    runner.close()
    results = [pickle.loads(b) for b in raw]
    assert all(isinstance(r, TaskResult) for r in results)
    assert [r.token for r in results] == tokens
    assert sum(r.records for r in results[:4]) == 40
    assert results[1].sink_messages == results[4].sink_messages
    assert runner.run_tasks(_program(), []) == []


def _fail_on_7(r: Any) -> Any:
    if r.mods[0].new_values["v"] == 7:
        raise RuntimeError("seven")
    return r


def test_a_failing_task_raises_after_every_task_ended() -> None:
    runner = InMemoryRunner(workers=4)
    with pytest.raises(PipelineStopped, match="seven"):
        runner.run_tasks(_program(Map(_fail_on_7), policy=ErrorPolicy(retries=0)),
                         _tasks(["p0", "p1", "p2", "p3"]))
    runner.close()


def test_unpicklable_output_fails_as_it_would_on_spark() -> None:
    program = _program(Map(lambda r: threading.Lock()))  # the program itself pickles
    runner = InMemoryRunner(workers=1)
    with pytest.raises(TypeError, match="pickle") as info:  # the task's result does not
        runner.run_tasks(program, _tasks(["p0", "p1", "p2", "p3"]))
    assert "the value the writer of sink 'Collect' returned from close() cannot be pickled" \
        in info.value.__notes__[0]


def test_workers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="workers=0"):
        InMemoryRunner(workers=0)
    assert InMemoryRunner().workers >= 1


def test_closing_cancels_the_tasks_still_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    # A second Ctrl-C mid-batch: the run ends, and the runner does not run the thousands of
    # tasks still queued before it closes.
    import time
    from concurrent.futures import CancelledError

    from cdcflow.runners import in_memory

    ran: list[bytes] = []

    def slow(program: bytes, task: bytes) -> bytes:
        time.sleep(0.1)
        ran.append(task)
        return task

    monkeypatch.setattr(in_memory, "execute_task", slow)
    runner = InMemoryRunner(workers=2)
    runner.open("t")
    raised: list[BaseException] = []

    def run() -> None:
        try:
            runner.run_tasks(b"p", [b"t"] * 100)
        except BaseException as exc:  # what the batch's thread sees
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(0.15)
    began = time.monotonic()
    runner.close()
    assert time.monotonic() - began < 1.0  # not the 5 s the queue holds
    thread.join(5)
    assert len(ran) < 10
    assert raised and isinstance(raised[0], CancelledError)
