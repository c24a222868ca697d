"""process_alive: a live process, one that exited but is not reaped yet (a zombie), and
one that is gone."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cdcflow.processes import process_alive


def test_a_killed_process_its_parent_has_not_reaped_is_not_alive() -> None:
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert process_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while process_alive(child.pid):  # a zombie until reaped below
            assert time.monotonic() < deadline, "a killed, unreaped child still counts as alive"
            time.sleep(0.01)
        os.kill(child.pid, 0)  # the kernel still knows it: what os.kill alone would trust
    finally:
        child.kill()
        child.wait()
    assert not process_alive(child.pid)
    assert process_alive(os.getpid())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_malloc_arenas_are_capped_unless_the_environment_says() -> None:
    code = ("import os; os.environ['MALLOC_MMAP_THRESHOLD_'] = '1';"
            "from cdcflow.processes import tune_malloc as f; print(f())")
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, check=True)
    assert done.stdout.strip() == "True"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, "MALLOC_ARENA_MAX": "4"}, check=True)
    assert done.stdout.strip() == "False"  # the user's own settings stand


_MAPPED_AFTER_REUSE = """
import ctypes, sys
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
                .split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if sys.argv[1] == "tuned":
    from cdcflow.processes import tune_malloc
    tune_malloc()
before = libc.mallinfo2().hblkhd
block = bytearray(4 << 20)
del block  # glibc's own threshold grows to this block's size here
block = bytearray(4 << 20)
print(libc.mallinfo2().hblkhd - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_a_large_block_is_mapped_on_its_own_so_freeing_it_gives_it_back() -> None:
    def mapped(how: str, **env: str) -> int:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        done = subprocess.run([sys.executable, "-c", _MAPPED_AFTER_REUSE, how],
                              capture_output=True, text=True, env={**environ, **env},
                              check=True)
        return int(done.stdout)

    assert mapped("untuned") < 4 << 20  # the second block came from the heap
    assert mapped("tuned") >= 4 << 20  # mapped: its memory leaves when it is freed
    assert mapped("tuned", MALLOC_MMAP_THRESHOLD_=str(8 << 20)) < 4 << 20  # the user's


def test_the_heap_settles_while_batches_run_and_is_given_back() -> None:
    import gc

    from cdcflow.processes import YOUNG_COLLECTION_THRESHOLD, settled_heap

    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        kept = [object() for _ in range(3)]
        assert gc.get_freeze_count() == 0
        with settled_heap():
            assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, 10, 10)
            assert gc.get_freeze_count() > 0  # what existed before is frozen
        assert gc.get_threshold() == (700, 10, 10)
        assert gc.get_freeze_count() == 0
        del kept
        gc.set_threshold(0)  # a collector the program turned off stays off
        with settled_heap():
            assert gc.get_threshold()[0] == 0
        gc.set_threshold(50_000, 10, 10)  # a larger threshold the program chose is kept
        with settled_heap():
            assert gc.get_threshold()[0] == 50_000
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()


def test_cdcflow_commands_allocate_arrow_memory_from_jemalloc_unless_told(
    tmp_path: Path,
) -> None:
    """The command line chooses Arrow's pool before anything imports pyarrow (a pipeline
    file here); the user's ARROW_DEFAULT_MEMORY_POOL stands."""
    if not sys.platform.startswith("linux"):
        pytest.skip("Linux only")
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(
        "import sys\nimport pyarrow\nimport cdcflow as cf\n"
        "print('pool', pyarrow.default_memory_pool().backend_name, file=sys.stderr)\n"
        "pipeline = cf.Pipeline('pool')\n"
        "pipeline | cf.DetectPartitions(stream='S', database='projects/p/instances/i/"
        "databases/d') | cf.ReadPartition() | cf.Print()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    for given, expected in ((None, "jemalloc"), ("system", "system")):
        done = subprocess.run(
            [sys.executable, "-m", "cdcflow", "graph", str(pipeline)], capture_output=True,
            text=True, check=True,
            env=env if given is None else {**env, "ARROW_DEFAULT_MEMORY_POOL": given},
        )
        assert f"pool {expected}" in done.stderr, done.stderr
