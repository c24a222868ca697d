"""The ``cdcflow`` command: run, graph, status, plugins, metadata init, emulator start.

Exit codes: 0 success (a run that reached ``end_at``, ``--for`` or ``--max-batches``);
1 the pipeline stopped on an error (its error policy said stop) or another runtime
failure; 2 bad input (a pipeline file, option, URL or name), printed as one line
``cdcflow: error: <cause and fix>`` without a traceback; 130 interrupted.
``--debug`` (or ``CDCFLOW_DEBUG=1``) shows tracebacks and debug logs, and
``--log-format json`` writes one JSON object per log line; both go anywhere on the
command line (before or after the command).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import NoReturn

from cdcflow import __version__
from cdcflow.cli._ending import (
    BUS_ERROR,
    command_logging,
    end_process,
    exit_on_bus_error,
    fail,
    say,
    stdout_gone,
    term_as_interrupt,
)
from cdcflow.cli._options import duration, key_value, port, positive_int, run_options
from cdcflow.engine.listener import EngineListener, RunSummary
from cdcflow.engine.loop import Engine
from cdcflow.engine.signals import STOP_SIGNALS, defer, deferring, settle_deferred
from cdcflow.errors import (
    CdcflowError,
    StoreURLError,
    UsageError,
    UserInputError,
)
from cdcflow.launch import (
    LATENCY_PRESETS,
    Listeners,
    default_store_url,
    option_specs,
    run_pipeline,
    runner_factory,
)
from cdcflow.processes import choose_arrow_pool, tune_malloc
from cdcflow.progress import LOG_FORMATS, LiveProgress

__all__ = [
    "BUS_ERROR", "EXIT_ERROR", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "build_parser",
    "main", "read_ddl",
]

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

log = logging.getLogger("cdcflow.cli")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``cdcflow: error:`` line like every other."""

    def error(self, message: str) -> NoReturn:
        if message.endswith("expected one argument"):
            # "--for -5s": argparse takes a value that starts with "-" for an option
            message += " (a value that starts with '-' is written --option=VALUE)"
        msg = f"{message}; see `{self.prog} --help`"
        raise UsageError(msg)


def _common(default: bool) -> _Parser:
    """Options every command takes, before or after its name. Only the top level sets
    defaults, so a subcommand's parser does not overwrite what was given before it."""
    common = _Parser(add_help=False)
    if default:
        common.add_argument("--debug", action="store_true",
                            help="show tracebacks and debug logs (also CDCFLOW_DEBUG=1)")
        common.add_argument("--log-format", choices=LOG_FORMATS, default="plain",
                            help="log lines as plain text dated in UTC (default), or one "
                            "JSON object per line")
    else:
        common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                            help="show tracebacks and debug logs")
        common.add_argument("--log-format", choices=LOG_FORMATS, default=argparse.SUPPRESS,
                            help="plain (default) or json log lines")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="cdcflow",
        description="Read Google Cloud Spanner change streams with a Python dataflow DSL.",
        parents=[_common(True)],
    )
    parser.add_argument("--version", action="version", version=f"cdcflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    common = [_common(False)]

    run = sub.add_parser("run", parents=common, help="run a pipeline file", description=(
        "Run the pipeline defined in FILE (FILE:NAME picks one of several). Progress is "
        "stored in the metadata store, so a second run resumes where the first stopped."))
    run.add_argument("file", metavar="FILE", help="pipeline file, or FILE:NAME")
    run.add_argument("--runner", default="memory", metavar="NAME",
                     help="runner plugin: memory (default), spark, ... (see `cdcflow plugins`)")
    run.add_argument("--metadata", metavar="URL", help=(
        "metadata store: sqlite:///PATH, memory://, spanner://projects/P/instances/I/"
        "databases/D (default: sqlite in .cdcflow/state.db next to FILE)"))
    run.add_argument("--for", dest="duration", type=duration, metavar="DURATION",
                     help="stop after this long (e.g. 30s, 5m), after the batch in progress")
    run.add_argument("--max-batches", type=positive_int, metavar="N",
                     help="stop after N committed batches")
    run.add_argument("--batch-interval", type=duration, metavar="DURATION",
                     help="time between batch ends (e.g. 1s)")
    run.add_argument("--latency", choices=sorted(LATENCY_PRESETS), help=(
        "a preset: low = 200ms batches and idle partitions read at least every 400ms "
        "(lower commit-to-sink latency, more work per second); flags and --set win"))
    run.add_argument("--reset", action="store_true",
                     help="forget stored progress of this pipeline and start over")
    run.add_argument("--takeover", action="store_true",
                     help="take the pipeline over from a run whose lease is still alive "
                     "(only after confirming that run is gone)")
    run.add_argument("--strict", action="store_true",
                     help="refuse to resume stored progress made with another source "
                     "(database, stream, start_at, end_at) instead of warning; an "
                     "earlier end_at is applied")
    run.add_argument("--set", dest="settings", action="append", type=key_value, default=[],
                     metavar="KEY=VALUE", help="an engine or runner option, e.g. "
                     "max_batch_span=30s, gc_ttl=1h, workers=4 (repeatable)")
    run.add_argument("--master", metavar="M",
                     help="Spark master URL for --runner spark (default local[*])")
    run.add_argument("--conf", action="append", type=key_value, default=[], metavar="K=V",
                     help="Spark configuration for --runner spark (repeatable)")
    run.add_argument("--metrics-port", type=port, metavar="N", help=(
        "serve Prometheus metrics at http://HOST:N/metrics while the run lasts (0: a free "
        "port; the URL is printed)"))
    run.add_argument("--metrics-host", metavar="HOST", help=(
        "address the metrics server listens on (default 127.0.0.1; 0.0.0.0 for a "
        "Prometheus on another machine)"))
    run.add_argument("--stuck-after", type=duration, metavar="DURATION", help=(
        "report a partition whose watermark has not advanced for this long (default: 10 "
        "heartbeats, at least 30s)"))
    run.set_defaults(func=_cmd_run)

    graph = sub.add_parser("graph", parents=common, help="print a pipeline's DAG",
                           description="Print the DAG of the pipeline in FILE.")
    graph.add_argument("file", metavar="FILE", help="pipeline file, or FILE:NAME")
    graph.add_argument("--format", choices=("text", "dot"), default="text",
                       help="text (default) or Graphviz dot (render with `dot -Tsvg`)")
    graph.set_defaults(func=_cmd_graph)

    status = sub.add_parser("status", parents=common, help="show stored progress",
                            description=(
        "Show the partitions by state, watermarks, lag and recent batches of the pipelines "
        "in a metadata store."))
    status.add_argument("file", nargs="?", metavar="FILE",
                        help="a pipeline file, to use its default store (instead of --metadata)")
    status.add_argument("--metadata", metavar="URL", help="metadata store URL")
    status.add_argument("--pipeline", metavar="NAME", help="only this pipeline")
    status.add_argument("--batches", type=positive_int, default=5, metavar="N",
                        help="how many recent batches to show (default 5)")
    shown = status.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true",
                       help="one JSON document (for scripts) instead of text")
    shown.add_argument("--watch", nargs="?", type=duration, const=2.0, metavar="SECONDS",
                       help="redraw the status every SECONDS (default 2) until Ctrl-C")
    shown.add_argument("--lineage", choices=("dot", "svg"), help=(
        "the partitions' split/merge tree as Graphviz DOT, or as SVG (needs the dot "
        "program)"))
    status.add_argument("--watch-count", type=positive_int, metavar="N",
                        help="with --watch: stop after N refreshes")
    status.add_argument("--stuck-after", type=duration, metavar="DURATION", help=(
        "mark partitions a planned batch has held this long as stuck (default: as a run's "
        "default; give what the run was given)"))
    status.set_defaults(func=_cmd_status)

    plugins = sub.add_parser("plugins", parents=common,
                             help="list installed runners, stores, transforms, sinks")
    plugins.set_defaults(func=_cmd_plugins)

    metadata = sub.add_parser("metadata", parents=common, help="manage metadata stores")
    msub = metadata.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    msub.required = True
    init = msub.add_parser("init", parents=common,
                           help="create a store's tables (e.g. in Spanner)",
                           description="Create the tables and indexes of a metadata store.")
    init.add_argument("url", metavar="URL", help="metadata store URL")
    init.set_defaults(func=_cmd_metadata_init)

    emulator = sub.add_parser("emulator", parents=common, help="the local Cloud Spanner emulator")
    esub = emulator.add_subparsers(dest="action", metavar="ACTION", parser_class=_Parser)
    esub.required = True
    start = esub.add_parser("start", parents=common,
                            help="start the emulator in the foreground", description=(
        "Start the Cloud Spanner emulator on a loopback port and keep it running until "
        "Ctrl-C. It keeps no data across restarts."))
    start.add_argument("--port", type=positive_int, metavar="N",
                       help="port (default: a free one)")
    start.add_argument("--partition-alive-seconds", type=positive_int, metavar="N",
                       help="split and merge change-stream partitions every N..2N seconds")
    start.add_argument("--database", metavar="NAME", help="create this database")
    start.add_argument("--ddl-file", metavar="FILE", type=Path,
                       help="DDL for --database: statements separated by ';'")
    start.add_argument("--instance", default="test-instance", metavar="NAME",
                       help="instance of --database (default test-instance)")
    start.set_defaults(func=_cmd_emulator_start)
    return parser


# -- run -----------------------------------------------------------------------------------


class _GracefulInterrupt:
    """First Ctrl-C: stop after the current batch. Second Ctrl-C: abort at once.

    Installed before the run starts; until the engine is attached (runner being built,
    store being opened) a Ctrl-C aborts at once, as it would without this handler.
    """

    def __init__(self, progress: EngineListener) -> None:
        self._progress = progress
        self._engine: Engine | None = None
        self._ending = False

    def attach(self, engine: Engine) -> None:
        self._engine = engine

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """First Ctrl-C: stop after the current batch; the second aborts, as does a Ctrl-C
        after a SIGTERM (the engine counts both). (The engine's final flush replaces it:
        there no batch is left to stop after.)"""
        engine = self._engine
        if engine is None or engine.signalled():
            raise KeyboardInterrupt
        defer(functools.partial(self._stop, engine))  # a handler takes no lock

    def _stop(self, engine: Engine) -> None:
        if isinstance(self._progress, LiveProgress):
            self._progress.clear()
        sys.stderr.write("cdcflow: stopping after the current batch (Ctrl-C again to abort)\n")
        sys.stderr.flush()
        engine.request_stop()

    _handle.cdcflow_stop_handler = True  # type: ignore[attr-defined]

    def ending(self, code: int) -> None:
        """The run's outcome is decided (its summary is printed next): from now on a SIGINT
        or SIGTERM ends the process at once with ``code`` (what is left is closing: the
        store, the metrics server), rather than turning a complete run into an
        interrupted one (see also :func:`end_process`)."""

        def now(signum: int, frame: FrameType | None) -> None:
            os._exit(code)

        with contextlib.suppress(ValueError):  # not the main thread: signals are not ours
            for sig in STOP_SIGNALS:
                signal.signal(sig, now)
            self._ending = True

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        with deferring():
            try:
                previous = signal.signal(signal.SIGINT, self._handle)
            except ValueError:  # not the main thread: no signal handling there
                yield
                return
            try:
                yield
            finally:
                if not self._ending:
                    signal.signal(signal.SIGINT, previous)


class _EndsOnSignal(Listeners):
    """``progress``, and ``interrupt`` told that the run's outcome is decided just before
    its summary is printed (see :meth:`_GracefulInterrupt.ending`)."""

    def __init__(self, progress: EngineListener, interrupt: _GracefulInterrupt) -> None:
        super().__init__(progress, [])
        self._interrupt = interrupt

    def on_stop(self, summary: RunSummary) -> None:
        self._interrupt.ending(_run_code(summary))
        super().on_stop(summary)


def _run_code(summary: RunSummary) -> int:
    return EXIT_INTERRUPTED if summary.reason == "interrupted" else EXIT_OK


def _cmd_run(args: argparse.Namespace) -> int:
    from cdcflow.loader import load_pipeline, split_target
    from cdcflow.progress import configure_logging, make_progress

    pipeline = load_pipeline(args.file)
    pipeline.validate()
    path, _ = split_target(args.file)
    base = path.resolve().parent
    # JSON logs are for machines: no status line drawn between them. Configured before
    # the runner's plugin loads, so that what loading it says is a log line like others.
    progress = make_progress(sys.stderr, live=False if args.log_format == "json" else None)
    configure_logging(
        debug=args.debug, progress=progress, format=args.log_format, pipeline=pipeline.name
    )
    factory = runner_factory(args.runner)
    options = run_options(args, option_specs(factory), args.runner, base)
    for flag in ("metrics_port", "metrics_host", "stuck_after"):
        if getattr(args, flag) is not None:
            options[flag] = getattr(args, flag)
    # state next to the file, not the cwd; an empty --metadata ("$UNSET") is no default
    url = default_store_url(base) if args.metadata is None else args.metadata

    def show_metrics(metrics_url: str) -> None:
        if isinstance(progress, LiveProgress):
            sys.stderr.write(f"cdcflow: metrics at {metrics_url}\n")
            sys.stderr.flush()
        else:
            log.info("metrics at %s", metrics_url)

    interrupt = _GracefulInterrupt(progress)
    with interrupt.installed():
        summary = run_pipeline(
            pipeline, args.runner, url, listener=_EndsOnSignal(progress, interrupt),
            on_engine=interrupt.attach, on_metrics=show_metrics, **options,
        )
    return _run_code(summary)


# -- graph, plugins, metadata --------------------------------------------------------------


def _cmd_graph(args: argparse.Namespace) -> int:
    from cdcflow.loader import load_pipeline

    pipeline = load_pipeline(args.file)
    pipeline.validate()
    sys.stdout.write(pipeline.describe(args.format))
    return EXIT_OK


def _cmd_plugins(args: argparse.Namespace) -> int:
    import warnings

    from cdcflow.plugins import GROUPS, list_plugins

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # broken plugins are listed with their error below
        infos = list_plugins(load=True)
    for group in GROUPS:
        rows = [p for p in infos if p.group == group]
        print(group)
        if not rows:
            print("  (none installed)")
        width = max((len(p.name) for p in rows), default=0)
        for p in rows:
            line = f"  {p.name:<{width}}  {p.value}  [{p.distribution}]"
            if p.error:
                line += f"  BROKEN: {p.error}"
            print(line)
    return EXIT_OK


def _check_url(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    if not sep or not scheme:
        msg = (
            f"{url!r} is not a metadata store URL; write sqlite:///PATH, memory:// or "
            "spanner://projects/P/instances/I/databases/D"
        )
        raise StoreURLError(msg)
    return scheme


def _cmd_metadata_init(args: argparse.Namespace) -> int:
    from cdcflow.metadata import open_store
    from cdcflow.plugins import load_plugin

    scheme = _check_url(args.url)
    try:
        store_cls = load_plugin("cdcflow.metadata", scheme)
    except UserInputError as e:
        raise StoreURLError(str(e)) from None
    init = getattr(sys.modules.get(getattr(store_cls, "__module__", "")), "init_store", None)
    said = None
    if callable(init):
        said = init(args.url)
    else:
        open_store(args.url).close()
    print(said if isinstance(said, str) and said else f"initialized {args.url}")
    return EXIT_OK


# -- status --------------------------------------------------------------------------------


def _cmd_status(args: argparse.Namespace) -> int:
    import json

    from cdcflow.loader import split_target
    from cdcflow.metadata import open_store
    from cdcflow.status import (
        render_lineage,
        render_status,
        render_svg,
        status_document,
        watch_status,
    )

    if args.metadata is not None:
        url = args.metadata
    elif args.file:
        path, _ = split_target(args.file)
        if not path.is_file():
            msg = (f"no pipeline file {args.file}: give the pipeline's file (its state is in "
                   ".cdcflow/ beside it) or --metadata URL")
            raise UserInputError(msg)
        url = f"sqlite:///{path.resolve().parent / '.cdcflow' / 'state.db'}"
    else:
        msg = "status needs a store: give --metadata URL (or the pipeline FILE for its default)"
        raise UserInputError(msg)
    if url.split("://", 1)[0].lower() == "memory":
        msg = (f"{url} is a store that lives in the process running the pipeline, which "
               "status cannot see from another; run the pipeline with a sqlite:/// or "
               "spanner:// store to follow it")
        raise UserInputError(msg)
    if args.watch_count is not None and args.watch is None:
        msg = "--watch-count needs --watch (e.g. --watch 1 --watch-count 3)"
        raise UserInputError(msg)
    if args.watch is not None and args.watch <= 0:
        msg = "--watch needs a positive interval, such as 2s"
        raise UserInputError(msg)
    _check_url(url)
    # A status reads: a URL naming no store (a typo, another database) is reported, never
    # created (StoreNotFoundError).
    store = open_store(url, create=False)
    try:
        stuck_after = args.stuck_after
        if args.json:
            doc = status_document(store, args.pipeline, batches=args.batches,
                                  stuck_after=stuck_after)
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        elif args.lineage == "dot":
            sys.stdout.write(render_lineage(store, args.pipeline))
        elif args.lineage == "svg":
            svg = render_svg(render_lineage(store, args.pipeline))
            sys.stdout.buffer.write(svg)
            sys.stdout.flush()
        elif args.watch is not None:
            watch_status(lambda: render_status(store, args.pipeline, batches=args.batches,
                                               stuck_after=stuck_after),
                         args.watch, count=args.watch_count)
        else:
            sys.stdout.write(render_status(store, args.pipeline, batches=args.batches,
                                           stuck_after=stuck_after))
    finally:
        store.close()
    return EXIT_OK


# -- emulator ------------------------------------------------------------------------------


def read_ddl(path: Path) -> list[str]:
    """The statements of a DDL file (``;``-separated, ``--`` comment lines ignored)."""
    try:
        text = path.read_text()
    except OSError as e:
        msg = f"cannot read --ddl-file {path}: {e.strerror}; check the path"
        raise UserInputError(msg) from None
    # Whole-line "--" comments are dropped; statements are separated by ";".
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def _cmd_emulator_start(args: argparse.Namespace) -> int:
    from cdcflow.spanner.emulator import Emulator, EmulatorNotFoundError, check_database_name

    if args.ddl_file is not None and not args.database:
        msg = "--ddl-file needs --database NAME (the database to create with it)"
        raise UserInputError(msg)
    ddl = read_ddl(args.ddl_file) if args.ddl_file is not None else []
    if args.database:
        check_database_name(args.database)  # before starting anything
    try:
        emu = Emulator(port=args.port, partition_alive_seconds=args.partition_alive_seconds)
    except EmulatorNotFoundError as e:
        raise UserInputError(str(e)) from None

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    # Explicit handlers: a shell may start us with SIGINT ignored (a background job), and
    # SIGTERM, or SIGHUP (its terminal closed), must not leave the emulator (its own
    # session) running without us, nor its log behind.
    for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGTERM)):
        signal.signal(sig, interrupt)
    try:
        emu.start()  # a Ctrl-C while it starts stops it too (its log was left)
        # the address once the emulator holds what was asked: a script that reads it never
        # gets one of an emulator that a DDL error then stopped
        if args.database:
            emu.create_database(args.database, ddl, instance=args.instance)
        print(f"export SPANNER_EMULATOR_HOST={emu.host}", flush=True)
        if args.database:
            print(f"# database {emu.database_path(args.database, args.instance)}", flush=True)
        # the log goes when the emulator stops, unless it failed: the error then names it
        say(f"# emulator log: {emu.log_path} (removed when it stops, kept if it fails); "
             "Ctrl-C stops it", args.log_format)
        emu.wait_while_answering()  # until Ctrl-C, or raises if the emulator dies
    except KeyboardInterrupt:
        say("\nstopping the emulator", args.log_format)
        return EXIT_OK
    finally:
        emu.stop()


# -- entry point ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); return the exit code.
    Without ``argv`` (the process's own command line) it ends the process instead."""
    own_process = argv is None  # the process's own command line: it may end the process
    code = _command(list(sys.argv[1:] if argv is None else argv), own_process)
    if own_process:
        end_process(code)
    return code


def _command(argv: list[str], own_process: bool) -> int:
    if own_process:
        term_as_interrupt()
        tune_malloc()
        choose_arrow_pool()
    debug = "--debug" in argv or os.environ.get("CDCFLOW_DEBUG", "") not in ("", "0")
    # Known before parsing, so that a usage error is reported in the format asked for.
    log_format = "json" if any(
        a == "--log-format=json" or (a == "json" and prev == "--log-format")
        for prev, a in zip(["", *argv], argv, strict=False)
    ) else "plain"
    if own_process:
        exit_on_bus_error(log_format)
    try:
        args = build_parser().parse_args(argv)
        args.debug = debug or args.debug
        if own_process:  # what any command logs is a line of the format asked for
            command_logging(args.debug, log_format)
        code: int = args.func(args)
        return code
    # With --debug the traceback comes first; the line and the exit code are the same.
    except UserInputError as e:
        fail(e, log_format, debug)
        return EXIT_USAGE
    except CdcflowError as e:  # PipelineStopped included: the run stopped on an error
        fail(e, log_format, debug)
        return EXIT_ERROR
    except BrokenPipeError as e:
        if stdout_gone():  # `cdcflow status --watch | head`: the reader read what it wanted
            return EXIT_OK
        fail(e, log_format, debug, traced=True)
        return EXIT_ERROR
    except Exception as e:  # the pipeline's own code, a plugin's, or a defect of cdcflow
        fail(e, log_format, debug, traced=True)
        return EXIT_ERROR
    except KeyboardInterrupt:
        settle_deferred()  # what the signal's handler had to say comes first
        say("\ncdcflow: interrupted", log_format, "interrupted", logging.WARNING)
        return EXIT_INTERRUPTED  # (end_process does not wait for threads still busy)
