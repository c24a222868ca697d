"""One exception hierarchy. Every message says what to do about it.

``UserInputError`` and its subclasses are mistakes in what the user gave cdcflow (a
pipeline file, an option, a URL); the CLI prints them as one line and exits with code 2.
"""

from __future__ import annotations

__all__ = [
    "CdcflowError",
    "ChangeStreamError",
    "DuplicateLabelError",
    "PipelineDefinitionError",
    "PipelineFileError",
    "PipelineStopped",
    "PlanConflictError",
    "PluginError",
    "SinkError",
    "StoreError",
    "StoreURLError",
    "StreamNotFoundError",
    "TrackerError",
    "TransientError",
    "UserInputError",
    "WatermarkRegressionError",
]


class CdcflowError(Exception):
    """Base of every error cdcflow raises on purpose."""


class UserInputError(CdcflowError):
    """Bad input from the user: shown as one line, exit code 2."""


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


class ChangeStreamError(CdcflowError):
    """Reading the change stream failed for a reason that retrying will not fix."""


class TransientError(CdcflowError):
    """A retryable failure that kept failing after every allowed attempt."""


class TrackerError(CdcflowError):
    """A restriction tracker was used against its contract (a bug in a reader)."""


class StoreError(CdcflowError):
    """The metadata store refused or failed an operation."""


class WatermarkRegressionError(StoreError):
    """A commit tried to move a partition's watermark backwards."""


class PlanConflictError(StoreError):
    """A batch was planned while another batch of the same pipeline is still pending."""


class SinkError(CdcflowError):
    """A sink failed to write or commit; the batch is not committed and will be replayed."""


class PipelineStopped(CdcflowError):
    """A user function or sink failed and the error policy says stop.

    Nothing past the failed record was committed; fix the cause and run again to resume.
    """
