"""Whether a process of this host still lives: what the lease's same-host check and the
sweeps of files a dead run left behind ask."""

from __future__ import annotations

import os

__all__ = ["process_alive"]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host lives: another user's counts as alive; a
    process that has exited but that its parent has not reaped yet (a zombie: ``os.kill``
    still finds it) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return not _exited(pid)


def _exited(pid: int) -> bool:
    """A zombie, on Linux (its state in /proc is Z or X); False where /proc cannot say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # "pid (comm) S ...": the state follows the last ")", as comm may hold any character
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state in (b"Z", b"X")
