"""How a run answers SIGINT and SIGTERM around the blocks a signal must not cut short, or
after which no batch is left to stop after: handlers put in place while a block runs
(where Python's defaults, or the command line's own, are there), and put back after."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["abandon_on_signal", "deferred_signals", "handling"]

_log = logging.getLogger("cdcflow.engine")


@contextmanager
def handling(
    handler: Callable[[int, FrameType | None], None], *, ours_too: bool = False
) -> Iterator[None]:
    """``handler`` for SIGINT and SIGTERM while the block runs, where Python's default
    handlers are in place (with ``ours_too``, also cdcflow's own, marked
    ``cdcflow_stop_handler``: the CLI's); an application's handler stays. Main thread only
    (signals are handled there); the handlers found are put back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def replaceable(sig: signal.Signals) -> bool:
        # Python's SIGINT handler is the default one; the CLI's SIGTERM raises the same
        # KeyboardInterrupt until a run handles it.
        found = signal.getsignal(sig)
        default = found is signal.default_int_handler or found is signal.SIG_DFL
        return default or (ours_too and getattr(found, "cdcflow_stop_handler", False))

    previous = {sig: signal.signal(sig, handler)
                for sig in (signal.SIGINT, signal.SIGTERM) if replaceable(sig)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextmanager
def deferred_signals(doing: str) -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends, then raise KeyboardInterrupt (a second
    one raises at once): for a block a signal must not cut short, such as Spark's start (an
    interrupted JVM launch leaves the JVM running with no parent to end it). Where an
    application handles the signals itself, its handlers stay (see :func:`handling`)."""
    got: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if got:
            _log.warning("signal %d again while %s: aborting", signum, doing)
            raise KeyboardInterrupt
        got.append(signum)
        _log.warning("signal %d while %s: stopping once that is done (again to abort now)",
                     signum, doing)

    with handling(handler, ours_too=True):
        yield
    if got:
        raise KeyboardInterrupt


@contextmanager
def abandon_on_signal(doing: str, then: str) -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt (after a warning saying what was being
    done and what follows) while the block runs: for the final flush and the lease's
    release, when no batch is left to stop after (see :func:`handling`: the CLI's Ctrl-C
    handler is replaced too)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        _log.warning("signal %d while %s: stopping now; %s", signum, doing, then)
        raise KeyboardInterrupt

    with handling(handler, ours_too=True):
        yield
