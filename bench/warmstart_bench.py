"""First-rollout latency of the demo preset, first run vs second run (warm-start cache).

Runs ``gtr train CONFIG`` twice on the embedded default in one fresh data folder and measures,
for each, the seconds from launching the process to the first step written to the store (the
first rollout under way); the process is then stopped. The first run pays the warm start and
stores it in the cache; the second finds it there.

    python bench/warmstart_bench.py [--config configs/numberline-tiny.toml] [--data DIR]
    python bench/warmstart_bench.py --in-process ...

Before the first launch and after the second the bench times a bare ``python`` that only imports
torch and transformers' LLaVA model (the faster of the two is printed): the floor under any
``gtr train`` process's first rollout, whatever the cache does (the policy generates in it).

``--in-process`` measures what a long-lived controller sees (the full stack, or ``gtr up``): both
runs are driven in this one process, whose imports (torch, transformers) are paid before either
starts; the clock runs from ``drive(run)`` to the run's first step, then the run is cancelled.
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


IMPORT_FLOOR = (
    "import torch; from transformers import AutoModelForImageTextToText;"
    " from transformers.models.llava import modeling_llava"
)


def import_floor_s() -> float:
    """Seconds a fresh process takes to import what generation needs (torch, transformers)."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", IMPORT_FLOOR], cwd=ROOT, check=True)
    return time.monotonic() - started


def _latest_run(db: Path) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1) as conn:
        return int(conn.execute("SELECT MAX(id) FROM runs").fetchone()[0] or 0)


def in_process(config: Path, data: Path) -> list[tuple[float, dict]]:
    for k in [k for k in os.environ if k.startswith("GTR_") and k != "GTR_TORCH_THREADS"]:
        del os.environ[k]
    os.environ["GTR_DATA_DIR"] = str(data)
    import threading

    from sqlalchemy import func, select, update

    import services.controller.service  # noqa: F401  what a running controller has loaded
    import services.policy.service  # noqa: F401
    import services.trainer.tasks  # noqa: F401
    from services.api.service import create_run
    from services.controller.console import load_config
    from services.controller.loop import drive
    from shared.db.migrate import ensure_schema
    from shared.db.models import Run, Step
    from shared.db.session import session_scope

    ensure_schema()
    out = []
    for _ in range(2):
        with session_scope() as s:
            run_id = create_run(s, load_config(config), team="default").id
        seen: list[float] = []

        def watch(run_id: int = run_id, seen: list[float] = seen) -> None:
            while not seen:
                with session_scope() as s:
                    n = s.scalar(
                        select(func.count()).select_from(Step).where(Step.run_id == run_id)
                    )
                    if n:
                        seen.append(time.monotonic())
                        s.execute(update(Run).where(Run.id == run_id).values(cancel_requested=True))
                time.sleep(0.1)

        threading.Thread(target=watch, daemon=True).start()
        started = time.monotonic()
        drive(run_id)
        with session_scope() as s:
            info = dict(s.get(Run, run_id).info or {})  # type: ignore[union-attr]
        out.append((seen[0] - started, info))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "numberline-tiny.toml")
    ap.add_argument("--data", type=Path, help="data folder (default: a new temporary one)")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--in-process", action="store_true", help="a long-lived controller's view")
    args = ap.parse_args()
    data = args.data or Path(tempfile.mkdtemp(prefix="gtr-warmbench-"))
    print(f"load average at the start {os.getloadavg()[0]:.1f}")
    floor = None
    if args.in_process:
        (first, info1), (second, info2) = in_process(args.config, data)
    else:
        floor = import_floor_s()
        first, info1 = first_rollout_s(args.config, data, args.timeout)
        second, info2 = first_rollout_s(args.config, data, args.timeout)
        floor = min(floor, import_floor_s())  # the shared machine's load swings: the quieter
    print(f"first run:  first rollout after {first:7.1f} s  warm start {info1.get('warm_start')}")
    print(f"second run: first rollout after {second:7.1f} s  warm start {info2.get('warm_start')}")
    if floor is not None:
        print(
            f"floor: a bare process importing torch + transformers' LLaVA takes {floor:.1f} s"
            f" (the most a new process could reach: {first / floor:.1f}x)"
        )
    assert info2["warm_start"]["reused"], "the second run did not reuse the warm start"
    print(f"speed-up: {first / second:.1f}x  (load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
