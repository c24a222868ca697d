"""How a command ends: the one line of an error (plain or a JSON log object), SIGTERM
taken as Ctrl-C, the command's logging, a bus error's one line, a standard output whose
reader has gone, and the process's own end once the command's outcome is decided (also
while threads of a run are still busy)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import NoReturn

from cdcflow.engine.signals import STOP_SIGNALS

__all__ = [
    "BUS_ERROR", "command_logging", "end_process", "exit_on_bus_error", "fail", "one_line",
    "say", "stdout_gone", "term_as_interrupt",
]


def one_line(error: BaseException) -> str:
    notes = [str(n) for n in getattr(error, "__notes__", ())]  # e.g. "batch 7 was not committed"
    text = " ".join(str(error).split()) or type(error).__name__
    return "; ".join([text, *(" ".join(n.split()) for n in notes)])


def fail(
    error: BaseException | str, log_format: str, debug: bool = False, traced: bool = False,
) -> None:
    """The one line an error (or its text) ends the command with: plain, or a JSON log
    object; with ``debug``, an exception's traceback first. ``traced``: an error that is
    not cdcflow's own (its type is named, and that ``--debug`` shows where it came
    from)."""
    if debug and isinstance(error, BaseException):
        import traceback

        traceback.print_exception(error, file=sys.stderr)
    text = error if isinstance(error, str) else one_line(error)
    if traced and isinstance(error, BaseException):
        text = f"{type(error).__name__}: {text}" + ("" if debug else
                                                    "; --debug shows the traceback")
    say(f"cdcflow: error: {text}", log_format, text, logging.ERROR)


def say(line: str, log_format: str, text: str | None = None, level: int = logging.INFO) -> None:
    """``line`` on stderr, or under ``--log-format json`` a JSON log object of ``text``
    (default: the line without its leading "# " and blank lines)."""
    if log_format == "json":
        from cdcflow.progress import JsonFormatter

        message = line.strip().removeprefix("# ") if text is None else text
        record = logging.LogRecord("cdcflow.cli", level, __file__, 0, "%s", (message,), None)
        # the run's pipeline, as its log lines name it (None before a run set logging up)
        pipeline = next((h.formatter.pipeline for h in logging.getLogger().handlers
                         if isinstance(h.formatter, JsonFormatter)), None)
        print(JsonFormatter(pipeline).format(record), file=sys.stderr, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)


def end_process(code: int, grace: float = 2.0) -> NoReturn:
    """End the command's own process with ``code``, its outcome decided: a SIGINT, SIGTERM
    or SIGHUP from here on ends it at once with that code. (The interpreter's own end tears
    a large module set down for about 0.4 s and puts the default handlers back early in
    it: a SIGTERM there killed a run that had completed, exit 143, and a second Ctrl-C
    printed a traceback.) Threads still running get ``grace`` seconds, in all, to end;
    then what is registered to run at exit runs. Threads still busy then (after an abort,
    a task waiting on a silent connection; the interpreter would wait for them for ever)
    are left: only the logs are flushed, and the next run replays the batch."""

    def now(signum: int, frame: FrameType | None) -> None:
        os._exit(code)

    with contextlib.suppress(ValueError):  # not the main thread: signals are not ours
        for sig in STOP_SIGNALS:
            signal.signal(sig, now)
    try:
        deadline = time.monotonic() + grace
        me = threading.current_thread()
        busy = [t for t in threading.enumerate() if t is not me and not t.daemon]
        for thread in busy:
            thread.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in busy):
            logging.shutdown()
        else:
            atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # (a reader that has gone)
                stream.flush()
        os._exit(code)


def term_as_interrupt() -> None:
    """SIGTERM (and SIGHUP) ends the command as Ctrl-C does (one line, exit 130) until a
    run handles it (the engine's graceful stop takes over where this is in place), instead
    of killing the process with no word (exit 143, 129) while a pipeline loads or a runner
    starts. An ignored one (``nohup``) stays ignored."""
    with contextlib.suppress(ValueError):  # not the main thread: signals are not ours
        for sig in STOP_SIGNALS:
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, signal.default_int_handler)


def command_logging(debug: bool, log_format: str) -> None:
    """Log lines in ``log_format`` from the start of a command, warnings only (``run``
    sets its own up once its pipeline is loaded); with ``debug``, everything."""
    from cdcflow.progress import configure_logging

    configure_logging(debug=debug, format="json" if log_format == "json" else "plain")
    if not debug:
        logging.getLogger("cdcflow").setLevel(logging.WARNING)


#: The line a bus error (SIGBUS) ends a command with.
BUS_ERROR = (
    "a memory-mapped file failed under the process (SIGBUS): its disk is full or read-only, "
    "or the file was truncated or made unwritable (the SQLite store's -shm file, say); fix "
    "that and run the command again (a run resumes from its last commit)"
)


def exit_on_bus_error(log_format: str) -> None:
    """Have a bus error end this process with the one line of an error (:data:`BUS_ERROR`)
    and exit code 1, as the shell's "Bus error" and 135 would (the compiled module's
    handler; without it, the process keeps Python's default)."""
    from cdcflow.compiled import speedups

    compiled = speedups()
    if compiled is None or not hasattr(compiled, "exit_on_bus_error"):
        return
    if log_format != "json":
        compiled.exit_on_bus_error(f"cdcflow: error: {BUS_ERROR}\n".encode())
        return
    from cdcflow.logformat import JsonFormatter, utc_stamp

    record = logging.LogRecord("cdcflow.cli", logging.ERROR, __file__, 0, "%s", (BUS_ERROR,),
                               None)
    before, _, after = JsonFormatter().format(record).partition(utc_stamp(record.created))
    compiled.exit_on_bus_error(before.encode(), f"{after}\n".encode())


def stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has gone (a BrokenPipeError from
    writing to it, not from another pipe or socket); if so, it now goes to /dev/null, so
    that nothing written or flushed later fails again."""
    import select

    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poll.poll(0))
        if gone:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
    except (AttributeError, OSError, ValueError):  # no real stdout: not that case
        return False
    return gone
