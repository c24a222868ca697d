"""``python -m bench``: run every ``bench/bench_*.py`` module's ``main()`` in turn."""

from __future__ import annotations

import importlib
import pkgutil
import sys
import time
from pathlib import Path


def main() -> None:
    here = Path(__file__).parent
    names = sorted(
        m.name for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_")
    )
    only = set(sys.argv[1:])
    for name in names:
        if only and name not in only and name.removeprefix("bench_") not in only:
            continue
        module = importlib.import_module(f"bench.{name}")
        print(f"== {name} ==", flush=True)
        saved = sys.argv
        sys.argv = [f"bench.{name}"]  # each main() parses its own defaults
        t0 = time.perf_counter()
        try:
            module.main()
        finally:
            sys.argv = saved
        print(f"({name}: {time.perf_counter() - t0:.1f}s)\n", flush=True)


if __name__ == "__main__":
    main()
