"""``python -m bench``: run every ``bench/bench_*.py`` module in turn, each in a process of
its own (a module that freezes the garbage collector or warms a cache must not change the
next one's figures). ``python -m bench engine tables`` runs only those."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    here = Path(__file__).parent
    names = sorted(
        m.name for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_")
    )
    only = set(sys.argv[1:])
    failed = []
    for name in names:
        if only and name not in only and name.removeprefix("bench_") not in only:
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
