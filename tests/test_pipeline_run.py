"""``pipeline.run()`` from a plain Python script, on the real Cloud Spanner emulator.

A workload commits inserts, updates and deletes while the emulator splits and merges
partitions; a script (no CLI) builds a pipeline with ReadChangeStream and WriteFiles and
calls ``pipeline.run(...)`` with ``end_at`` just after the last commit. Every committed
change must be in the output exactly once, and the state must be where ``pipeline.run()``
keeps it by default: ``.cdcflow/state.db`` under the current directory.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from cdcflow.metadata import open_store
from cdcflow.model import Timestamp
from cdcflow.spanner.emulator import Emulator
from cdcflow.spanner.workload import SHOP_KEY, SHOP_STREAM, Workload, create_shop_database

pytestmark = pytest.mark.emulator

SCRIPT = """
import json
import os

import cdcflow as cf

pipeline = cf.Pipeline(os.environ["RUN_NAME"])
(pipeline
 | cf.ReadChangeStream(os.environ["RUN_DB"], os.environ["RUN_STREAM"],
                       start_at=os.environ["RUN_START"], end_at=os.environ["RUN_END"],
                       heartbeat="250ms")
 | cf.WriteFiles("out", format="jsonl"))

if __name__ == "__main__":
    summary = pipeline.run(batch_interval="250ms", max_batch_span="2s")
    print(json.dumps({"reason": summary.reason, "records": summary.records,
                      "batches": summary.batches, "splits": summary.splits}))
"""


def test_pipeline_run_from_a_script_delivers_every_change_exactly_once(
    spanner_emulator: Emulator, tmp_path: Path
) -> None:
    name = f"script{os.getpid() % 1000}"
    database = create_shop_database(spanner_emulator, name)
    start = Timestamp.now()
    workload = Workload(database, rate=15, seed=random.randrange(1 << 30))
    workload.run(seconds=6)
    last = max(change.commit_ns for change in workload.changes)
    end = Timestamp.from_ns(last + 1_000_000)  # inclusive end_at, after the last commit

    script = tmp_path / "orders.py"
    script.write_text(SCRIPT)
    env = dict(
        os.environ, SPANNER_EMULATOR_HOST=spanner_emulator.host, RUN_NAME=name,
        RUN_DB=spanner_emulator.database_path(name), RUN_STREAM=SHOP_STREAM,
        RUN_START=start.rfc3339(), RUN_END=end.rfc3339(),
    )
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["reason"] == "end reached"

    expected = Counter((int(c.keys[SHOP_KEY]), c.commit_ns, c.mod_type) for c in workload.changes)
    seen: Counter[tuple[int, int, str]] = Counter()
    tokens = set()
    for path in sorted((tmp_path / "out").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            tokens.add(record["partition_token"])
            ts = Timestamp.parse(record["commit_timestamp"]).ns
            for mod in record["mods"]:
                seen[(int(mod["keys"][SHOP_KEY]), ts, record["mod_type"])] += 1
    assert sum(expected.values()) > 30
    assert not expected - seen, f"lost: {list(expected - seen)[:3]}"
    assert not seen - expected, f"duplicated or unknown: {list(seen - expected)[:3]}"
    assert len(tokens) >= 2  # the run followed partitions as the emulator churned them

    store = open_store(f"sqlite:///{tmp_path / '.cdcflow' / 'state.db'}")
    try:
        assert store.partitions(name)
        assert all(p.state == "FINISHED" for p in store.partitions(name))
    finally:
        store.close()


_IMPORTED_RUN = '''
import cdcflow as cf
from cdcflow.testing import ScriptedChangeStream
T0 = 1_700_000_000 * 10**9
stream = ScriptedChangeStream("S", partitions=1, origin=T0)
stream.write("T", 1, "INSERT", {"v": 1}, at=T0 + 1000)

def to_key(r):
    return r.mods[0].keys

out = cf.Collect()
pipeline = cf.Pipeline("etl")
(pipeline | cf.ReadChangeStream(stream="S", start_at=T0, end_at=T0 + 5000, client=stream)
 | cf.Map(to_key) | out)
summary = pipeline.run(metadata="memory://")
print("done", summary.reason, out.items)
'''


def test_run_at_the_top_level_of_an_imported_module_is_refused_not_hung(
    tmp_path: Path,
) -> None:
    """A task would load the module's functions, waiting for the import that waits for
    the run: refused at once, naming the module and the fix. Run as the main module
    (no import under way), the same file runs."""

    (tmp_path / "etl.py").write_text(_IMPORTED_RUN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    imported = subprocess.run([sys.executable, "-c", "import etl"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
    assert imported.returncode == 1
    assert ("PipelineDefinitionError: the pipeline runs while module 'etl', whose functions "
            "its steps use, is still being imported") in imported.stderr
    assert 'if __name__ == "__main__":' in imported.stderr
    direct = subprocess.run([sys.executable, "etl.py"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert direct.returncode == 0 and "done end reached [{'id': 1}]" in direct.stdout
