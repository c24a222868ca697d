"""Parsing durations ("250ms", "1s", "5m", "1h30m"), times ("now", RFC 3339, "-10m") and
sizes ("64MiB", "500KB")."""

from __future__ import annotations

import math
import re
from datetime import datetime

from cdcflow.errors import PipelineDefinitionError
from cdcflow.model import Timestamp

__all__ = ["is_relative_time", "parse_duration", "parse_size", "parse_time", "positive_seconds"]

_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|ms|s|m|h|d)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(text: str | float | int) -> float:
    """Seconds in a duration such as ``"250ms"``, ``"1.5s"``, ``"1h30m"`` or a bare number
    (a finite one: ``nan`` and ``inf`` are not durations)."""
    msg = f"not a duration: {text!r}; write e.g. 250ms, 1s, 5m or 1h30m"
    if isinstance(text, int | float):
        if not math.isfinite(text):
            raise ValueError(msg)
        return float(text)
    if not isinstance(text, str):
        raise ValueError(msg)
    s = text.strip().lower()
    if s.startswith("-") and not s.startswith("--") and _is_duration(s[1:]):
        msg = f"not a duration: {text!r} is negative; write a time of 0 or more, e.g. 1s or 5m"
    try:
        total = float(s)
    except ValueError:
        pos, total = 0, 0.0
        for m in _PART.finditer(s):
            if m.start() != pos:
                break
            total += float(m.group(1)) * _UNITS[m.group(2)]
            pos = m.end()
        if pos != len(s) or not s:
            raise ValueError(msg) from None
    if not math.isfinite(total):
        raise ValueError(msg)
    return total


def _is_duration(text: str) -> bool:
    try:
        parse_duration(text)
    except ValueError:
        return False
    return True


def positive_seconds(value: str | float, name: str, example: str) -> float:
    """Finite seconds > 0 for a duration given as text or a number; ``name`` (such as
    ``DetectPartitions(query_timeout=...)``) is what an error names, with ``example``."""
    try:
        seconds = parse_duration(value)
    except (TypeError, ValueError) as e:
        raise PipelineDefinitionError(f"{name}: {e}") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        msg = f"{name.replace('...', repr(value))}: use a finite time > 0, such as {example!r}"
        raise PipelineDefinitionError(msg)
    return seconds


def is_relative_time(value: str | datetime | int) -> bool:
    """Whether :func:`parse_time` reads ``value`` relative to now (``"now"``, ``"-10m"``)."""
    if not isinstance(value, str):
        return False
    s = value.strip()
    return s.lower() == "now" or s.startswith("-")


def parse_time(value: str | datetime | int, now_ns: int | None = None) -> int:
    """Nanoseconds since the epoch for ``"now"``, ``"-10m"`` (before now), RFC 3339 text,
    a datetime (naive taken as UTC) or integer nanoseconds."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, datetime):
        return Timestamp.from_datetime(value).ns
    if not isinstance(value, str):
        hint = (" (a float such as time.time() is seconds: give int(t * 1e9))"
                if isinstance(value, float) else "")
        msg = (f"not a time: {value!r} ({type(value).__name__}); write 'now', '-10m' (ten "
               f"minutes ago), RFC 3339 text, a datetime or int nanoseconds since the "
               f"epoch{hint}")
        raise ValueError(msg)
    now = Timestamp.now().ns if now_ns is None else now_ns
    s = value.strip()
    if s.lower() == "now":
        return now
    if s.startswith("-"):
        return now - int(parse_duration(s[1:]) * 1e9)
    try:
        return Timestamp.parse(s).ns
    except ValueError:
        msg = f"not a time: {value!r}; write 'now', '-10m' (ten minutes ago) or RFC 3339 text"
        raise ValueError(msg) from None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_BYTES = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int, name: str = "") -> int:
    """Bytes (0 or more) for ``"64MiB"``, ``"500KB"``, ``"1GiB"`` or a whole number;
    ``name`` (such as ``WriteTables(spool_disk=...)``) is what an error names."""
    what = f"{name.replace('...', repr(text))} is not a size" if name \
        else f"not a size: {text!r}"
    if isinstance(text, int | float) and not isinstance(text, bool):
        if text >= 0 and float(text).is_integer():
            return int(text)
        msg = f"{what}; use a whole number of bytes, 0 or more, or text such as 64MiB"
        raise PipelineDefinitionError(msg)
    m = _SIZE.match(text) if isinstance(text, str) else None
    if m is None:
        msg = f"{what}; write e.g. 64MiB, 500KB or 1GiB"
        raise PipelineDefinitionError(msg)
    unit = (m.group(2) or "").upper()
    if "." in m.group(1) and _BYTES[unit] == 1:
        msg = f"{what}; a number of bytes is whole (or write e.g. 1.5MiB)"
        raise PipelineDefinitionError(msg)
    return int(float(m.group(1)) * _BYTES[unit])
