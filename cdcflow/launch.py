"""One way in to a run, for ``pipeline.run()`` and ``cdcflow run``: resolve the runner and
the store, build the engine, run it, close the store it opened.

Both callers end in :func:`run_pipeline`, so they cannot drift. The CLI turns its flags and
``--set KEY=VALUE`` text into typed values first (with :func:`option_specs` telling it the
keys and their kinds); ``pipeline.run()`` passes what the user wrote.

Keyword options are split between :class:`~cdcflow.engine.loop.RunOptions` fields, the
runner's constructor and the run's observers (:data:`OBSERVER_OPTIONS`: ``metrics_port``,
``metrics_host``, ``stuck_after``); anything else is a :class:`~cdcflow.errors.UserInputError`
that lists the valid keys. Durations may be numbers of seconds, text such as ``"30s"``, or
timedeltas.

Every run watches for stuck partitions (:mod:`cdcflow.stuck`); with ``metrics_port`` it
also serves Prometheus metrics (:mod:`cdcflow.metrics`). Both stop when the run ends, how
ever it ends.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import attrs

from cdcflow.dag import Dag
from cdcflow.durations import parse_duration, parse_size
from cdcflow.engine.listener import BatchStats, EngineListener, RunSummary
from cdcflow.engine.loop import Engine, RunOptions
from cdcflow.engine.ownership import held_by_a_live_run
from cdcflow.engine.runner import Runner
from cdcflow.errors import (
    CdcflowError,
    LeaseHeldError,
    PipelineDefinitionError,
    PluginError,
    UserInputError,
    log_failure,
)
from cdcflow.metadata import open_store
from cdcflow.metadata.base import MetadataStore
from cdcflow.metrics import MetricsServer, PipelineMetrics
from cdcflow.model import BatchPlan, PartitionMetadata
from cdcflow.plugins import load_plugin
from cdcflow.stuck import StuckDetector, StuckWatch

__all__ = [
    "LATENCY_PRESETS",
    "OBSERVER_OPTIONS",
    "Listeners",
    "OptionKind",
    "OptionSpec",
    "RunnerFactory",
    "coerce_option",
    "default_store_url",
    "make_runner",
    "option_specs",
    "run_pipeline",
    "runner_factory",
    "split_options",
]

#: What builds a runner from keyword options: a runner class registered under
#: ``cdcflow.runners`` (or any callable returning a Runner).
RunnerFactory = Callable[..., Runner]

#: The kind of value an option takes. ``duration``: seconds as a number, or text such as
#: ``"30s"`` (every float option is one); ``size``: bytes as a number, or text such as
#: ``"64MiB"``; ``any``: passed through unchecked (e.g. the Spark runner's ``conf`` mapping).
OptionKind = Literal["duration", "size", "int", "bool", "text", "any"]

# Options that exist but are not worth listing in "valid keys": the CLI sets base_dir itself.
_UNLISTED = frozenset({"base_dir"})

_log = logging.getLogger("cdcflow.launch")


@attrs.frozen
class OptionSpec:
    """One keyword option of a run: its name, kind, whether None is accepted, and whether
    it is a RunOptions field (``"run"``), a runner constructor argument (``"runner"``) or
    an option of the run's observers (``"observer"``, see :data:`OBSERVER_OPTIONS`)."""

    name: str
    kind: OptionKind
    optional: bool
    target: Literal["run", "runner", "observer"]

    def describe(self) -> str:
        """What the option takes, for error messages: ``"a duration such as 30s"``."""
        want = {
            "duration": "a duration such as 30s", "size": "a size such as 64MiB",
            "int": "a whole number", "bool": "true or false", "text": "text", "any": "a value",
        }[self.kind]
        return f"{want} or none" if self.optional and self.kind != "any" else want


#: Options of the run's observers, taken by :func:`run_pipeline` (not RunOptions fields):
#: ``metrics_port`` serves Prometheus metrics on that port while the run lasts (0: a free
#: port; None: no metrics), on ``metrics_host`` (default ``127.0.0.1``; ``0.0.0.0`` for
#: every address); ``stuck_after`` is how long a partition may go without progress before
#: it is reported stuck (None: 10 heartbeats, at least 30 s).
OBSERVER_OPTIONS: dict[str, OptionSpec] = {
    "metrics_port": OptionSpec("metrics_port", "int", True, "observer"),
    "metrics_host": OptionSpec("metrics_host", "text", False, "observer"),
    "stuck_after": OptionSpec("stuck_after", "duration", True, "observer"),
}
_DEFAULT_METRICS_HOST = "127.0.0.1"

#: Named option sets for ``cdcflow run --latency``; explicit options win over them.
LATENCY_PRESETS: dict[str, dict[str, float]] = {
    "low": {"batch_interval": 0.2, "idle_read_interval": 0.4},
    "normal": {},
}


def default_store_url(directory: str | Path = ".") -> str:
    """``sqlite:///<directory>/.cdcflow/state.db`` (the store makes the ``.cdcflow`` folder
    when it opens, or says in one line that it cannot).

    Two defaults use it: ``pipeline.run()`` keeps state under the current directory
    (``default_store_url()``), ``cdcflow run FILE`` next to the pipeline file
    (``default_store_url(<dir of FILE>)``), so a file's state does not depend on where the
    command was typed.
    """
    state = Path(directory).resolve() / ".cdcflow"
    return f"sqlite:///{state / 'state.db'}"


def runner_factory(name: str) -> RunnerFactory:
    """The runner class registered as ``name`` (PluginError listing the installed ones)."""
    factory: RunnerFactory = load_plugin("cdcflow.runners", name)
    return factory


# -- options -----------------------------------------------------------------------------


def _classify(hint: Any, default: Any) -> tuple[OptionKind, bool]:
    """(kind, optional) of a type hint; falls back to the default's type without one."""
    if hint is None:
        if default is None or default is inspect.Parameter.empty:
            return "any", default is None
        hint = type(default)
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    members = set(typing.get_args(hint)) if union else {hint}
    optional = type(None) in members
    members.discard(type(None))
    kind: OptionKind = "any"
    if members == {bool}:
        kind = "bool"
    elif members == {int}:
        kind = "int"
    elif members and members <= {int, float}:
        # Durations are seconds: the float options of RunOptions and of the runners (a
        # runner's stop_grace) are all durations, given as "10s" or 10.
        kind = "duration"
    elif members == {str}:
        kind = "text"
    return kind, optional


def _hints(obj: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj)
    except Exception:  # a plugin's annotation that does not resolve: use defaults instead
        return {}


def option_specs(factory: RunnerFactory | None) -> dict[str, OptionSpec]:
    """Every option a run takes with runners built by ``factory``: the RunOptions fields,
    then the keyword parameters of ``factory`` (none when ``factory`` is None, i.e. for a
    runner object that is already built). A runner parameter that shares a RunOptions
    field's name is not reachable and is left out."""
    specs: dict[str, OptionSpec] = {}
    hints = _hints(RunOptions)
    for field in attrs.fields(RunOptions):
        kind, optional = _classify(hints.get(field.name), field.default)
        kind = field.metadata.get("kind", kind)
        specs[field.name] = OptionSpec(field.name, kind, optional, "run")
    if factory is None:
        return specs
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return specs
    # A class's hints live on its __init__ (get_type_hints of a class gives its attributes).
    hints = _hints(getattr(factory, "__init__", None) if isinstance(factory, type) else factory)
    for name, p in params.items():
        if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) or name in specs:
            continue
        kind, optional = _classify(hints.get(name), p.default)
        specs[name] = OptionSpec(name, kind, optional, "runner")
    return specs


def coerce_option(spec: OptionSpec, value: Any) -> Any:
    """``value`` checked against ``spec``; a duration given as text (``"30s"``) or a
    ``timedelta`` becomes seconds.

    Raises UserInputError naming what the option takes.
    """
    if value is None and spec.optional:
        return None
    kind = spec.kind
    ok = kind == "any"
    if kind == "duration" and isinstance(value, timedelta):
        return value.total_seconds()
    if kind == "size" and isinstance(value, str | int) and not isinstance(value, bool):
        try:
            return parse_size(value, f"{spec.name}=...")
        except PipelineDefinitionError as e:
            raise UserInputError(str(e)) from None
    if kind == "duration" and isinstance(value, str):
        try:
            return parse_duration(value)
        except ValueError as e:
            msg = f"{spec.name}={value!r}: {e}"
            raise UserInputError(msg) from None
    if kind == "duration":
        ok = (isinstance(value, int | float) and not isinstance(value, bool)
              and math.isfinite(value))
        value = float(value) if ok else value
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "text":
        value = os.fspath(value) if isinstance(value, os.PathLike) else value  # base_dir=Path
        ok = isinstance(value, str)
    if not ok:
        msg = f"{spec.name}={value!r}: {spec.name} takes {spec.describe()}"
        raise UserInputError(msg)
    return value


def split_options(
    options: Mapping[str, Any], factory: RunnerFactory | None, runner_name: str
) -> tuple[RunOptions, dict[str, Any]]:
    """(RunOptions, runner keyword arguments) from one mapping of options.

    Values are checked with :func:`coerce_option` (durations may be text). An unknown key
    raises UserInputError listing the valid keys for ``runner_name``.
    """
    specs = option_specs(factory)
    run: dict[str, Any] = {}
    runner: dict[str, Any] = {}
    for key, value in options.items():
        spec = specs.get(key)
        if spec is None:
            valid = sorted((set(specs) | set(OBSERVER_OPTIONS)) - _UNLISTED)
            msg = f"unknown option {key!r} for the {runner_name} runner; valid: {', '.join(valid)}"
            raise UserInputError(msg)
        (run if spec.target == "run" else runner)[key] = coerce_option(spec, value)
    try:
        return RunOptions(**run), runner
    except (TypeError, ValueError) as e:
        msg = f"bad run option: {e}"
        raise UserInputError(msg) from None


def make_runner(
    runner: str | Runner, options: Mapping[str, Any]
) -> tuple[Runner, RunOptions]:
    """The runner named (built with its share of ``options``) or given, and the run options.

    A runner object is used as it is, so ``options`` may then hold only RunOptions fields.
    """
    if isinstance(runner, str):
        factory = runner_factory(runner)
        run_options, kwargs = split_options(options, factory, runner)
        if not callable(factory):
            msg = (f"the runner plugin {runner!r} is {factory!r}, not a Runner class or "
                   "factory: fix its cdcflow.runners entry point")
            raise PluginError(msg)
        try:
            built = factory(**kwargs)
        except ValueError as e:  # a runner checks its arguments' values (workers=0)
            msg = f"the {runner} runner refused its options: {e}"
            raise UserInputError(msg) from None
        except CdcflowError:
            raise
        except Exception as e:  # a plugin's own failure to start
            msg = f"the {runner} runner could not be made: {type(e).__name__}: {e}"
            raise PluginError(msg) from e
        if not isinstance(built, Runner):
            msg = (f"the {runner} runner plugin made {type(built).__name__}, not a Runner "
                   "(an object with name/open/run_tasks/close); fix the plugin")
            raise PluginError(msg)
        return built, run_options
    if not isinstance(runner, Runner):
        msg = (
            f"runner={runner!r} is not a runner: pass 'memory', 'spark', an installed runner "
            "plugin's name, or an object with name/open/run_tasks/close"
        )
        raise UserInputError(msg)
    run_options, _ = split_options(options, None, runner.name)
    return runner, run_options


# -- the run -----------------------------------------------------------------------------


@attrs.frozen
class _ObserverOptions:
    metrics_port: int | None = None
    metrics_host: str = _DEFAULT_METRICS_HOST
    stuck_after: float | None = None


def _observer_options(options: dict[str, Any]) -> _ObserverOptions:
    """Take the observers' options out of ``options`` (checked, durations in seconds)."""
    taken = {
        key: coerce_option(spec, options.pop(key))
        for key, spec in OBSERVER_OPTIONS.items() if key in options
    }
    port = taken.get("metrics_port")
    if port is not None and not 0 <= port <= 65535:
        msg = f"metrics_port={port}: give a port from 1 to 65535, or 0 for a free one"
        raise UserInputError(msg)
    after = taken.get("stuck_after")
    if after is not None and after <= 0:
        msg = f"stuck_after={after}: give a duration above 0, such as 5m"
        raise UserInputError(msg)
    return _ObserverOptions(**taken)


class Listeners(EngineListener):
    """Tells every listener in turn. The user's listener comes first and its errors end the
    run, as they would without this; an error in one of cdcflow's own observers is logged
    once and that observer is dropped, so watching a run can never stop it."""

    def __init__(self, user: EngineListener | None, observers: list[EngineListener]) -> None:
        self._user = user
        self._observers = list(observers)

    def _each(self, method: str, *args: Any) -> None:
        if self._user is not None and hasattr(self._user, method):  # (an older listener)
            getattr(self._user, method)(*args)
        for observer in list(self._observers):
            try:
                getattr(observer, method)(*args)
            except Exception as exc:
                log_failure(_log, "%s failed in %s; it observes no more of this run",
                            type(observer).__name__, method, exc=exc)
                self._observers.remove(observer)

    def on_start(self, pipeline: str, runner: str, store_url: str) -> None:
        self._each("on_start", pipeline, runner, store_url)

    def on_planned(self, plan: BatchPlan, replay: bool) -> None:
        self._each("on_planned", plan, replay)

    def on_sinks_committed(self, batch_id: int) -> None:
        self._each("on_sinks_committed", batch_id)

    def on_partitions(self, partitions: Sequence[PartitionMetadata], now_ns: int) -> None:
        self._each("on_partitions", partitions, now_ns)

    def on_batch(self, stats: BatchStats) -> None:
        self._each("on_batch", stats)

    def on_batch_retry(self, batch_id: int, error: BaseException) -> None:
        self._each("on_batch_retry", batch_id, error)

    def on_batches_done(self, summary: RunSummary) -> None:
        self._each("on_batches_done", summary)

    def on_stop(self, summary: RunSummary) -> None:
        self._each("on_stop", summary)


def _check_callbacks(listener: Any, on_engine: Any, on_metrics: Any) -> None:
    """``listener`` an EngineListener (or an object with some of its ``on_*`` methods: a
    listener written against an older version), the hooks callables; else a
    UserInputError naming the argument."""
    methods = [m for m in dir(EngineListener) if m.startswith("on_")]
    if listener is not None and not (isinstance(listener, EngineListener)
                                     or any(callable(getattr(listener, m, None))
                                            for m in methods)):
        msg = (f"listener={listener!r} is not an EngineListener: subclass "
               "cdcflow.EngineListener and override its on_* methods")
        raise UserInputError(msg)
    for name, hook in (("on_engine", on_engine), ("on_metrics", on_metrics)):
        if hook is not None and not callable(hook):
            msg = f"{name}={hook!r} is not a function: pass a callable, or leave it out"
            raise UserInputError(msg)


def run_pipeline(
    dag: Dag,
    runner: str | Runner = "memory",
    metadata: str | MetadataStore | None = None,
    *,
    listener: EngineListener | None = None,
    on_engine: Callable[[Engine], None] | None = None,
    on_metrics: Callable[[str], None] | None = None,
    **options: Any,
) -> RunSummary:
    """Run ``dag`` until its end, a limit, or a stop request; return the summary.

    Steps: validate the DAG; build the runner (``runner`` is a name, built with its share
    of ``options``, or a Runner object used as it is); with ``metrics_port``, start serving
    metrics and tell ``on_metrics`` their URL (else it is logged); open the store
    (``metadata`` is a URL, opened here and closed when the run ends, or a store object,
    which stays open: its owner closes it; None means :func:`default_store_url` under the
    current directory); build the :class:`~cdcflow.engine.loop.Engine`, hand it to
    ``on_engine`` (for example to call ``request_stop`` from a signal handler or another
    thread), and run it, watching for stuck partitions (``stuck_after``).

    The metrics server and the stuck-partition watch stop when the run ends, also when it
    fails: no thread is left behind. ``listener`` observes the run besides them.

    Every mistake in what was given raises :class:`~cdcflow.errors.UserInputError` naming
    the fix, before anything runs.
    """
    dag.validate()
    _check_callbacks(listener, on_engine, on_metrics)
    options = dict(options)
    observe = _observer_options(options)
    built, run_options = make_runner(runner, options)
    if not (metadata is None or isinstance(metadata, str | MetadataStore)):
        msg = (
            f"metadata={metadata!r} is not a metadata store: pass a URL such as "
            "sqlite:///state.db or memory://, or a store object"
        )
        raise UserInputError(msg)
    detector = StuckDetector(
        observe.stuck_after, pipeline=dag.name, batch_interval=run_options.batch_interval,
        idle_read_interval=run_options.idle_read_interval,
    )
    watch = StuckWatch(detector)
    observers: list[EngineListener] = [watch]
    stack = contextlib.ExitStack()
    try:
        if isinstance(metadata, MetadataStore):
            store = metadata
        else:
            store = open_store(default_store_url() if metadata is None else metadata)
            stack.callback(store.close)
        if observe.metrics_port is not None:
            metrics = PipelineMetrics(dag.name, detector=detector)
            try:
                server = stack.enter_context(
                    MetricsServer(metrics.registry, observe.metrics_port, observe.metrics_host)
                )
            except UserInputError:
                # the same run started twice has its port too: name the run that holds it
                held = held_by_a_live_run(store, dag.name)
                if held is not None:
                    raise LeaseHeldError(held) from None
                raise
            observers.append(metrics)
            if on_metrics is not None:
                on_metrics(server.url)
            else:
                _log.info("metrics of %s at %s", dag.name, server.url)
        stack.enter_context(watch)
        engine = Engine(dag, store, built, run_options, Listeners(listener, observers))
        if on_engine is not None:
            on_engine(engine)
        return engine.run()
    finally:
        stack.close()  # the metrics server, the watch's thread, a store opened here
