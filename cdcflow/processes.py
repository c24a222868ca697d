"""This host's processes: whether one still lives (what the lease's same-host check and
the sweeps of files a dead run left behind ask), the memory allocators of cdcflow's own
processes (:func:`tune_malloc`, :func:`choose_arrow_pool`) and the garbage
collector while batches run (:func:`settled_heap`)."""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "ARROW_MEMORY_POOL", "MALLOC_ARENAS", "MMAP_THRESHOLD", "YOUNG_COLLECTION_THRESHOLD",
    "child_pids", "choose_arrow_pool", "process_alive", "settle_collector", "settled_heap",
    "tune_malloc",
]

#: The malloc arenas of a process cdcflow starts (glibc), unless ``MALLOC_ARENA_MAX`` says.
MALLOC_ARENAS = 2
#: The size from which glibc's malloc maps a block of its own (and unmaps it when freed),
#: unless ``MALLOC_MMAP_THRESHOLD_`` says.
MMAP_THRESHOLD = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameters
_M_ARENA_MAX = -8


def tune_malloc(arenas: int = MALLOC_ARENAS, mmap_threshold: int = MMAP_THRESHOLD) -> bool:
    """Set glibc's malloc up for a run in this process (True when set): call it before
    threads start, in a process cdcflow owns (the command line, Spark's Python workers),
    never from a library call inside someone else's program. Each setting that the
    environment makes (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``) stands; elsewhere
    than glibc, nothing is done.

    * Arenas capped at ``arenas``. glibc gives each thread that allocates at once its own
      arena, up to eight per core, and memory freed in one is not reused by another: a
      run's threads (tasks, readers ahead, uploads) passing large records between them
      kept memory resident for nothing. Measured with ``cdcflow run`` on the emulator, 400
      changes of 1 MB into a slow sink: peak RSS 169-228 MB against 225-264 MB at an 8 MiB
      byte quota (four runs each), 166-171 MB against 194-219 MB at 32 MiB; a
      100,000-change catch-up took 1.73-1.81 s against 1.82-2.00 s.
    * Blocks of ``mmap_threshold`` bytes and more mapped on their own, and so given back
      to the system the moment they are freed. glibc's threshold otherwise grows to the
      largest block freed (up to 32 MiB), after which a large record's transient copies (the
      message received, its text, the parsed values) come from the heap, whose freed space
      stays resident. Measured with ``cdcflow run`` on the emulator, 100 changes of 7.4 MiB
      into a slow sink at a 32 MiB byte quota (base 107 MB): peak RSS 182-187 MB against
      209-252 MB (six runs), a 4 MiB threshold 197-201 MB; the pipeline and catch-up
      benchmarks (small records) did not move."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:  # the process's own symbols: glibc's (finding libc by name runs ldconfig, 10 ms)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    done = False
    if not os.environ.get("MALLOC_ARENA_MAX"):
        done = bool(mallopt(_M_ARENA_MAX, arenas))
    if not os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        done = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) or done
    return done


#: Container objects allocated (net) between two collections of the youngest generation
#: while batches run (Python's default: 700).
YOUNG_COLLECTION_THRESHOLD = 10_000


def settle_collector() -> None:
    """Freeze what the heap holds now into the collector's permanent generation and
    collect the youngest generation every :data:`YOUNG_COLLECTION_THRESHOLD` allocations:
    for a process cdcflow owns (a Spark worker, between tasks), and within
    :func:`settled_heap`.

    A record the decoder makes is about ten container objects (the record, its mods and
    their dicts, its timestamps), so at Python's default a young collection ran every 70
    records, and the records of the message being read and of the batch being written,
    alive at that moment, moved on to older generations, which then filled and were
    collected in turn. With a young collection every 10,000, most records die before
    one: measured with ``bench.bench_pipeline`` (20,000 records, one core), decoding
    went from 135,000 to 160,000 records/s and Read -> Map -> WriteFiles from 75,000 to
    85,000 (3,000 gave the same; 100,000 no more). Cyclic garbage waits at most that
    many allocations longer: a few MB."""
    gc.freeze()
    threshold = gc.get_threshold()
    if threshold[0] and threshold[0] < YOUNG_COLLECTION_THRESHOLD:  # 0: collector off
        gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, *threshold[1:])


@contextmanager
def settled_heap() -> Iterator[None]:
    """While the batches run (:func:`settle_collector`): what was set up before them
    (modules, clients, the program, the store) sits in the collector's permanent
    generation, so that a full collection walks only the run's own objects instead of
    every object of the process (tens of milliseconds each time), and young collections
    are rarer. The collector's settings are given back when the run ends."""
    threshold = gc.get_threshold()
    settle_collector()
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


#: Arrow's allocator in a process cdcflow starts (Linux), unless ``ARROW_DEFAULT_MEMORY_POOL``
#: says.
ARROW_MEMORY_POOL = "jemalloc"


def choose_arrow_pool(pool: str = ARROW_MEMORY_POOL) -> bool:
    """Have Arrow allocate from ``pool`` in this process (True when set): call it before
    pyarrow is imported, in a process cdcflow owns (as :func:`tune_malloc`).

    Arrow's default on Linux, mimalloc, keeps what a thread freed for that thread, and
    each task's Parquet writer builds and frees its chunks on its own thread: measured
    with ``bench.bench_memory``'s WriteFiles Parquet run (1 GB of 64 KiB rows, 32 MiB
    quota, the writers sharing one spill budget), peak RSS over the quota was 157, 164
    and 212 MB at 4, 8 and 16 tasks, and with jemalloc, which returns freed memory after
    a short delay, 123, 135 and 140 MB, as fast. ``ARROW_DEFAULT_MEMORY_POOL`` in the
    environment wins; elsewhere than Linux, nothing is done."""
    if os.environ.get("ARROW_DEFAULT_MEMORY_POOL") or not sys.platform.startswith("linux"):
        return False
    os.environ["ARROW_DEFAULT_MEMORY_POOL"] = pool
    return True


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


def child_pids() -> set[int]:
    """The processes this one started that still exist (on Linux, from /proc; empty where
    /proc cannot say)."""
    me = str(os.getpid()).encode()
    found: set[int] = set()
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) S ppid ...": the parent follows the state, after the last ")"
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and fields[1] == me:
            found.add(int(name))
    return found
