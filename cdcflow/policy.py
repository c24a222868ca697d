"""What happens when a user function or a sink raises: :class:`ErrorPolicy` and its
decisions (:class:`Retry`, :class:`Skip`, :class:`Stop`), and :class:`FailedElement`, what a
dead-letter sink receives.

The policy and its decisions are defined in :mod:`cdcflow.transforms._policy`, where sinks
can take one too; this module is where to import them from.
"""

from __future__ import annotations

from typing import Any

import attrs

from cdcflow.model import Timestamp
from cdcflow.transforms._policy import (
    Decision,
    ErrorHandler,
    ErrorPolicy,
    Retry,
    Skip,
    Stop,
)

__all__ = ["Decision", "ErrorHandler", "ErrorPolicy", "FailedElement", "Retry", "Skip", "Stop"]


@attrs.frozen
class FailedElement:
    """What a dead-letter sink receives for an element skipped by the error policy.

    ``label`` is the failing transform or sink; ``error`` its last exception as text;
    ``partition_token`` and ``commit_timestamp`` locate the change record the element
    came from; ``element`` is the input that failed.
    """

    label: str
    error: str
    partition_token: str
    commit_timestamp: Timestamp
    element: Any
