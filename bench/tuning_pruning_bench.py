"""What early stopping saves in a study's tuning stage (services/study/tuning.py, issue 55).

One invocation runs the same small study twice with `gtr study run --jobs 1`, each in a fresh
embedded store (its own data folder, SQLite), stopped once its tuning stage has chosen: GTR's
learning rate over a grid of choices on NumberLine (tiny model, a few updates, an evaluation
after every update), once with the median pruner and once with none. It prints, for each, the
updates the trial runs trained, the CPU seconds of the invocation's processes and its wall time,
the setting each selects and that setting's score in the unpruned search; then the cost ratio
(pruned / unpruned, by updates the trials trained and by CPU) and whether the pruned search
picked the same setting or one that scored as well without pruning.

    .venv/bin/python bench/tuning_pruning_bench.py --updates 6
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STUDY = """
name = "pruning-bench"
seeds = [0]
eval_episodes = {episodes}
[budget]
updates = 1
[tasks.numberline]
config = "{base}"
[tasks.numberline.base.env]
invalid_action = "{invalid}"
[tasks.numberline.base.init]
vision_steps = {vision_steps}
sft_samples = 32
sft_steps = {sft_steps}
[tasks.numberline.base.train]
num_envs = {envs}
num_steps = {steps}
minibatch_size = 8
ppo_epochs = 1
[tasks.numberline.base.metrics]
probe_states = 4
eval_every = 1
[arms.gtr]
algorithm = "gtr"
[tuning]
trials = {trials}
seeds = [100]
updates = {updates}
sampler = "grid"
pruner = "{pruner}"
startup_trials = {startup}
warmup = {warmup}
metric = {{ metric = "eval/success_rate", reduce = "mean" }}
[tuning.arms.gtr]
lr = {{ choices = [{lrs}] }}
"""


def one(pruner: str, args: argparse.Namespace) -> dict[str, object]:
    """The study, by `gtr study run` with a fresh data folder; its tuning stage's figures."""
    data = Path(tempfile.mkdtemp(prefix=f"tuning-bench-{pruner}-"))
    study = data / "study.toml"
    lrs = [float(x) for x in args.lrs.split(",")]
    study.write_text(
        STUDY.format(
            base=ROOT / "configs" / "numberline-tiny.toml",
            episodes=args.episodes,
            trials=len(lrs),
            updates=args.updates,
            pruner=pruner,
            lrs=", ".join(repr(x) for x in lrs),
            startup=args.startup_trials,
            warmup=args.warmup,
            invalid=args.invalid_action,
            vision_steps=args.vision_steps,
            sft_steps=args.sft_steps,
            envs=args.envs,
            steps=args.steps,
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ("GTR_DATABASE_URL", "GTR_REDIS_URL")}
    env["GTR_DATA_DIR"] = str(data)
    if args.model_dir:
        env["GTR_MODEL_DIR"] = args.model_dir
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    cli = [sys.executable, "-m", "services.cli", "study"]
    run = [*cli, "run", str(study), "--jobs", "1"]
    proc = subprocess.Popen(run, cwd=ROOT, env=env, stdout=sys.stderr)
    while proc.poll() is None and not _selected(data / "tuning.sqlite3"):
        time.sleep(0.5)
    if not _selected(data / "tuning.sqlite3"):
        raise SystemExit(f"gtr study run ended (exit {proc.returncode}) before its stage chose")
    proc.send_signal(signal.SIGTERM)  # the stage is over: stop before the grid's warm start
    proc.wait()
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = subprocess.run(
        [*cli, "report", "1", "--json"], cwd=ROOT, env=env, capture_output=True, check=True
    )
    (arm,) = json.loads(report.stdout)["tuning"]
    with sqlite3.connect(data / "gtr.sqlite3") as db:  # the trial runs: no grid cell
        (trained,) = db.execute(
            "SELECT SUM(updates_done) FROM runs WHERE study_id IS NULL"
        ).fetchone()
    return {
        "pruner": pruner,
        "updates_trained": trained,
        "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1),
        "wall_s": round(wall, 1),
        "pruned": sum(t["state"] == "pruned" for t in arm["trials"]),
        "selected": arm["selected"],
        "scores": {str(t["params"]["lr"]): t["score"] for t in arm["trials"]},
    }


def _selected(path: Path) -> bool:
    """Whether the stage made its choice (Optuna's study attribute `selected`)."""
    if not path.exists():
        return False
    try:
        with sqlite3.connect(path, timeout=5) as db:
            q = "SELECT COUNT(*) FROM study_user_attributes WHERE key = 'selected'"
            return bool(db.execute(q).fetchone()[0])
    except sqlite3.OperationalError:  # its tables not created yet
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--updates", type=int, default=6)
    # An update's size: the stage saves updates, so their cost against a trial run's fixed cost
    # (a process, the model, the start's evaluation copied) decides what pruning can save.
    ap.add_argument("--envs", type=int, default=2, help="train.num_envs of each run")
    ap.add_argument("--steps", type=int, default=4, help="train.num_steps of each run")
    ap.add_argument("--episodes", type=int, default=16)
    ap.add_argument("--lrs", default="0.0001,0.0003,0.001,0.003,0.01,0.03")
    ap.add_argument(
        "--startup-trials", type=int, default=1, help="median: trials completed before a prune"
    )
    ap.add_argument("--warmup", type=int, default=0, help="median: updates before a prune")
    ap.add_argument("--model-dir", default=None, help="GTR_MODEL_DIR (default: the settings')")
    # A warm start that plays, and an unreadable output that does not move: a trial whose lr
    # breaks the model then scores 0 instead of a random walk's luck (NumberLine's random play
    # finds the target about a quarter of the time, which hides every difference between lrs).
    ap.add_argument("--vision-steps", type=int, default=20, help="the warm start's vision steps")
    ap.add_argument("--sft-steps", type=int, default=10, help="the warm start's SFT steps")
    ap.add_argument(
        "--invalid-action", choices=("random", "noop"), default="random", help="env setting"
    )
    args = ap.parse_args()
    full = one("none", args)
    pruned = one("median", args)
    unpruned_scores = full["scores"]
    assert isinstance(unpruned_scores, dict)
    chosen = pruned["selected"] or {}
    best = max(v for v in unpruned_scores.values() if v is not None)
    got = unpruned_scores.get(str(chosen.get("lr")))
    print(json.dumps({"unpruned": full, "pruned": pruned}, indent=1))
    ratio_u = int(pruned["updates_trained"]) / max(1, int(full["updates_trained"]))  # type: ignore[call-overload]
    ratio_c = float(pruned["cpu_s"]) / max(1e-9, float(full["cpu_s"]))  # type: ignore[arg-type]
    verdict = "same or as good" if got is not None and got >= best else "worse"
    print(
        f"cost ratio (pruned / unpruned): updates {ratio_u:.2f}, CPU {ratio_c:.2f}; "
        f"selected lr {chosen.get('lr')} (unpruned score {got}) vs unpruned best {best} "
        f"(lr {full['selected']}): {verdict}"
    )


if __name__ == "__main__":
    main()
