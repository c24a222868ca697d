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
from cdcflow.metadata.base import MetadataStore
from cdcflow.model import Lease, Timestamp
from cdcflow.processes import process_alive

__all__ = ["Ownership", "owner_gone"]

_log = logging.getLogger("cdcflow.engine")
_NS = 1_000_000_000


def owner_gone(lease: Lease, host: str | None = None) -> bool:
    """True when ``lease`` was taken on this host by a process that no longer exists."""
    if lease.host != (host or socket.gethostname()) or lease.pid is None:
        return False
    if lease.pid == os.getpid():
        return False  # this very process: another engine of ours holds it
    return not process_alive(lease.pid)


class Ownership:
    """The lease of one run of ``pipeline`` (see the module docstring).

    ``ttl`` seconds: how long the lease holds without a heartbeat; it is renewed every
    ``ttl / 3``. ``on_lost`` is called (from the heartbeat thread) once another run took
    the pipeline over, or the renewals failed for a whole ``ttl`` past the lease's end.
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
        self._thread: threading.Thread | None = None
        self.lost: StoreError | None = None  # FencedError, or LeaseLapsedError

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
        self.guard.hold_until(began + self.ttl_ns / _NS, self.ttl_ns / _NS)
        self._thread = threading.Thread(
            target=self._heartbeat, name=f"cdcflow-lease-{self.pipeline}", daemon=True
        )
        self._thread.start()
        return self._lease

    def _heartbeat(self) -> None:
        ttl = self.ttl_ns / _NS
        held_until = time.monotonic() + ttl  # the lease's end on this process's clock
        while not self._stop.wait(ttl / 3):
            lease = self._lease
            assert lease is not None
            try:
                began = time.monotonic()
                self._lease = self.store.renew_lease(self.pipeline, lease, self.ttl_ns)
                held_until = began + ttl
                self.guard.hold_until(held_until, ttl)
            except FencedError as e:
                self._lose(e)
                return
            except Exception as e:  # a store hiccup: the next beat tries again
                lapsed = time.monotonic() - held_until
                cause = str(e) if isinstance(e, CdcflowError) else describe(e)
                if lapsed >= ttl:
                    lost = LeaseLapsedError(
                        f"the lease of pipeline {self.pipeline} could not be renewed: it ran "
                        f"out {lapsed:.0f}s ago and the store still fails ({cause}); "
                        "stopping, as another run may own the pipeline now: check the "
                        "metadata store, then run again"
                    )
                    lost.__cause__ = e
                    self._lose(lost)
                    return
                when = (f"it lapses in {-lapsed:.0f}s" if lapsed < 0 else
                        f"it lapsed {lapsed:.0f}s ago: another run may take the pipeline "
                        f"over; this run stops if it cannot renew it within "
                        f"{ttl - lapsed:.0f}s")
                _log.warning("renewing the lease of %s failed (%s); %s",
                             self.pipeline, cause, when)

    def _lose(self, error: StoreError) -> None:
        self.lost = error
        self.guard.revoke(error)
        _log.error("%s", error)
        self._on_lost(error)

    def release(self) -> None:
        """Stop renewing and give the lease back (a later run takes it at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._lease is not None and self.lost is None:
            try:
                self.store.release_lease(self.pipeline, self._lease)
            except Exception as e:  # one line; a plugin's traceback with --debug
                cause = str(e) if isinstance(e, CdcflowError) else describe(e)
                _log.warning("could not release the lease of %s (%s); it lapses by itself "
                             "%.0fs after its last renewal", self.pipeline, cause,
                             self.ttl_ns / _NS, exc_info=_log.isEnabledFor(logging.DEBUG))
