"""cdcflow.launch: the one way into a run, shared by ``pipeline.run()`` and ``cdcflow run``."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import attrs
import pytest

import cdcflow as cf
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.errors import PluginError, StoreError, StoreURLError, UserInputError
from cdcflow.launch import (
    OptionSpec,
    coerce_option,
    default_store_url,
    make_runner,
    option_specs,
    run_pipeline,
    runner_factory,
    split_options,
)
from cdcflow.metadata import open_store
from cdcflow.metadata.sqlite import SQLiteStore
from cdcflow.runners.in_memory import InMemoryRunner
from cdcflow.spark.runner import SparkRunner
from cdcflow.testing import ScriptedChangeStream

T0 = 1_700_000_000 * 10**9
MS = 1_000_000
END = T0 + 1_000 * MS


def build(out: cf.Collect | None = None, name: str = "launch") -> cf.Pipeline:
    stream = ScriptedChangeStream("Orders", partitions=2, origin=T0)
    for i in range(10):
        stream.write("Orders", {"id": i}, "INSERT", {"n": i}, at=T0 + (i + 1) * 50 * MS)
    pipeline = cf.Pipeline(name)
    (pipeline
     | cf.ReadChangeStream(stream="Orders", start_at=T0, end_at=END, client=stream)
     | (out if out is not None else cf.Collect()))
    return pipeline


class CountingRunner(InMemoryRunner):
    """The memory runner, counting the batches it ran (to see which object ran them)."""

    name = "counting"

    def __init__(self) -> None:
        super().__init__(workers=1)
        self.batches = 0

    def run_tasks(self, program: bytes, tasks: Sequence[bytes]) -> list[bytes]:
        self.batches += 1
        return super().run_tasks(program, tasks)


# -- splitting options ---------------------------------------------------------------------


def test_options_split_between_the_engine_and_the_runner() -> None:
    run, runner = split_options(
        {"max_batches": 3, "gc_ttl": "1h", "reset": True, "workers": 2}, InMemoryRunner, "memory"
    )
    assert run == RunOptions(max_batches=3, gc_ttl=3600.0, reset=True)
    assert runner == {"workers": 2}
    run, runner = split_options(
        {"master": "local[2]", "conf": {"spark.ui.enabled": "false"}, "duration": 5},
        SparkRunner, "spark",
    )
    assert run == RunOptions(duration=5.0)
    assert runner == {"master": "local[2]", "conf": {"spark.ui.enabled": "false"}}


def test_durations_as_text_or_numbers() -> None:
    run, _ = split_options(
        {"batch_interval": "250ms", "max_batch_span": 30, "duration": "1h30m",
         "retry_backoff": 0.5, "gc_ttl": timedelta(minutes=2)},
        None, "memory",
    )
    assert (run.batch_interval, run.max_batch_span, run.duration, run.retry_backoff,
            run.gc_ttl) == (0.25, 30.0, 5400.0, 0.5, 120.0)
    with pytest.raises(UserInputError, match=r"gc_ttl='soon': not a duration.*5m"):
        split_options({"gc_ttl": "soon"}, None, "memory")


def test_unknown_option_lists_the_valid_keys() -> None:
    with pytest.raises(UserInputError) as info:
        split_options({"speed": 11}, InMemoryRunner, "memory")
    message = str(info.value)
    assert message.startswith("unknown option 'speed' for the memory runner; valid: ")
    valid = message.split("valid: ")[1].split(", ")
    assert valid == sorted(valid)
    assert {"batch_interval", "max_batch_span", "max_batches", "duration", "reset",
            "workers"} <= set(valid)
    assert "base_dir" not in valid  # accepted, but set by the CLI, not worth listing
    with pytest.raises(UserInputError, match=r"valid: .*master"):
        split_options({"speed": 11}, SparkRunner, "spark")


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"max_batches": "3"}, "max_batches takes a whole number or none"),
        ({"max_batches": True}, "max_batches takes a whole number"),
        ({"reset": "yes"}, "reset takes true or false"),
        ({"batch_interval": None}, "batch_interval takes a duration such as 30s"),
        ({"batch_interval": [1]}, "batch_interval takes a duration"),
        ({"max_batches": 0}, "bad run option: RunOptions.max_batches must be more than 0"),
        ({"gc_ttl": "-1s"}, "not a duration"),
        ({"gc_ttl": -1}, "RunOptions.gc_ttl must be 0 or more"),
        ({"duration": "nan"}, "duration='nan': not a duration"),
        ({"batch_interval": float("nan")}, "batch_interval takes a duration"),
        ({"gc_ttl": "inf"}, "not a duration"),
        ({"lease_ttl": float("inf")}, "lease_ttl takes a duration"),
        ({"lease_ttl": "1ms"}, r"RunOptions.lease_ttl must be at least 0.1 \(seconds"),
        ({"batch_interval": "99999h"}, r"batch_interval must be at most a day \(86400 s\)"),
        ({"max_task_bytes": "lots"}, "max_task_bytes='lots' is not a size; write e.g. 64MiB"),
        ({"max_task_bytes": 1.5}, "max_task_bytes takes a size such as 64MiB or none"),
        ({"max_task_bytes": 0}, "RunOptions.max_task_bytes must be 1 byte or more"),
    ],
)
def test_bad_values_name_what_the_option_takes(options: dict[str, object], fragment: str) -> None:
    with pytest.raises(UserInputError, match=fragment):
        split_options(options, None, "memory")


def test_option_specs_come_from_run_options_and_the_runner_signature() -> None:
    specs = option_specs(runner_factory("memory"))
    assert specs["max_batch_span"] == OptionSpec("max_batch_span", "duration", False, "run")
    assert specs["duration"] == OptionSpec("duration", "duration", True, "run")
    assert specs["max_batches"] == OptionSpec("max_batches", "int", True, "run")
    assert specs["reset"] == OptionSpec("reset", "bool", False, "run")
    assert specs["max_task_bytes"] == OptionSpec("max_task_bytes", "size", True, "run")
    assert split_options({"max_task_bytes": "64MiB"}, None, "memory")[0].max_task_bytes \
        == 64 << 20
    assert specs["workers"] == OptionSpec("workers", "int", True, "runner")
    spark = option_specs(runner_factory("spark"))
    assert spark["master"] == OptionSpec("master", "text", True, "runner")
    # a runner's float options are seconds, as RunOptions' are: "10s" or 10
    assert spark["stop_grace"] == OptionSpec("stop_grace", "duration", False, "runner")
    assert coerce_option(spark["stop_grace"], "2s") == 2.0
    assert spark["conf"].kind == "any"
    assert "workers" not in spark
    assert set(option_specs(None)) == {f.name for f in attrs.fields(RunOptions)}
    assert all(s.target == "run" for s in option_specs(None).values())


def test_coerce_accepts_paths_for_text() -> None:
    spec = option_specs(None)["base_dir"]
    assert coerce_option(spec, Path("/tmp/x")) == "/tmp/x"


# -- the runner ----------------------------------------------------------------------------


def test_runner_by_name_is_built_with_its_options() -> None:
    runner, run = make_runner("memory", {"workers": 3, "max_batches": 1})
    assert isinstance(runner, InMemoryRunner) and runner.workers == 3
    assert run.max_batches == 1
    with pytest.raises(UserInputError, match=r"memory runner refused its options.*1 or more"):
        make_runner("memory", {"workers": 0})
    with pytest.raises(PluginError, match=r"'flink'.*installed: .*memory"):
        make_runner("flink", {})


def test_runner_object_is_used_as_given() -> None:
    runner = CountingRunner()
    out = cf.Collect()
    summary = run_pipeline(build(out), runner, "memory://", batch_interval=0)
    assert summary.reason == "end reached"
    assert runner.batches == summary.batches > 0
    assert len(out.items) == 10
    # a built runner takes no runner options: only RunOptions fields are valid
    with pytest.raises(UserInputError, match="unknown option 'workers' for the counting runner"):
        run_pipeline(build(), CountingRunner(), "memory://", workers=2)


def test_listener_and_hooks_are_checked_before_anything_runs(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    for kwargs, fragment in (({"listener": 5}, "listener=5 is not an EngineListener"),
                             ({"on_engine": 5}, "on_engine=5 is not a function"),
                             ({"on_metrics": "x"}, "on_metrics='x' is not a function")):
        with pytest.raises(UserInputError, match=fragment):
            run_pipeline(build(), "memory", url, **kwargs)  # type: ignore[arg-type]
    assert not (tmp_path / "state.db").exists()  # refused before the store was opened


def test_something_else_as_runner_is_refused() -> None:
    with pytest.raises(UserInputError, match="is not a runner: pass 'memory', 'spark'"):
        run_pipeline(build(), object(), "memory://")  # type: ignore[arg-type]


# -- the store -----------------------------------------------------------------------------


def test_a_store_object_stays_open(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "state.db")
    try:
        summary = cf.Pipeline.run(build(name="own"), metadata=store, batch_interval=0)
        assert summary.reason == "end reached"
        assert store.partitions("own")  # still open: its owner closes it
        again = run_pipeline(build(name="own"), "memory", store)
        assert (again.batches, again.reason) == (0, "end reached")  # resumed at the end
    finally:
        store.close()


def test_a_store_opened_from_a_url_is_closed(tmp_path: Path) -> None:
    engines: list[Engine] = []
    url = f"sqlite:///{tmp_path / 'state.db'}"
    summary = build(name="url").run(metadata=url, on_engine=engines.append, batch_interval="0s")
    assert summary.reason == "end reached"
    (engine,) = engines
    with pytest.raises(StoreError, match="is closed"):
        engine.store.partitions("url")
    store = open_store(url)  # the progress is in the file
    try:
        assert store.partitions("url")
    finally:
        store.close()


def test_a_store_opened_from_a_url_is_closed_when_the_run_fails(tmp_path: Path) -> None:
    engines: list[Engine] = []

    def fail(engine: Engine) -> None:
        engines.append(engine)
        raise RuntimeError("before the run")

    with pytest.raises(RuntimeError, match="before the run"):
        run_pipeline(build(), "memory", f"sqlite:///{tmp_path / 's.db'}", on_engine=fail)
    with pytest.raises(StoreError, match="is closed"):
        engines[0].store.partitions("launch")


def test_bad_input_fails_before_any_store_is_opened(tmp_path: Path) -> None:
    db = tmp_path / "never.db"
    with pytest.raises(UserInputError, match="unknown option"):
        run_pipeline(build(), "memory", f"sqlite:///{db}", speed=11)
    with pytest.raises(StoreURLError, match="not a metadata store URL"):
        run_pipeline(build(), "memory", "state.db")
    with pytest.raises(UserInputError, match="is not a metadata store"):
        run_pipeline(build(), "memory", 42)  # type: ignore[arg-type]
    assert not db.exists()


def test_default_store_is_under_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    summary = build(name="default").run(batch_interval=0)
    assert summary.reason == "end reached"
    state = tmp_path / ".cdcflow" / "state.db"
    assert state.is_file()
    store = open_store(f"sqlite:///{state}")
    try:
        assert store.partitions("default")
    finally:
        store.close()


def test_default_store_url_names_a_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = default_store_url(tmp_path / "a" / "b")
    assert url == f"sqlite:///{tmp_path / 'a' / 'b' / '.cdcflow' / 'state.db'}"
    assert not (tmp_path / "a").exists()  # the store makes its folder when it opens
    (tmp_path / "a").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    assert default_store_url() == f"sqlite:///{tmp_path / 'a' / '.cdcflow' / 'state.db'}"


# -- the engine ----------------------------------------------------------------------------


def test_on_engine_gets_the_engine_before_it_runs() -> None:
    out = cf.Collect()
    summary = run_pipeline(build(out), "memory", "memory://", on_engine=Engine.request_stop)
    assert (summary.reason, summary.batches) == ("interrupted", 0)
    assert out.items == []


def test_an_invalid_pipeline_fails_before_the_runner_is_built() -> None:
    with pytest.raises(UserInputError, match="is empty"):
        run_pipeline(cf.Pipeline("empty"), "no-such-runner", "memory://")
