"""PySpark's Python worker daemon, quiet when Spark closes a worker's socket at shutdown.

Spark starts this module (``spark.python.daemon.module``) instead of ``pyspark.daemon``.
When a session stops, the JVM closes the sockets of its Python workers; a reused worker
that was between tasks then fails to flush its output and, as Spark 4 kills such a
worker (``spark.python.daemon.killWorkerOnFlushFailure``), PySpark's daemon printed the
``BrokenPipeError`` with its traceback on the driver's terminal, at random, after runs that
went well. Here such a worker ends quietly instead, as killed (it is not reused); anything
else is PySpark's own behaviour. The daemon imports cdcflow's task code before it forks
workers, so that a worker's first task does not.
"""

from __future__ import annotations

from typing import Any

from pyspark import daemon as _daemon

from cdcflow.processes import choose_arrow_pool, tune_malloc

__all__ = ["main", "worker"]

_worker = _daemon.worker


def worker(sock: Any, authenticated: bool) -> int:
    """PySpark's ``worker``; a socket the JVM closed ends it with code 1 (not reused)."""
    try:
        code: int = _worker(sock, authenticated)
    except (BrokenPipeError, ConnectionResetError):
        return 1
    return code


def _preload() -> None:
    """Import what every task imports (the engine's task code, not the Spanner client
    library, whose gRPC core must not start before a fork) once, here: the workers this
    daemon forks start with it."""
    try:
        import cdcflow.engine.task  # noqa: F401
    except Exception:  # a worker imports it again, and says what is wrong
        return


def main() -> None:
    tune_malloc()  # the workers it forks inherit it
    choose_arrow_pool()  # and this
    _preload()
    _daemon.worker = worker  # manager() looks it up in its module at every task
    _daemon.manager()


if __name__ == "__main__":
    main()
