"""How a run answers SIGINT and SIGTERM around the blocks a signal must not cut short, or
after which no batch is left to stop after: handlers put in place while a block runs
(where Python's defaults, or the command line's own, are there), and put back after.

A handler runs on the main thread between two of its steps, wherever it is: possibly
holding a lock (an ``Event``'s, while it waits on it; a stream's, while it writes), which
the handler would then wait for for ever. So cdcflow's handlers take no lock: they count
the signal, raise ``KeyboardInterrupt`` to abort, and hand everything else (a stop
request, a log line) to :func:`defer`, which another thread runs at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from queue import SimpleQueue
from types import FrameType

__all__ = ["STOP_SIGNALS", "abandon_on_signal", "defer", "deferred_signals", "deferring",
           "handling", "settle_deferred"]

_log = logging.getLogger("cdcflow.engine")

#: The signals that ask a run to stop: Ctrl-C, a supervisor's SIGTERM, and SIGHUP (the
#: terminal or the session closed; ``nohup`` ignores it, and then so does cdcflow).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, name))

# -- what a handler hands off ----------------------------------------------------------------


class _Server:
    """A thread that runs the calls put on its queue (``SimpleQueue.put`` is reentrant: a
    handler may call it) until it is given None."""

    def __init__(self) -> None:
        self.calls: SimpleQueue[Callable[[], None] | None] = SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="cdcflow-signals", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (call := self.calls.get()) is not None:
            try:
                call()
            except Exception as exc:  # one line: a failed stop request ends nothing
                _log.warning("while answering a signal: %s: %s", type(exc).__name__, exc)


_SETTLE_S = 2.0  # how long what was deferred is waited for, at most
_server: _Server | None = None
_users = 0  # the blocks under way that need it (cdcflow handlers are installed)
_server_lock = threading.Lock()


@contextmanager
def deferring() -> Iterator[None]:
    """The thread that runs what handlers :func:`defer`, while the block runs (not from a
    handler: starting a thread takes locks). Every place that installs a cdcflow handler
    does so inside; the thread ends, once what was deferred has run, when the last such
    block does: a process that lives on after a run keeps no thread of it."""
    global _server, _users
    with _server_lock:
        _users += 1
        if _server is None:
            _server = _Server()
    try:
        yield
    finally:
        with _server_lock:
            _users -= 1
            ending = _server if _users == 0 else None
            if ending is not None:
                _server = None
                ending.calls.put(None)
        if ending is not None:
            ending.thread.join(_SETTLE_S)


def defer(call: Callable[[], None]) -> None:
    """Run ``call`` on cdcflow's signal thread, at once: the one thing besides counting
    and raising that a signal handler may do (see the module docstring). Outside a
    :func:`deferring` block (no handler of cdcflow's is installed) ``call`` runs here."""
    server = _server
    if server is None:
        call()
        return
    server.calls.put(call)


def settle_deferred(timeout: float = _SETTLE_S) -> None:
    """Wait (at most ``timeout`` seconds) until what handlers deferred so far has run: an
    abort's warning is said before the process ends. Not from a handler."""
    server = _server
    if server is None:
        return  # (its block ended, and waited for it)
    done = threading.Event()
    server.calls.put(done.set)
    done.wait(timeout)


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

    with deferring():
        previous = {sig: signal.signal(sig, handler)
                    for sig in STOP_SIGNALS if replaceable(sig)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)


@contextmanager
def deferred_signals(doing: str) -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block ends, then raise KeyboardInterrupt (a second
    one raises at once), as does the block's failure after one (the signal reached a child
    it started, most likely: a JVM that a supervisor's SIGTERM to the process group ended
    while it started): for a block a signal must not cut short, such as Spark's start (an
    interrupted JVM launch leaves the JVM running with no parent to end it). Where an
    application handles the signals itself, its handlers stay (see :func:`handling`)."""
    got: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if got:
            defer(lambda: _log.warning("signal %d again while %s: aborting", signum, doing))
            raise KeyboardInterrupt
        got.append(signum)
        defer(lambda: _log.warning("signal %d while %s: stopping once that is done (again "
                                   "to abort now)", signum, doing))

    with handling(handler, ours_too=True):
        try:
            yield
        except Exception:
            if got:  # it failed of the signal, most likely (it reached a child too)
                raise KeyboardInterrupt from None
            raise
    if got:
        raise KeyboardInterrupt


@contextmanager
def abandon_on_signal(doing: str, then: str) -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt (after a warning saying what was being
    done and what follows) while the block runs: for the final flush and the lease's
    release, when no batch is left to stop after (see :func:`handling`: the CLI's Ctrl-C
    handler is replaced too)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        defer(lambda: _log.warning("signal %d while %s: stopping now; %s", signum, doing, then))
        raise KeyboardInterrupt

    with handling(handler, ours_too=True):
        yield
