"""The ``runner`` fixture (tests/conftest.py): every runner, and an honest shared Spark one."""

from __future__ import annotations

import pickle
import sys

import cloudpickle
import pytest

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.runner import Runner, Task, TaskResult
from cdcflow.engine.task import TaskProgram
from cdcflow.errors import CdcflowError
from cdcflow.metadata import MemoryStore
from cdcflow.model import INITIAL_PARTITION_TOKEN, Slice
from cdcflow.spark.runner import SparkRunner
from cdcflow.testing import ScriptedChangeStream
from cdcflow.transforms import Collect, DetectPartitions, ReadPartition

cloudpickle.register_pickle_by_value(sys.modules[__name__])

S = 1_000_000_000
T0 = 1_700_000_000 * S


def _pipeline() -> tuple[cf.Pipeline, Collect, ScriptedChangeStream]:
    s = ScriptedChangeStream("S", partitions=2, buckets=8, origin=T0)
    for i in range(20):
        s.write("T", i, "INSERT", {"v": i}, at=T0 + i * S // 4)
    p = cf.Pipeline("fixture")
    out = Collect()
    source = DetectPartitions(stream="S", start_at=T0, end_at=T0 + 10 * S - 1, client=s)
    p | source | ReadPartition() | out
    return p, out, s


def _ident(r: cf.DataChangeRecord) -> tuple[int, str, str]:
    return r.commit_timestamp.ns, r.server_transaction_id, r.partition_token


def _root_task(p: cf.Pipeline) -> tuple[bytes, list[bytes]]:
    p.validate()
    program = bytes(cloudpickle.dumps(TaskProgram.from_pipeline(p)))
    task = pickle.dumps(Task("fixture", 1, Slice(INITIAL_PARTITION_TOKEN, T0, T0 + S)))
    return program, [task]


def test_each_runner_runs_a_pipeline_twice(runner: Runner) -> None:
    assert isinstance(runner, Runner)
    for _ in range(2):  # an Engine opens and closes the runner on every run
        p, out, s = _pipeline()
        summary = Engine(p, MemoryStore(), runner, RunOptions(batch_interval=0)).run()
        assert summary.reason == "end reached"
        expected = s.expected_records(T0, T0 + 10 * S)
        assert sorted(map(_ident, out.items)) == sorted(map(_ident, expected))
        assert summary.records == len(expected) == 20


@pytest.mark.spark
@pytest.mark.parametrize("runner", ["spark"], indirect=True)
def test_shared_spark_runner_refuses_what_spark_refuses(
    runner: Runner, spark_runner: SparkRunner
) -> None:
    program, tasks = _root_task(_pipeline()[0])
    assert runner.name == "spark"
    # unopened (and after close): the runner's own refusal, as an unopened SparkRunner gives
    with pytest.raises(CdcflowError, match=r"before open\(\)"):
        SparkRunner("local[2]").run_tasks(program, tasks)
    with pytest.raises(CdcflowError, match=r"before open\(\)"):
        runner.run_tasks(program, tasks)
    assert runner.run_tasks(program, []) == SparkRunner().run_tasks(program, []) == []
    for _ in range(2):
        runner.open("fixture")
        result = pickle.loads(runner.run_tasks(program, tasks)[0])
        assert isinstance(result, TaskResult) and result.token == INITIAL_PARTITION_TOKEN
        runner.close()
        with pytest.raises(CdcflowError, match=r"before open\(\)"):
            runner.run_tasks(program, tasks)
        # close ended nothing: the session is the test session's
        assert not spark_runner.session.sparkContext._jsc.sc().isStopped()
