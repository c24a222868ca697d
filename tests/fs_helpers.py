"""Files a test makes unwritable for this process: ``chmod`` for a user, ``chattr +i`` for
root (root writes through mode bits); a test that needs ``chattr +i`` is skipped where it
is not permitted."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

__all__ = ["ROOT", "read_only"]

ROOT = os.geteuid() == 0


def _chattr(flag: str, *paths: Path) -> None:
    subprocess.run(["chattr", flag, *map(str, paths)], check=True, capture_output=True)


def _can_chattr(probe: Path) -> bool:
    probe.touch()
    try:
        _chattr("+i", probe)
    except (OSError, subprocess.CalledProcessError):
        return False
    _chattr("-i", probe)
    return True


@contextmanager
def read_only(*paths: Path) -> Iterator[None]:
    """Make ``paths`` (files or directories) unwritable for this process, then restore."""
    if ROOT:
        if not _can_chattr(paths[0].parent / ".chattr-probe"):
            pytest.skip("running as root, where chmod does not stop writes, and chattr +i "
                        "is not permitted here")
        _chattr("+i", *paths)
        try:
            yield
        finally:
            _chattr("-i", *paths)
        return
    modes = {p: p.stat().st_mode for p in paths}
    for p in paths:
        p.chmod(0o555 if p.is_dir() else 0o444)
    try:
        yield
    finally:
        for p, mode in modes.items():
            p.chmod(mode)
