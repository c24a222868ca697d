"""Test doubles and helpers for pipelines: ScriptedChangeStream and friends."""

from cdcflow.testing.scripted import *  # noqa: F403
from cdcflow.testing.scripted import __all__ as _scripted_all

__all__ = list(_scripted_all)
