"""One exception hierarchy. Every message says what to do about it.

``UserInputError`` and its subclasses are mistakes in what the user gave cdcflow (a
pipeline file, an option, a URL) or gaps in the environment it runs in (a program that is
not installed: ``ConfigurationError``); the CLI prints them as one line and exits with
code 2. Every other ``CdcflowError`` exits with code 1.

Every exception class of cdcflow is defined here (a test walks the package to keep it so);
modules that raise them re-export the names they always had.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = [
    "BatchAbandoned",
    "BatchInterrupted",
    "BrokenCall",
    "CdcflowError",
    "ChangeStreamError",
    "ConfigurationError",
    "DecodeError",
    "DuplicateLabelError",
    "EmulatorNotFoundError",
    "FencedError",
    "IncompleteTransactionError",
    "LeaseExpiredError",
    "LeaseHeldError",
    "LeaseLapsedError",
    "LostProgressError",
    "MissingColumnError",
    "OutputConflictError",
    "OwedOutputError",
    "PipelineDefinitionError",
    "PipelineFileError",
    "PipelineStopped",
    "PlanConflictError",
    "PluginError",
    "RunnerContractError",
    "SinkError",
    "SinkIOError",
    "SinkSetupError",
    "SparkTaskError",
    "StartTooEarlyError",
    "StoreError",
    "StoreNotFoundError",
    "StoreSetupError",
    "StoreURLError",
    "StreamNotFoundError",
    "TaskAttemptError",
    "TrackerError",
    "TransientError",
    "UsageError",
    "UserInputError",
    "WatermarkRegressionError",
    "WriterFailed",
    "WriterStopped",
    "caused_by",
    "describe",
    "log_failure",
    "user_code",
]


def log_failure(log: logging.Logger, message: str, *args: object, exc: BaseException) -> None:
    """Log ``message % args`` and ``exc`` (named by :func:`describe`) as one ERROR line,
    with the traceback only when ``log`` shows DEBUG lines (``--debug``): for a failure
    that does not end the run (a sink's abort or close, an observer)."""
    log.error(message + " (%s)", *args, describe(exc), exc_info=log.isEnabledFor(logging.DEBUG))


@contextlib.contextmanager
def user_code(where: str) -> Iterator[None]:
    """Name where an error of a pipeline's own code (or a plugin's) came from, as a note
    the one-line error report carries: ``where`` is e.g. "in setup() of step 'enrich'".
    cdcflow's own errors name their place already."""
    try:
        yield
    except CdcflowError:
        raise
    except Exception as exc:
        exc.add_note(where)
        raise


def caused_by(exc: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]
              ) -> bool:
    """Whether ``exc``, or an exception it was raised from or while handling (its chain of
    causes and contexts), is a ``kind``."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, kind):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


def describe(exc: BaseException) -> str:
    """``"Type: message"`` for ``exc``, also when its message cannot be made (its
    ``__str__`` raises): an error message about a user's exception never fails itself."""
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:
        return f"{type(exc).__name__} (its message could not be printed)"


class CdcflowError(Exception):
    """Base of every error cdcflow raises on purpose."""


class UserInputError(CdcflowError):
    """Bad input from the user: shown as one line, exit code 2."""


class UsageError(UserInputError):
    """A command line the ``cdcflow`` command rejected (unknown option, missing argument)."""


class ConfigurationError(UserInputError):
    """The environment lacks something cdcflow needs (a program, a variable); the message
    says what to install or set."""


class EmulatorNotFoundError(ConfigurationError):
    """The Cloud Spanner emulator's ``emulator_main`` is not installed where cdcflow looks."""


class PipelineFileError(UserInputError):
    """The pipeline file is missing, does not import, or defines no Pipeline."""


class PipelineDefinitionError(UserInputError):
    """The pipeline's graph is not valid (wrong order, sink not terminal, unknown kind)."""


class DuplicateLabelError(PipelineDefinitionError):
    """Two transforms share a label; labels key stored state, so they must be unique."""


class StoreURLError(UserInputError):
    """A metadata store URL that cannot be parsed or names an unknown scheme."""


class PluginError(UserInputError):
    """A plugin name that is not registered, or a plugin that does not load."""


class StreamNotFoundError(UserInputError):
    """The database or change stream does not exist (or is not visible)."""


class OutputConflictError(UserInputError):
    """A sink found output of the batch it is committing that this run did not commit (a
    fresh or reset metadata store, another pipeline or sink writing the same place).

    Nothing was overwritten. The message names the place and the batch; write to a new
    path, resume with the metadata store that wrote the output, or delete it.
    """


class OwedOutputError(UserInputError):
    """A staging sink that is no longer in the pipeline had not made committed batches
    durable yet, while a staging sink new to the pipeline appeared (a renamed label, most
    likely): the new one would start at the last committed batch, and those batches would
    be missing from that output for good. Give the old sink its label back and run once (a
    graceful end makes its output durable), or start over with ``--reset``."""


class LostProgressError(UserInputError):
    """A pipeline has no progress in its metadata store while a sink holds its output (the
    store was lost or is another one): starting over would deliver it all again. Resume
    with the store that holds the progress, or start over on purpose with ``--reset``."""


class ChangeStreamError(CdcflowError):
    """Reading the change stream failed for a reason that retrying will not fix."""


class StartTooEarlyError(ChangeStreamError, UserInputError):
    """The start of a read is before what the change stream holds (before its creation, or
    past its retention period): bad input (exit 2), fixed by a later ``start_at`` or a
    reset."""


class MissingColumnError(ChangeStreamError):
    """A read as of a past timestamp named a column the table did not have then (added by a
    later ``ALTER TABLE``)."""


class DecodeError(ChangeStreamError, ValueError):
    """A change stream row that does not have a shape cdcflow knows (upgrade cdcflow).

    Also a ValueError, which it was before it joined this hierarchy.
    """


class IncompleteTransactionError(ChangeStreamError):
    """A transaction GroupTransactions was about to emit has not the records and partitions
    its records announce (records were lost, or delivered twice)."""


class BatchAbandoned(CdcflowError):
    """A batch failed transiently after the run was asked to stop, and was not retried; the
    engine ends the run as stopped. ``then`` says what the next run does with the batch
    (replays its plan, or plans it again when the plan was not written)."""

    def __init__(self, batch_id: int, cause: BaseException, then: str) -> None:
        reason = " ".join(str(cause).split()) or type(cause).__name__
        super().__init__(
            f"batch {batch_id} failed after the stop request ({type(cause).__name__}: "
            f"{reason}); stopping without retrying it: {then}"
        )
        self.batch_id = batch_id


class TransientError(CdcflowError):
    """A retryable failure that kept failing after every allowed attempt."""


class TrackerError(CdcflowError):
    """A restriction tracker was used against its contract (a bug in a reader)."""


class StoreError(CdcflowError):
    """The metadata store refused or failed an operation."""


class StoreSetupError(StoreError, ConfigurationError):
    """A metadata store cannot be opened (a path that cannot be written, a file that is not
    a store, a server that does not answer, a database that does not exist); the message
    says what to check. Exit code 2."""


class StoreNotFoundError(StoreSetupError):
    """A store opened without creating anything (``open_store(url, create=False)``, as
    ``cdcflow status`` does) is not there: no such file, instance or database, or a database
    without the store's tables (another database, a wrong ``?table=``). Nothing was
    created; the message says to check the URL, or to create the store (a run, or
    ``cdcflow metadata init URL``). Exit code 2."""


class WatermarkRegressionError(StoreError):
    """A commit tried to move a partition's watermark backwards."""


class PlanConflictError(StoreError):
    """A batch was planned while another batch of the same pipeline is still pending."""


class SinkError(CdcflowError):
    """A sink failed to write or commit; the batch is not committed and will be replayed."""


class SinkSetupError(SinkError, ConfigurationError):
    """A sink cannot reach or open its storage before the first batch (a wrong URL, no
    credentials, a server that does not answer): nothing was read; the message says what
    to check. Exit code 2."""


class WriterFailed(SinkError):
    """A sink writer failed as a whole, not because of the element being written (calls
    that hang past ``drain_timeout``, say): the task fails without the error policy
    deciding about that element."""


class WriterStopped(TransientError):
    """A writer retrying failed calls gave its batch up because the run was asked to stop
    (a signal, ``--for``): the batch is not committed, and the next run reads it again."""


class BatchInterrupted(TransientError):
    """The runner cancelled a batch still running a grace period after the run was asked
    to stop, because its tasks cannot see the stop (Spark executors): the batch is not
    committed, and the next run reads it again."""


class SinkIOError(TransientError):
    """A sink's storage failed (disk full, permission denied, an I/O error) while a writer
    wrote or closed, or while the sink committed; the batch is retried with backoff.

    Not the data's fault: the engine retries the whole batch instead of retrying (or
    skipping) the element that was being written. The message names the file and the
    operating system's reason (free space, fix permissions, check the mount).
    """


class SparkTaskError(CdcflowError):
    """A task of a batch failed on every attempt Spark allowed; nothing of the batch was
    committed, and the next run reads it again."""


class TaskAttemptError(CdcflowError):
    """One attempt of a task failed on an executor in a way another attempt may fix.

    Raised inside a Spark Python worker so that Spark retries the task; its text names the
    task. The driver sees :class:`SparkTaskError` once Spark gives up.
    """


class PipelineStopped(CdcflowError):
    """A user function or sink failed and the error policy says stop.

    Nothing past the failed record was committed; fix the cause and run again to resume.
    """


class RunnerContractError(CdcflowError):
    """A runner returned results that break the Runner contract (one result per task, in
    task order, from the batch that was planned): a bug in the runner, reported before
    anything of the batch is committed."""


class BrokenCall(TransientError):
    """A Spanner RPC failed the way the stock client retries on its own without a bound
    (UNAVAILABLE, or INTERNAL from a reset HTTP/2 stream). Raised in place of that error,
    kept in ``error`` (the stock client may overwrite ``__cause__``), so that the stock
    loops let it through and only cdcflow's retry policy retries it. Always transient."""

    def __init__(self, error: Exception) -> None:
        super().__init__(f"{type(error).__name__}: {getattr(error, 'message', error)}")
        self.error = error


class LeaseHeldError(UserInputError):
    """Another run owns the pipeline (its lease is alive): one run per pipeline at a time."""


class FencedError(StoreError):
    """A plan, commit or lease renewal carried a fencing token that is no longer current:
    another run took the pipeline over. Nothing was written."""


class LeaseLapsedError(StoreError):
    """The store kept failing to renew this run's lease until a whole lease had passed
    since it ran out: another run may own the pipeline by now, so this one stops (what it
    staged is made durable by the next run, as after a crash)."""


class LeaseExpiredError(TransientError):
    """This run's lease ran out on the local clock (the process was paused, or the store
    did not answer the renewals): another run may own the pipeline, so a task makes no
    more side effects; the batch is retried once the lease is renewed (see
    :mod:`cdcflow.engine.guard`)."""
