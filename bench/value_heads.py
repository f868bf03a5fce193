"""Explained variance of the value-head choices (model.value_head) on the tiny NumberLine model.

    .venv/bin/python bench/value_heads.py --warm DIR            # DIR: a policy checkpoint
    .venv/bin/python bench/value_heads.py --warm DIR --updates 8 --heads linear,mlp --value-lr 1e-3

One embedded ``gtr train`` per head, all from the same warm-started policy (its value head is not
loaded when the kinds differ: every head starts at 0), the numberline-tiny recipe otherwise.
Per update the trainer records ``explained_variance`` = 1 − Var(R − V_old)/Var(R) over the
rollout; the table gives each head's per-update figures and the mean of the last half.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def config(warm: Path, head: str, updates: int, envs: int, value_lr: float | None) -> str:
    with open(ROOT / "configs" / "numberline-tiny.toml", "rb") as f:
        cfg: dict[str, Any] = tomllib.load(f)
    lines = [
        f'name = "value-head-{head}"',
        'task = "numberline"',
        'algorithm = "gtr"',
        "seed = 0",
        "[env]\nimage_size = 64",
        f'[model]\nimage_size = 64\nfinetune = "full"\nvalue_head = "{head}"',
        "[generation]\nmax_new_tokens = 48",
        f'[init]\nkind = "checkpoint"\ncheckpoint = "{warm}"',
        "[train]",
        *(f"{k} = {json.dumps(v)}" for k, v in cfg["train"].items() if k != "num_envs"),
        f"num_envs = {envs}",
        *([f"value_lr = {value_lr}"] if value_lr else []),
        '[corrector]\nwait = "none"',
        "[metrics]\nprobe_states = 0",
    ]
    text = "\n".join(lines) + "\n"
    return text.replace("num_updates = 25", f"num_updates = {updates}")


def run(
    warm: Path, head: str, updates: int, envs: int, value_lr: float | None, work: Path
) -> dict[str, Any]:
    folder = work / head
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.toml").write_text(config(warm, head, updates, envs, value_lr))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    env |= {"GTR_DATA_DIR": str(folder / "data"), "GTR_TORCH_THREADS": "1"}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "train", str(folder / "run.toml")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"{head}: gtr train failed\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    con = sqlite3.connect(folder / "data" / "gtr.sqlite3")
    rows = [json.loads(m) for (m,) in con.execute("SELECT metrics FROM updates ORDER BY idx")]
    con.close()
    ev = [round(float(m["explained_variance"]), 3) for m in rows]
    late = ev[len(ev) // 2 :]
    return {
        "head": head,
        "ev": ev,
        "late_mean": round(sum(late) / len(late), 3),
        "seconds": round(time.monotonic() - start),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warm", type=Path, required=True, help="warm-started policy checkpoint")
    ap.add_argument("--heads", default="linear,mlp,mlp+image")
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--envs", type=int, default=16)
    ap.add_argument("--value-lr", type=float, default=None, help="train.value_lr (None = lr)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [
            run(args.warm.resolve(), h, args.updates, args.envs, args.value_lr, Path(tmp))
            for h in args.heads.split(",")
        ]
    print("| value_head | explained variance per update | mean, last half | s |")
    print("|---|---|---|---|")
    for r in results:
        ev = " ".join(map(str, r["ev"]))
        print(f"| {r['head']} | {ev} | {r['late_mean']} | {r['seconds']} |")


if __name__ == "__main__":
    main()
