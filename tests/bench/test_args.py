"""A benchmark given a value it cannot run with refuses it as the project's commands do:
the usage and one line naming the option and what to give, exit status 2, no traceback
(and no run). Each benchmark is run as ``make bench`` runs it, ``python -m bench.<name>``,
in a subprocess that ends at its argument parsing; a module's cases run two at a time."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from bench import _args, bench_catchup

ROOT = Path(__file__).resolve().parents[2]

#: module -> (argv, what the error line names, extra environment) per bad value: a few
#: per option, every kind (not a number, 0, negative, nan, an empty list item) on the way
CASES: dict[str, list[tuple[list[str], str, dict[str, str]]]] = {
    "bench": [
        (["abc"], "argument NAME:", {}),
        (["engine", "bench_nope"], "argument NAME:", {}),
    ],
    "bench.bench_catchup": [
        (["--shapes", "abc"], "argument --shapes:", {}),
        (["--shapes", "0"], "argument --shapes:", {}),
        (["--shapes", "-3"], "argument --shapes:", {}),
        (["--shapes", "300x0"], "argument --shapes:", {}),
        (["--shapes", "300x20,"], "argument --shapes:", {}),
        (["--set", "max_batch_span"], "argument --set:", {}),
        (["--set", "=60s"], "argument --set:", {}),
        (["--no-spark"], "CDCFLOW_BENCH_CATCHUP_CHANGES:", {"CDCFLOW_BENCH_CATCHUP_CHANGES": "0"}),
    ],
    "bench.bench_consume": [
        (["--records", "0"], "argument --records:", {}),
        (["--keys", "0"], "argument --keys:", {}),
        (["--call-ms", "-3"], "argument --call-ms:", {}),
        (["--call-ms", "nan"], "argument --call-ms:", {}),
    ],
    "bench.bench_decode": [
        (["--records", "0"], "argument --records:", {}),
        (["--records", "abc"], "argument --records:", {}),
        (["--rows-per-message", "-1"], "argument --rows-per-message:", {}),
        (["--rounds", "0"], "argument --rounds:", {}),
        (["--serve", "-1"], "argument --serve:", {}),
        (["--min-seconds", "-1"], "argument --min-seconds:", {}),
    ],
    "bench.bench_engine": [
        (["--sizes", "abc"], "argument --sizes:", {}),
        (["--sizes", "10,,0"], "argument --sizes:", {}),
        (["--seconds", "0"], "argument --seconds:", {}),
    ],
    "bench.bench_latency": [
        (["--seconds", "-3"], "argument --seconds:", {}),
        (["--idle", "abc"], "argument --idle:", {}),
        (["--rate", "0"], "argument --rate:", {}),
    ],
    "bench.bench_memory": [
        (["--mb", "0"], "argument --mb:", {}),
        (["--quotas", "0"], "argument --quotas:", {}),
        (["--quotas", "-3"], "argument --quotas:", {}),
        (["--quotas", "256,,8"], "argument --quotas:", {}),
        (["--tasks", "0"], "argument --tasks:", {}),
        ([], "CDCFLOW_BENCH_BACKLOG_MB:", {"CDCFLOW_BENCH_BACKLOG_MB": "abc"}),
    ],
    "bench.bench_metrics": [
        (["--records", "0"], "argument --records:", {}),
        (["--partitions", "0"], "argument --partitions:", {}),
        (["--batches", "-3"], "argument --batches:", {}),
        (["--rounds", "0"], "argument --rounds:", {}),
        (["--scrape-every", "0"], "argument --scrape-every:", {}),
    ],
    "bench.bench_pipeline": [
        (["--records", "-3"], "argument --records:", {}),
        (["--rounds", "0"], "argument --rounds:", {}),
    ],
    "bench.bench_pipelined": [
        (["--batches", "0"], "argument --batches:", {}),
        (["--read", "abc"], "argument --read:", {}),
        (["--commit", "-3"], "argument --commit:", {}),
    ],
    "bench.bench_snapshot": [
        (["--rows", "0"], "argument --rows:", {}),
        (["--rows-per-task", "0"], "argument --rows-per-task:", {}),
        (["--tasks-per-batch", "-3"], "argument --tasks-per-batch:", {}),
        (["--repeat", "0"], "argument --repeat:", {}),
    ],
    "bench.bench_spark": [
        (["--idle-batches", "0"], "argument --idle-batches:", {}),
        (["--records", "-3"], "argument --records:", {}),
        (["--partitions", "0"], "argument --partitions:", {}),
        (["--batches", "abc"], "argument --batches:", {}),
    ],
    "bench.bench_tables": [
        (["--rows", "0"], "argument --rows:", {}),
        (["--batch", "0"], "argument --batch:", {}),
        (["--repeat", "-3"], "argument --repeat:", {}),
    ],
}

#: a case still running after this long started its benchmark instead of refusing
_TIMEOUT = 30


def _refusal(module: str, argv: list[str], names: str, env: dict[str, str]) -> str | None:
    """What is wrong with how ``python -m module *argv`` ended (None: refused as it should)."""
    command = f"python -m {module} {' '.join(argv)}"
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *argv], cwd=ROOT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        start_new_session=True,  # a benchmark that started runs its helpers in its group
    )
    try:
        _, stderr = proc.communicate(timeout=_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return f"{command}: still running after {_TIMEOUT}s: the value was not refused"
    last = (stderr.strip().splitlines() or [""])[-1]
    if proc.returncode != 2 or "Traceback" in stderr or names not in last:
        return f"{command}: exit {proc.returncode}, stderr:\n{stderr[-2000:]}"
    if not last.startswith(f"python -m {module}: error: "):
        return f"{command}: the error does not name the command: {last}"
    return None


@pytest.mark.parametrize("module", sorted(CASES))
def test_a_bad_value_is_refused_in_one_line_naming_the_option(module: str) -> None:
    with ThreadPoolExecutor(2) as pool:
        wrong = [w for w in pool.map(lambda case: _refusal(module, *case), CASES[module]) if w]
    assert not wrong, "\n\n".join(wrong)


_BAD: list[tuple[Callable[[str], Any], list[str]]] = [
    (_args.positive_int, ["abc", "", "0", "-3", "1.5", "nan"]),
    (_args.non_negative_int, ["abc", "", "-1", "0.5"]),
    (_args.positive_float, ["abc", "", "0", "-3", "nan", "inf", "-inf"]),
    (_args.non_negative_float, ["abc", "", "-0.5", "nan", "inf"]),
    (_args.int_list, ["abc", "", ",", "10,", ",10", "10,,5", "10,abc", "0", "10,-3"]),
    (bench_catchup._shapes, ["abc", "", "0", "-3", "300x0", "x20", "300x-1", "300x20,",
                             "300xabc"]),
]


@pytest.mark.parametrize(("convert", "text"), [(c, t) for c, bad in _BAD for t in bad],
                         ids=lambda v: getattr(v, "__name__", repr(v)))
def test_the_helpers_refuse_what_no_benchmark_can_run_with(
    convert: Callable[[str], Any], text: str,
) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'.*': give "):
        convert(text)


def test_the_helpers_keep_what_the_options_mean() -> None:
    assert _args.positive_int("7") == 7
    assert _args.non_negative_int("0") == 0  # bench_decode --rows-per-message 0: 1 and 50
    assert _args.positive_float("0.25") == 0.25
    assert _args.non_negative_float("0") == 0.0  # no sleep: --call-ms, --read, --commit
    assert _args.int_list("10,1000,10000") == [10, 1000, 10000]
    assert _args.int_list(" 256, 32 ") == [256, 32]
    assert bench_catchup._shapes("200000x20,40000x1") == [(200000, 20), (40000, 1)]
    per_txn = bench_catchup.ROWS_PER_TXN  # a shape without its rows per transaction
    assert bench_catchup._shapes("300, 40x") == [(300, per_txn), (40, per_txn)]
