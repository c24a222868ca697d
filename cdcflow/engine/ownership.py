"""One run per pipeline: the engine's side of the store's lease and fencing token.

:class:`Ownership` takes the pipeline's lease before the first batch, renews it from a
heartbeat thread while the run lasts, and releases it when the run ends. Every plan and
commit the engine writes carries the lease's token (``fence=``), so a store refuses the
writes of a run that lost its lease: a stale or second driver can never plan or commit.

Taking over. A lease that is alive and held by another run is refused with one line
naming the owner (:class:`~cdcflow.errors.LeaseHeldError`, exit 2), unless

- its owner ran on this host and its process is gone (a crashed or killed run: the
  restart resumes at once instead of waiting out the lease), or
- the user passed ``--takeover`` (``RunOptions.takeover``) after confirming it is gone.

Either way only that exact lease is replaced, so two runs racing to take over cannot
both win. If another run takes over while this one runs, the heartbeat notices
(:class:`~cdcflow.errors.FencedError`) and asks the engine to stop; a write that races
the heartbeat is refused by the store all the same.

A store that keeps failing the renewals (while its other calls may still work) is given a
whole lease past the lease's end on this process's clock; then the run stops
(:class:`~cdcflow.errors.LeaseLapsedError`), as it would had another run taken over: its
side effects wait for a lease it does not have (:mod:`cdcflow.engine.guard`), so going
on would only pile up output that is never made durable.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable

from cdcflow.engine.guard import RunGuard
from cdcflow.errors import CdcflowError, FencedError, LeaseLapsedError, StoreError, describe
from cdcflow.metadata import _rules
from cdcflow.metadata.base import MetadataStore
from cdcflow.model import Lease, Timestamp
from cdcflow.processes import process_alive

__all__ = ["Ownership", "held_by_a_live_run", "owner_gone"]

_log = logging.getLogger("cdcflow.engine")
_NS = 1_000_000_000
#: Seconds ``release`` waits for the heartbeat's renewal under way.
_RELEASE_WAIT = 5.0


def _cause(exc: Exception, store: MetadataStore, method: str) -> str:
    """A store's error for a log line: cdcflow's own as it says; another (a plugin's) with
    the store's class and method, and its type."""
    if isinstance(exc, CdcflowError):
        return str(exc)
    return f"{type(store).__name__}.{method}() raised {describe(exc)}"


def _secs(seconds: float) -> str:
    return f"{seconds:.0f}s" if abs(seconds) >= 10 else f"{seconds:.1f}s"


def owner_gone(lease: Lease, host: str | None = None) -> bool:
    """True when ``lease`` was taken on this host by a process that no longer exists."""
    if lease.host != (host or socket.gethostname()) or lease.pid is None:
        return False
    if lease.pid == os.getpid():
        return False  # this very process: another engine of ours holds it
    return not process_alive(lease.pid)


def held_by_a_live_run(store: MetadataStore, pipeline: str) -> str | None:
    """The refusal a run of ``pipeline`` would get now (a live lease of another process),
    or None; for a refusal that comes before the lease is asked for (a metrics port in
    use: the same run started twice), so that it names the run, not the port."""
    lease = store.lease(pipeline)
    now = Timestamp.now().ns
    if lease is None or not lease.alive(now) or owner_gone(lease):
        return None
    return _rules.held_message(pipeline, lease, now)


class Ownership:
    """The lease of one run of ``pipeline`` (see the module docstring).

    ``ttl`` seconds: how long the lease holds without a heartbeat; it is renewed every
    ``ttl / 3``. ``on_lost`` is called (from the heartbeat or the watch thread) once another
    run took the pipeline over, or no renewal succeeded for a whole ``ttl`` past the
    lease's end.
    ``guard`` learns how long the lease holds on this process's clock, and that it was
    lost (:mod:`cdcflow.engine.guard`).
    """

    def __init__(
        self, store: MetadataStore, pipeline: str, ttl: float,
        on_lost: Callable[[StoreError], None], guard: RunGuard | None = None,
    ) -> None:
        self.store = store
        self.pipeline = pipeline
        self.ttl_ns = max(1, int(ttl * _NS))
        self.owner = f"{socket.gethostname()}:{os.getpid()}"
        self.run_id = uuid.uuid4().hex[:12]
        self._on_lost = on_lost
        self.guard = guard if guard is not None else RunGuard(pipeline)
        self._lease: Lease | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None  # the heartbeat: renews
        self._watcher: threading.Thread | None = None  # stops a run whose lease lapsed
        self._held_until = 0.0  # the lease's end on this process's monotonic clock
        self._renewing_since: float | None = None  # a renewal under way since
        self._failure: str | None = None  # the last renewal's error, until one succeeds
        self._losing = threading.Lock()
        self.lost: StoreError | None = None  # FencedError, or LeaseLapsedError
        #: The run before this one did not release its lease (it crashed, or was taken
        #: over); known once the lease is acquired.
        self.predecessor_crashed = False

    @property
    def token(self) -> int:
        """The fencing token every write of this run carries."""
        if self._lease is None:
            msg = "the lease is not held: call acquire() first"
            raise RuntimeError(msg)
        return self._lease.token

    def acquire(self, takeover: bool) -> Lease:
        """Take the lease (raises LeaseHeldError naming a live owner) and start renewing."""
        current = self.store.lease(self.pipeline)
        replace = None
        self.predecessor_crashed = (current is not None and current.run_id != self.run_id
                                    and current.expires_at != 0)
        if current is not None and current.run_id != self.run_id:
            if owner_gone(current):
                if current.expires_at:  # not released: that run did not end cleanly
                    _log.info("taking over pipeline %s from %s, whose process is gone",
                              self.pipeline, current.owner)
                replace = current.token
            elif takeover:
                _log.warning("taking over pipeline %s from %s (--takeover)",
                             self.pipeline, current.owner)
                replace = current.token
            elif current.expires_at and current.expires_at <= Timestamp.now().ns:
                # (a released lease has expires_at 0: a clean end, nothing to say)
                _log.warning("taking over pipeline %s from %s (run %s), whose lease expired "
                             "%.1fs ago without being released: that run stopped renewing it "
                             "(it died on another host, was paused, or lost the store)",
                             self.pipeline, current.owner, current.run_id,
                             (Timestamp.now().ns - current.expires_at) / _NS)
        began = time.monotonic()
        self._lease = self.store.acquire_lease(
            self.pipeline, self.owner, self.run_id, self.ttl_ns, replace=replace
        )
        self._held_until = began + self.ttl_ns / _NS
        self.guard.hold_until(self._held_until, self.ttl_ns / _NS)
        self._thread = threading.Thread(
            target=self._heartbeat, name=f"cdcflow-lease-{self.pipeline}", daemon=True
        )
        self._watcher = threading.Thread(
            target=self._watch, name=f"cdcflow-lease-watch-{self.pipeline}", daemon=True
        )
        self._thread.start()
        self._watcher.start()
        return self._lease

    def _heartbeat(self) -> None:
        ttl = self.ttl_ns / _NS
        while not self._stop.wait(ttl / 3):
            lease = self._lease
            assert lease is not None
            began = time.monotonic()
            self._renewing_since = began
            try:
                renewed = self.store.renew_lease(self.pipeline, lease, self.ttl_ns)
            except FencedError as e:
                self._lose(e)
                return
            except Exception as e:  # a store hiccup: the next beat tries again
                self._failure = _cause(e, self.store, "renew_lease")
                lapsed = time.monotonic() - self._held_until
                when = (f"it lapses in {_secs(-lapsed)}" if lapsed < 0 else
                        f"it lapsed {_secs(lapsed)} ago: another run may take the pipeline "
                        f"over; this run stops if it cannot renew it within "
                        f"{_secs(max(0.0, ttl - lapsed))}")
                _log.warning("renewing the lease of %s failed (%s); %s",
                             self.pipeline, self._failure, when)
                continue
            finally:
                self._renewing_since = None
            with self._losing:
                if self.lost is not None:
                    return  # the watch found it lapsed meanwhile
                self._lease = renewed
                self._held_until = began + ttl
                self._failure = None
                self.guard.hold_until(self._held_until, ttl)

    def _watch(self) -> None:
        """Stops the run once a whole lease has passed since the lease ran out on this
        process's clock, whether the renewals fail or do not answer at all (a store call
        that hangs keeps the heartbeat from ever saying so)."""
        ttl = self.ttl_ns / _NS
        warned = False
        while not self._stop.wait(min(ttl / 6, 1.0)):
            now = time.monotonic()
            lapsed = now - self._held_until
            since = self._renewing_since
            if lapsed < 0:
                warned = False
                continue
            waited = 0.0 if since is None else now - since  # the renewal under way
            hung = waited >= ttl / 3
            if lapsed < ttl:
                if hung and not warned:  # a failure says so itself; a hung call cannot
                    warned = True
                    _log.warning(
                        "renewing the lease of %s has not answered for %s; it lapsed %s "
                        "ago: this run stops if it cannot renew it within %s", self.pipeline,
                        _secs(waited), _secs(lapsed), _secs(max(0.0, ttl - lapsed)))
                continue
            if hung:
                cause = f"renew_lease() has not answered for {_secs(waited)}"
            elif self._failure is not None:
                cause = f"the store still fails: {self._failure}"
            else:
                continue  # a renewal just succeeded, or is on its way
            self._lose(LeaseLapsedError(
                f"the lease of pipeline {self.pipeline} could not be renewed: it ran out "
                f"{_secs(lapsed)} ago and {cause}; stopping, as another run may own the "
                "pipeline now: check the metadata store, then run again"
            ))
            return

    def _lose(self, error: StoreError) -> None:
        with self._losing:
            if self.lost is not None:
                return
            self.lost = error
        self.guard.revoke(error)
        # the error ends the run (the command's last line): said here in brief, as the run
        # may take a while to stop
        _log.warning("the lease of pipeline %s is lost (%s): stopping after the current "
                     "batch", self.pipeline, type(error).__name__)
        self._on_lost(error)

    def release(self) -> None:
        """Stop renewing and give the lease back (a later run takes it at once); a store
        whose renewal does not answer is not asked (the lease lapses by itself)."""
        self._stop.set()
        for thread in (self._thread, self._watcher):
            if thread is not None:
                thread.join(_RELEASE_WAIT)
        if self._thread is not None and self._thread.is_alive():
            since = self._renewing_since
            waited = 0.0 if since is None else time.monotonic() - since
            _log.warning("could not release the lease of %s (renewing it has not answered "
                         "for %s); it lapses by itself %s after its last renewal",
                         self.pipeline, _secs(waited), _secs(self.ttl_ns / _NS))
            return
        if self._lease is not None and self.lost is None:
            try:
                self.store.release_lease(self.pipeline, self._lease)
            except Exception as e:  # one line; a plugin's traceback with --debug
                cause = _cause(e, self.store, "release_lease")
                _log.warning("could not release the lease of %s (%s); it lapses by itself "
                             "%.0fs after its last renewal", self.pipeline, cause,
                             self.ttl_ns / _NS, exc_info=_log.isEnabledFor(logging.DEBUG))
