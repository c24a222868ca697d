"""One way in to a run, for ``pipeline.run()`` and ``cdcflow run``: resolve the runner and
the store, build the engine, run it, close the store it opened.

Keyword options are split between :class:`~cdcflow.engine.loop.RunOptions` fields and the
runner's constructor; anything else is a :class:`~cdcflow.errors.UserInputError` that lists
the valid keys.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import attrs

from cdcflow.dag import Dag
from cdcflow.durations import parse_duration
from cdcflow.engine.listener import EngineListener, RunSummary
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.runner import Runner
from cdcflow.errors import UserInputError
from cdcflow.metadata import open_store
from cdcflow.metadata.base import MetadataStore
from cdcflow.plugins import load_plugin

__all__ = ["default_store_url", "make_runner", "run_pipeline", "split_options"]

_DURATIONS = ("batch_interval", "max_batch_span", "duration", "gc_ttl", "retry_backoff")


def default_store_url(directory: str | Path = ".") -> str:
    """``sqlite:///<directory>/.cdcflow/state.db`` (the folder is created)."""
    state = Path(directory).resolve() / ".cdcflow"
    state.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{state / 'state.db'}"


def runner_params(runner_cls: Any) -> set[str]:
    """Keyword arguments a runner class takes."""
    try:
        params = inspect.signature(runner_cls).parameters
    except (TypeError, ValueError):
        return set()
    return {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def split_options(
    options: dict[str, Any], runner_cls: Any, runner_name: str
) -> tuple[RunOptions, dict[str, Any]]:
    """(RunOptions, runner keyword arguments) from one mapping; durations may be text."""
    fields = {f.name for f in attrs.fields(RunOptions)}
    accepted = runner_params(runner_cls) if runner_cls is not None else set()
    run: dict[str, Any] = {}
    runner: dict[str, Any] = {}
    for key, value in options.items():
        if key in fields:
            if key in _DURATIONS and isinstance(value, str):
                try:
                    value = parse_duration(value)
                except ValueError as e:
                    raise UserInputError(f"{key}={value!r}: {e}") from None
            run[key] = value
        elif key in accepted:
            runner[key] = value
        else:
            valid = sorted((fields | accepted) - {"base_dir"})
            msg = f"unknown option {key!r} for the {runner_name} runner; valid: {', '.join(valid)}"
            raise UserInputError(msg)
    try:
        return RunOptions(**run), runner
    except (TypeError, ValueError) as e:
        raise UserInputError(f"bad run option: {e}") from None


def make_runner(runner: str | Runner, options: dict[str, Any]) -> tuple[Runner, RunOptions]:
    """The runner named (or given) and the run options, from one mapping of options."""
    if isinstance(runner, str):
        cls = load_plugin("cdcflow.runners", runner)
        run_options, kwargs = split_options(options, cls, runner)
        built: Runner = cls(**kwargs)
        return built, run_options
    if not isinstance(runner, Runner):
        msg = (
            f"runner={runner!r} is not a runner: pass 'memory', 'spark', an installed runner "
            "plugin's name, or an object with open/run_tasks/close"
        )
        raise UserInputError(msg)
    run_options, _ = split_options(options, None, runner.name)
    return runner, run_options


def run_pipeline(
    dag: Dag,
    runner: str | Runner = "memory",
    metadata: str | MetadataStore | None = None,
    *,
    listener: EngineListener | None = None,
    **options: Any,
) -> RunSummary:
    """Run ``dag`` (see :meth:`cdcflow.pipeline.Pipeline.run`)."""
    dag.validate()
    built, run_options = make_runner(runner, options)
    if isinstance(metadata, str) or metadata is None:
        store = open_store(metadata or default_store_url())
        owned = True
    else:
        store, owned = metadata, False
    try:
        return Engine(dag, store, built, run_options, listener).run()
    finally:
        if owned:
            store.close()
