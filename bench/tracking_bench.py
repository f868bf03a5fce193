"""What the experiment trackers add to an update: a ``gtr train`` run with TensorBoard, W&B
(offline) and MLflow all on, then, per update, the seconds spent in the trackers (``tracking_s``,
measured around every tracker call) against the update's wall time (``update_s``: rollout,
training, probe, evaluation, trackers).

    python bench/tracking_bench.py --data DIR [--config configs/numberline-tiny.toml] [--updates 5]

Use the data folder of bench/warmstart_bench.py to start from its cached warm start. The run's
TensorBoard events and MLflow store stay in DIR (docs/observability.md's screenshots).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "numberline-tiny.toml")
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--report-only", action="store_true", help="report on DIR's latest run")
    args = ap.parse_args()
    if not args.report_only:
        train(args)
    report(args.data)


def train(args: argparse.Namespace) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    env |= {
        "GTR_DATA_DIR": str(args.data),
        "GTR_TRACKING_TENSORBOARD": "1",
        "GTR_TRACKING_WANDB": "1",
        "GTR_TRACKING_MLFLOW": "1",
    }
    if "GTR_TORCH_THREADS" in os.environ:
        env["GTR_TORCH_THREADS"] = os.environ["GTR_TORCH_THREADS"]
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "train",
        str(args.config),
        "--updates",
        str(args.updates),
        "--name",
        "tracking-bench",
    ]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def report(data: Path) -> None:
    with sqlite3.connect(data / "gtr.sqlite3") as conn:
        run_id = conn.execute("SELECT MAX(id) FROM runs").fetchone()[0]
        rows = [
            json.loads(r[0])
            for r in conn.execute(
                "SELECT metrics FROM updates WHERE run_id = ? ORDER BY idx", (run_id,)
            )
        ]
        info = json.loads(
            conn.execute("SELECT info FROM runs WHERE id = ?", (run_id,)).fetchone()[0]
        )
    rows = [m for m in rows if "update_s" in m]  # updates that finished
    for i, m in enumerate(rows):
        print(
            f"update {i + 1}: update_s {m['update_s']:7.2f}  tracking_s {m['tracking_s']:6.3f}"
            f"  ({100 * m['tracking_s'] / m['update_s']:.2f} %)"
        )
    # The first update includes starting the trackers (W&B's service, MLflow's store): shown apart.
    later = rows[1:] or rows
    share = statistics.mean(m["tracking_s"] / m["update_s"] for m in later)
    first = rows[0]["tracking_s"] / rows[0]["update_s"]
    print(
        f"run {run_id}: trackers {sorted(info.get('tracking', {}))}; "
        f"share of update time: first update {100 * first:.2f} %, later updates {100 * share:.2f} %"
    )


if __name__ == "__main__":
    main()
