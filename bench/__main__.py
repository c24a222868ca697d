"""``python -m bench``: run every ``bench/bench_*.py`` module in turn, each in a process of
its own (a module that freezes the garbage collector or warms a cache must not change the
next one's figures). ``python -m bench engine tables`` runs only those."""

from __future__ import annotations

import argparse
import pkgutil
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    here = Path(__file__).parent
    names = sorted(
        m.name for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_")
    )

    def benchmark(text: str) -> str:
        name = text if text in names else f"bench_{text}"
        if name not in names:
            known = ", ".join(n.removeprefix("bench_") for n in names)
            msg = f"{text!r}: give a benchmark's name: {known}"
            raise argparse.ArgumentTypeError(msg)
        return name

    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("only", nargs="*", type=benchmark, metavar="NAME",
                        help="benchmarks to run, such as engine (default: all)")
    only = set(parser.parse_args(argv).only)
    failed = []
    for name in names:
        if only and name not in only:
            continue
        print(f"== {name} ==", flush=True)
        t0 = time.perf_counter()
        # imported as bench.<name>, not run as __main__: what a benchmark pickles (its
        # functions, into the runner's tasks) refers to its module by that name
        code = subprocess.run([sys.executable, "-c", f"from bench.{name} import main; main()"],
                              check=False).returncode
        if code:
            failed.append(name)
        print(f"({name}: {time.perf_counter() - t0:.1f}s)\n", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
