"""Starting a study run's process: a fresh interpreter against a fork of the study runner's server.

`gtr study run` trains each run in a process of its own. A fresh interpreter imports what a run
imports (torch, transformers, the services: ``services/study/runner.py::PRELOAD``) before its
first step; the runner forks each run from a server that imported them once. This bench starts
``--rounds`` processes each way, alternating, each importing ``PRELOAD`` and exiting, and prints
the median seconds from start to exit and their ratio. The server's own start (its one import)
is timed apart: a study pays it once, at its first run.

    .venv/bin/python bench/run_start_bench.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.study.runner import PRELOAD, _forkserver  # noqa: E402

IMPORTS = "; ".join(f"import {m}" for m in PRELOAD)


def fresh_s() -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", IMPORTS], cwd=ROOT, check=True)
    return time.monotonic() - started


def forked_s() -> float:
    # The child imports PRELOAD as a run's process would: already there, nothing to load.
    started = time.monotonic()
    proc = _forkserver().Process(target=exec, args=(IMPORTS,))
    proc.start()
    proc.join()
    assert proc.exitcode == 0, proc.exitcode
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    server = forked_s()  # the first fork starts the server, which imports PRELOAD
    fresh, forked = [], []
    for _ in range(args.rounds):
        fresh.append(fresh_s())
        forked.append(forked_s())
    a, b = statistics.median(fresh), statistics.median(forked)
    print(f"server's start (once a study): {server:.2f} s")
    print(f"fresh interpreter: median {a:.2f} s ({', '.join(f'{x:.2f}' for x in fresh)})")
    print(f"forked from the server: median {b:.3f} s ({', '.join(f'{x:.3f}' for x in forked)})")
    print(f"forked / fresh: {b / a:.3f}")


if __name__ == "__main__":
    main()
