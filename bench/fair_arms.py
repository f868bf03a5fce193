"""Measured checks of issue 40's newer arms, before/after, on the tiny EZPoints model (CPU).

    .venv/bin/python bench/fair_arms.py turbo     # teacher.merge = last_k vs running: KL a step
    .venv/bin/python bench/fair_arms.py grpo      # train.grpo_rollout = steps vs episodes

One embedded ``gtr train`` per setting from the study's EZPoints warm start
(``docs/results/warm/ezpoints``: the reproduction study's settings, episodes of up to 10 steps),
the same seed and budget otherwise. Figures are counts and means the trainer records per update
(``turbo/kl_mean``, ``grpo/zero_adv_frac``), not timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

BASE = """name = "fair-{name}"
task = "ezpoints"
algorithm = "{algorithm}"
seed = 0
[env]
image_size = 96
max_episode_steps = 10
invalid_action = "noop"
[model]
image_size = 96
finetune = "full"
[generation]
max_new_tokens = 40
[init]
kind = "checkpoint"
checkpoint = "{warm}"
[train]
num_envs = {envs}
num_steps = {steps}
num_updates = {updates}
ppo_epochs = 1
minibatch_size = 16
lr = 1e-4
lr_schedule = "constant"
{train}
[teacher]
{teacher}
[metrics]
probe_states = 0
"""

ARMS: dict[str, dict[str, Any]] = {
    "turbo": {
        "algorithm": "gtr_turbo_kl",
        "key": "turbo/kl_mean",
        "settings": {
            "last_k": {"teacher": 'merge = "last_k"\nkeep_last = 4'},
            "running": {"teacher": 'merge = "running"'},
        },
    },
    "grpo": {
        "algorithm": "grpo",
        "key": "grpo/zero_adv_frac",
        "settings": {
            "steps": {"train": 'group_size = 4\ngrpo_rollout = "steps"'},
            "episodes": {"train": 'group_size = 4\ngrpo_rollout = "episodes"'},
        },
    },
}


def install_warm(data: Path, env: dict[str, str]) -> Path:
    """The kept warm start under ``data``, its base model (config, tokenizer) built here, as
    bench/reproduce.py's ``carry_warm`` does."""
    src = ROOT / "docs" / "results" / "warm" / "ezpoints"
    with open(ROOT / "configs" / "repro" / "ezpoints-warm.toml", "rb") as f:
        model = tomllib.load(f).get("model", {})
    build = (
        "import sys, json; from shared.schemas import ModelConfig; "
        "from services.trainer.warmstart import base_model_path; "
        "print(base_model_path(ModelConfig.model_validate(json.loads(sys.argv[1])), 'ezpoints'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", build, json.dumps(model)],
        cwd=ROOT,
        env=env | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        check=True,
    )
    dest = data / "warm"
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "policy.json":
            shutil.copy2(f, dest / f.name)
    meta = json.loads((src / "policy.json").read_text())
    meta["base_model"] = out.stdout.split()[-1]
    (dest / "policy.json").write_text(json.dumps(meta))
    return dest


def run(arm: str, name: str, updates: int, envs: int, steps: int, data: Path) -> list[dict]:
    spec = ARMS[arm]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    env |= {"GTR_DATA_DIR": str(data), "GTR_TORCH_THREADS": "1"}
    setting = {"train": "", "teacher": "", **spec["settings"][name]}
    text = BASE.format(
        warm=install_warm(data, env),
        name=name,
        algorithm=spec["algorithm"],
        envs=envs,
        steps=steps,
        updates=updates,
        **setting,
    )
    cfg = data / f"{arm}-{name}.toml"
    cfg.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "train", str(cfg)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        sys.exit(f"{arm}/{name}: gtr train failed\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    con = sqlite3.connect(data / "gtr.sqlite3")
    run_id = con.execute("SELECT max(id) FROM runs").fetchone()[0]
    rows = con.execute(
        "SELECT metrics FROM updates WHERE run_id = ? ORDER BY idx", (run_id,)
    ).fetchall()
    con.close()
    return [json.loads(m) for (m,) in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("arm", choices=sorted(ARMS))
    ap.add_argument("--updates", type=int, default=8)
    ap.add_argument("--envs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--data", type=Path, help="data folder (default: a temporary one)")
    ap.add_argument("--only", help="one setting (e.g. running): one run, several processes")
    args = ap.parse_args()
    spec = ARMS[args.arm]
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or Path(tmp)
        data.mkdir(parents=True, exist_ok=True)
        names = [args.only] if args.only else list(spec["settings"])
        out = {
            name: run(args.arm, name, args.updates, args.envs, args.steps, data) for name in names
        }
    key = spec["key"]
    extra = "turbo/malformed_frac" if args.arm == "turbo" else "grpo/degenerate_frac"
    print(f"| setting | {key} per update | mean | {extra}, mean |")
    print("|---|---|---|---|")
    for name, rows in out.items():
        vals = [float(m.get(key, float("nan"))) for m in rows]
        other = [float(m.get(extra, float("nan"))) for m in rows]
        mean = sum(vals) / len(vals)
        per = " ".join(f"{v:.3f}" for v in vals)
        print(f"| {name} | {per} | {mean:.3f} | {sum(other) / len(other):.3f} |")


if __name__ == "__main__":
    main()
