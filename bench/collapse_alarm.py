"""Does the collapse alarm fire on a real PPO collapse? EZPoints, plain PPO (RL4VLM) at a raised
learning rate, from the reproduction's weak warm start (an earlier docs/results.md, in git
history: at lr 3e-4 RL4VLM's probe relevance falls to 0.00 within 4 updates).
Optionally a GTR run beside it, where it should not.

    python bench/collapse_alarm.py [--arms rl4vlm gtr] [--updates 4] [--lr 3e-4] [--out DIR]

Each run is `gtr train` in its own embedded data folder; the script prints, per update, the probe
relevance, the top-thought share against the probe states' own share, and the alarm with its
reason, read back from the run's SQLite file. The warm start (`gtr sft
configs/repro/ezpoints-warm.toml`) is made once under OUT/warm and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared.toml import dumps as to_toml  # noqa: E402

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "repro"
GTR = shutil.which("gtr") or str(Path(sys.executable).with_name("gtr"))  # the active venv's

COLUMNS = ("probe_relevance", "probe_top_thought_share", "probe_expected_top_share")


def child_env(data_dir: Path, models: Path) -> dict[str, str]:
    """Embedded mode in a private data folder, one torch thread."""
    drop = ("GTR_DATABASE_URL", "GTR_REDIS_URL", "GTR_BLOB_DIR", "GTR_CHECKPOINT_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop and "SERVICE_URL" not in k}
    return env | {
        "GTR_DATA_DIR": str(data_dir),
        "GTR_MODEL_DIR": str(models),
        "GTR_TORCH_THREADS": "1",
    }


def warm_start(out: Path) -> Path:
    warm = out / "warm"
    if not (warm / "config.json").exists() and not any(warm.glob("*")):
        cmd = [GTR, "sft", str(CONFIGS / "ezpoints-warm.toml"), "--out", str(warm)]
        subprocess.run(cmd, check=True, env=child_env(out / "warm-data", out / "models"))
    return warm.resolve()


def run_arm(out: Path, arm: str, warm: Path, updates: int, lr: float) -> float:
    with open(CONFIGS / "ezpoints.toml", "rb") as f:
        cfg = tomllib.load(f)
    cfg |= {"name": f"collapse-{arm}-lr{lr:g}", "algorithm": arm, "seed": 0}
    cfg["init"]["checkpoint"] = str(warm)
    cfg["train"] |= {"lr": lr, "num_updates": updates}
    cfg.setdefault("metrics", {})["eval_episodes"] = 0  # the probe is what is measured here
    run_dir = out / arm
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    started = time.monotonic()
    with open(run_dir / "train.log", "w") as log:
        subprocess.run(
            [GTR, "train", str(run_dir / "config.toml")],
            env=child_env(run_dir / "gtr-data", out / "models"),
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    return time.monotonic() - started


def report(out: Path, arm: str, seconds: float) -> list[dict]:
    db = sqlite3.connect(out / arm / "gtr-data" / "gtr.sqlite3")
    rows = db.execute("SELECT idx, alarm, metrics FROM updates ORDER BY idx").fetchall()
    status = db.execute("SELECT status FROM runs").fetchone()
    print(f"\n{arm}: {status[0] if status else '?'} in {seconds:.0f} s")
    print("update  " + "  ".join(f"{c:>24}" for c in COLUMNS) + "  alarm")
    table = []
    for idx, alarm, metrics in rows:
        m = json.loads(metrics)
        cells = "  ".join(f"{m.get(c, float('nan')):>24.2f}" for c in COLUMNS)
        print(f"{idx + 1:>6}  {cells}  {m.get('alarm_reason', '') if alarm else '-'}")
        cols = {c: m.get(c) for c in COLUMNS}
        reason = m.get("alarm_reason")
        table.append({"update": idx + 1, **cols, "alarm": bool(alarm), "reason": reason})
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", nargs="+", default=["rl4vlm"], choices=["rl4vlm", "gtr"])
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--out", type=Path, default=Path("bench/out/collapse"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    warm = warm_start(args.out)
    print(f"warm start: {time.monotonic() - t0:.0f} s")
    summary = {}
    for arm in args.arms:
        seconds = run_arm(args.out, arm, warm, args.updates, args.lr)
        summary[arm] = {"seconds": seconds, "updates": report(args.out, arm, seconds)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
