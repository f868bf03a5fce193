"""First-rollout latency of the demo preset, first run vs second run (warm-start cache).

Runs ``gtr train CONFIG`` twice on the embedded default in one fresh data folder and measures,
for each, the seconds from launching the process to the first step written to the store (the
first rollout under way); the process is then stopped. The first run pays the warm start and
stores it in the cache; the second finds it there.

    python bench/warmstart_bench.py [--config configs/numberline-tiny.toml] [--data DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def first_rollout_s(config: Path, data: Path, timeout_s: float) -> tuple[float, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    env |= {"GTR_DATA_DIR": str(data), "GTR_TORCH_THREADS": os.environ.get("GTR_TORCH_THREADS", "")}
    env = {k: v for k, v in env.items() if v != ""}
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "train", str(config)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    db = data / "gtr.sqlite3"
    before = _latest_run(db) if db.exists() else 0  # this launch's run comes after these
    try:
        while time.monotonic() - started < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"gtr train exited {proc.returncode}: {proc.stderr.read()[-2000:]}"
                )
            if db.exists():
                try:
                    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
                        row = conn.execute(
                            "SELECT runs.id, runs.info FROM steps"
                            " JOIN runs ON runs.id = steps.run_id ORDER BY steps.id DESC LIMIT 1"
                        ).fetchone()
                except sqlite3.OperationalError:  # not migrated yet, or locked by the writer
                    row = None
                if row is not None and row[0] > before:
                    return time.monotonic() - started, json.loads(row[1] or "{}")
            time.sleep(0.2)
        raise TimeoutError(f"no rollout within {timeout_s} s")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def _latest_run(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
        return int(conn.execute("SELECT MAX(id) FROM runs").fetchone()[0] or 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "numberline-tiny.toml")
    ap.add_argument("--data", type=Path, help="data folder (default: a new temporary one)")
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    data = args.data or Path(tempfile.mkdtemp(prefix="gtr-warmbench-"))
    first, info1 = first_rollout_s(args.config, data, args.timeout)
    print(f"first run:  first rollout after {first:7.1f} s  warm start {info1.get('warm_start')}")
    second, info2 = first_rollout_s(args.config, data, args.timeout)
    print(f"second run: first rollout after {second:7.1f} s  warm start {info2.get('warm_start')}")
    assert info2["warm_start"]["reused"], "the second run did not reuse the warm start"
    print(f"speed-up: {first / second:.1f}x  (load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
