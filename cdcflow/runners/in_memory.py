"""InMemoryRunner: runs a batch's tasks in this process on a thread pool.

Every task and every result still travels as pickled bytes through
:func:`cdcflow.engine.task.execute_task`, exactly as on Spark, so a pipeline whose
functions or sink messages do not pickle fails here first, not on a cluster.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from cdcflow.engine.runner import settle
from cdcflow.engine.task import execute_task

__all__ = ["InMemoryRunner"]


class InMemoryRunner:
    """Run tasks on up to ``workers`` threads (default: the CPU count, at most 8).

    ``run_tasks`` returns the results in task order, or raises the error of the first
    failed task (in task order) after every task has ended.
    """

    name = "memory"

    def __init__(self, workers: int | None = None) -> None:
        if workers is not None and workers < 1:
            msg = f"InMemoryRunner(workers={workers}): use 1 or more"
            raise ValueError(msg)
        self.workers = workers or min(8, os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None

    def open(self, app_name: str) -> None:
        """Start the thread pool (idempotent)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=f"cdcflow-{app_name}")

    def run_tasks(self, program: bytes, tasks: Sequence[bytes]) -> list[bytes]:
        if not tasks:
            return []
        if len(tasks) == 1 or self.workers == 1:
            return [execute_task(program, task) for task in tasks]
        self.open("tasks")
        assert self._pool is not None
        futures = [self._pool.submit(execute_task, program, task) for task in tasks]
        for future in futures:  # waits for every task
            settle(future)
        for future in futures:
            error = future.exception()
            if error is not None:
                raise error
        return [f.result() for f in futures]

    def close(self) -> None:
        """Stop the pool: tasks still queued (a batch aborted mid-way, by a second Ctrl-C)
        are cancelled, and the running ones waited for."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def abandon(self) -> None:
        """:meth:`close` for a run that aborts: queued tasks are cancelled and the running
        ones not waited for (one may never return: a call on a silent connection)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __repr__(self) -> str:
        return f"InMemoryRunner(workers={self.workers})"
