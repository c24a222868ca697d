"""`cdcflow run ... | head`: a closed stdout ends the run cleanly after the current batch,
which commits, so the next run goes on where the reader stopped reading batches."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

T0 = 1_700_000_000 * 10**9
PIPELINE = f"""
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream
stream = ScriptedChangeStream("S", partitions=2, origin={T0})
for i in range(500):
    stream.write("T", i, "INSERT", {{"v": i}}, at={T0} + (i + 1) * 10_000_000)
pipeline = cf.Pipeline("pipe")
(pipeline | cf.DetectPartitions(stream="S", start_at={T0}, end_at={T0} + 6 * 10**9, client=stream)
 | cf.ReadPartition() | "v" >> cf.Map(lambda r: r.mods[0].new_values["v"]) | cf.Print())
"""


def _head(path: Path, lines: int) -> tuple[int, list[str], str]:
    cmd = (f"{sys.executable} -m cdcflow run {path} --set max_batch_span=1s "
           f"2>{path.parent / 'err.txt'} | head -{lines}; exit ${{PIPESTATUS[0]}}")
    done = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120,
                          cwd=path.parent, stdin=subprocess.DEVNULL)
    return done.returncode, done.stdout.split(), (path.parent / "err.txt").read_text()


def test_a_closed_pipe_ends_the_run_cleanly_and_commits_the_batch(tmp_path: Path) -> None:
    path = tmp_path / "p.py"
    path.write_text(textwrap.dedent(PIPELINE))
    code, first, err = _head(path, 3)
    assert code == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err
    assert len(first) == 3
    code, second, err = _head(path, 2)
    assert code == 0, err
    # the batch that was being printed committed: nothing before the cut is printed again
    assert set(map(int, second)).isdisjoint(map(int, first))
    assert min(map(int, second)) > max(map(int, first))
