"""A miniature reproduction of the GTR paper's comparison: gtr / rl4vlm / sft_only / noisy gtr
(and every newer arm whose config is in configs/repro/), judged by greedy held-out evaluation.

    .venv/bin/python bench/reproduce.py                        # warm starts, all runs, report
    .venv/bin/python bench/reproduce.py --tasks ezpoints --seeds 0 --updates 5 --jobs 2  # pilot
    .venv/bin/python bench/reproduce.py --plan "ezpoints:0:sft10" --arms gtr,sft_only  # a variant
    .venv/bin/python bench/reproduce.py --report-only           # rebuild the page from the CSV
    .venv/bin/python bench/reproduce.py --collect-only --seeds 0,1   # keep a stopped study's runs

Per task: one warm start (``gtr sft configs/repro/TASK-warm.toml``) shared by every arm; then
each (arm, seed) is one ``gtr train`` of ``configs/repro/TASK.toml`` with the arm's changes from
``configs/repro/arms.toml`` (so arms differ only in what they name), in its own process and data
folder (SQLite, blobs, checkpoints), ``--jobs`` at a time. The per-update metrics are read back
from each run's SQLite file and merged into ``docs/results/updates.csv`` (rows of runs not on this
machine are kept, so a study can be split across sessions and machines); the conclusion, tables and
curves are written into ``docs/results.md`` (between the GENERATED markers) and
``docs/results/*.png``. ``--report-only`` rebuilds them from the CSV alone.
A variant (``configs/repro/variants.toml``) changes settings of every arm alike; its runs are
reported as their own group. Finished runs are never run again, so an interrupted study resumes.
Every row names the start model its run began from (``warm_start``, a hash of the weights): the
same warm-start recipe trains different weights on a different CPU, so runs are grouped, paired
and skipped as done only with runs from the same weights. Each task's warm start is kept in
``docs/results/warm/TASK`` once made (commit it with the results); a study on another machine
installs it instead of running ``gtr sft`` again.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import html
import json
import math
import os
import platform
import re
import shutil
import sqlite3
import subprocess
import sys
import time
import tomllib
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs" / "repro"  # arms.toml, variants.toml, TASK-warm.toml
# Where TASK.toml and the warm starts come from (--config-dir, --warm-from: a 7B GPU study).
STUDY = {"configs": CONFIGS, "warm": Path()}
# The study's warm starts are kept beside its results (RESULTS/warm/TASK, in git): the same recipe
# trains other weights on another CPU, so a study continued on another machine starts from these
# (3.8 MB per tiny task), not from a new gtr sft.
KEPT = "warm"
GTR = str(ROOT / ".venv" / "bin" / "gtr")
TASKS = ("ezpoints", "points24", "numberline")
ARMS = ("gtr", "rl4vlm", "sft_only", "gtr_noise")
# The paper's claim, in the order it states it: GTR > SFT-only > RL4VLM (greedy success).
ORDER = ("gtr", "sft_only", "rl4vlm")
JUDGE = "eval/success_rate"  # greedy play of fixed held-out deals (metrics.eval_episodes)
UNKNOWN_WARM = "unknown"  # warm_start of a run whose start model's weights are not there to hash
BEGIN, END = "<!-- BEGIN GENERATED (bench/reproduce.py) -->", "<!-- END GENERATED -->"

# (metric key in updates.metrics, column title, how to summarise over updates)
TABLE = [
    (JUDGE, "greedy SR final", "final"),
    (JUDGE, "greedy SR best", "best"),
    (JUDGE, "greedy SR, mean of 2nd-half evals", "late"),
    ("success_rate", "peak SR (upd ≥ 1)", "peak"),
    ("success_rate", "final SR", "final"),
    ("late_success", "SR last 5 upd", "final"),
    ("episode_return", "final ER", "final"),
    ("late_return", "ER last 5 upd", "final"),
    ("probe_relevance", "probe relevance", "final"),
    ("probe_top_thought_share", "top-thought share", "final"),
    ("probe_distinct_thoughts", "distinct thoughts", "final"),
    ("thought_length", "thought length (words)", "final"),
    ("probe_format_valid_rate", "probe JSON valid", "final"),
    ("corrected_rate", "corrected rate", "final"),
    ("explained_variance", "value expl. var.", "final"),
    ("run_minutes", "wall min/run", "final"),
    ("cpu_minutes", "CPU min/run", "final"),
    ("corrector_calls", "corrections", "final"),
    ("corrector_api_calls", "corrector API calls", "final"),
    ("corrector_seconds", "corrector s", "final"),
]
CURVES = [
    (JUDGE, "greedy success (held-out deals)"),
    ("success_rate", "training success rate (window)"),
    ("episode_return", "episode return"),
    ("probe_relevance", "probe state relevance"),
    ("probe_top_thought_share", "probe top-thought share"),
    ("probe_distinct_thoughts", "probe distinct thoughts"),
    ("thought_length", "thought length (words)"),
    ("probe_format_valid_rate", "probe JSON valid"),
    ("corrected_rate", "corrected rate"),
    # Before clipping. Without train.clip_per_loss the SFT term is in grad_norm and clipped with
    # it; with it, grad_norm is PPO+value alone and grad_norm/sft the SFT term's own.
    ("grad_norm", "gradient norm (all terms; PPO+value if clip_per_loss)"),
    ("grad_norm/sft", "gradient norm (thought SFT, clip_per_loss)"),
    ("explained_variance", "value explained variance"),
    ("sft_samples", "DAgger buffer size"),
]


@dataclass(frozen=True)
class Job:
    """One subprocess: a warm start or a training run."""

    name: str
    cmd: list[str]
    data_dir: Path  # its own GTR_DATA_DIR
    log: Path


# ---- running --------------------------------------------------------------------------------


def child_env(data_dir: Path, models: Path) -> dict[str, str]:
    """Embedded mode in a private data folder; one torch thread so `--jobs` share the cores."""
    env = {k: v for k, v in os.environ.items() if k not in ("GTR_DATABASE_URL", "GTR_REDIS_URL")}
    env |= {"GTR_DATA_DIR": str(data_dir), "GTR_MODEL_DIR": str(models), "GTR_TORCH_THREADS": "1"}
    unset = ("GTR_BLOB_DIR", "GTR_CHECKPOINT_DIR", "GTR_ENV_SERVICE_URL", "GTR_POLICY_SERVICE_URL")
    for k in unset:
        env.pop(k, None)
    return env


def run_jobs(jobs: list[Job], parallel: int, models: Path) -> dict[str, float]:
    """Run the jobs, `parallel` at a time; returns wall seconds per job; fails on a bad exit."""
    pending = list(jobs)
    running: list[tuple[Job, subprocess.Popen[bytes], float]] = []
    walls: dict[str, float] = {}
    while pending or running:
        while pending and len(running) + others(running, models) < parallel:
            job = pending.pop(0)
            if (job.data_dir / "gtr.sqlite3").exists():
                # planning emptied the folder, so another driver whose plan overlaps ours has
                # started this run since: two drivers never train one run twice into one folder
                print(f"skip  {job.name}: another reproduce.py started it", flush=True)
                continue
            job.data_dir.mkdir(parents=True, exist_ok=True)
            with open(job.log, "w") as log:
                proc = subprocess.Popen(
                    job.cmd,
                    cwd=ROOT,
                    env=child_env(job.data_dir, models),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            running.append((job, proc, time.monotonic()))
            print(f"[{stamp()}] start {job.name}", flush=True)
        time.sleep(2)
        for item in list(running):
            job, proc, started = item
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid == 0:
                continue
            proc.returncode = os.waitstatus_to_exitcode(status)
            running.remove(item)
            walls[job.name] = time.monotonic() - started
            cpu = {
                "cpu_seconds": usage.ru_utime + usage.ru_stime,
                "wall_seconds": walls[job.name],
                "load_1min": os.getloadavg()[0],
            }
            (job.data_dir / "usage.json").write_text(json.dumps(cpu))
            print(
                f"[{stamp()}] done  {job.name} rc={proc.returncode} "
                f"{walls[job.name]:.0f}s  load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
            if proc.returncode != 0:
                print(f"  see {job.log}", flush=True)
    return walls


def others(running: list[Any], models: Path) -> int:
    """`gtr train` processes of this output folder started by another reproduce.py."""
    pattern = f"gtr train {models.parent / 'runs'}/"
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return max(0, len(found.split()) - len(running))


def carry_warm(task: str, src: Path, dest: Path, models: Path) -> None:
    """Install the study's kept warm start (``RESULTS/warm/TASK``) as this machine's: its weights
    as they are, its base folder (config, tokenizer; the weights replace the base's) built here
    as ``gtr sft`` builds it, and ``policy.json`` pointed at that folder."""
    meta = json.loads((src / "policy.json").read_text())
    base = models / Path(meta["base_model"]).name
    with open(CONFIGS / f"{task}-warm.toml", "rb") as fh:
        model = tomllib.load(fh).get("model", {})
    build = (
        "import sys, json; from shared.schemas import ModelConfig; "
        "from services.trainer.warmstart import base_model_path; "
        "print(base_model_path(ModelConfig.model_validate(json.loads(sys.argv[1])), sys.argv[2]))"
    )
    env = child_env(models.parent / "warm-data" / task, models)
    built = subprocess.run(
        [sys.executable, "-c", build, json.dumps(model), task],
        cwd=ROOT, env=env | {"PYTHONPATH": str(ROOT)}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if built.returncode != 0 or Path(built.stdout.split()[-1]) != base:
        sys.exit(f"could not build the base model {base} of {src}:\n{built.stderr[-2000:]}")
    copy_warm(src, dest, str(base))
    print(f"warm/{task}: the study's kept warm start {warm_identity(dest)['warm_start']}")


def keep_warm(task: str, warm: Path, results: Path) -> None:
    """Keep a warm start just made beside the results (committed with them), unless one is."""
    kept = results / KEPT / task
    if (kept / "policy.json").exists() or not (warm / "policy.json").exists():
        return
    base = json.loads((warm / "policy.json").read_text())["base_model"]
    copy_warm(warm, kept, Path(base).name)  # the base is rebuilt by carry_warm where it is used
    print(f"warm/{task}: kept in {kept} (commit it with the results)")


def copy_warm(src: Path, dest: Path, base_model: str) -> None:
    """A warm-start checkpoint folder copied, its ``policy.json`` naming ``base_model``."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "policy.json":
            shutil.copy2(f, dest / f.name)
    meta = json.loads((src / "policy.json").read_text()) | {"base_model": base_model}
    (dest / "policy.json").write_text(json.dumps(meta, indent=2) + "\n")


def warm_jobs(tasks: list[str], out: Path, results: Path) -> list[Job]:
    """`gtr sft` per task whose warm start is not there yet (none kept in RESULTS/warm/TASK)."""
    jobs = []
    for task in tasks:
        dest = out / "warm" / task
        if (dest / "policy.json").exists():
            continue
        if (results / KEPT / task / "policy.json").exists():
            carry_warm(task, results / KEPT / task, dest, out / "models")
            continue
        cmd = [
            GTR,
            "sft",
            str(CONFIGS / f"{task}-warm.toml"),
            "--out",
            str(dest),
            "--eval-episodes",
            "60",
        ]
        jobs.append(Job(f"warm/{task}", cmd, out / "warm-data" / task, out / f"warm-{task}.log"))
    return jobs


def run_name(task: str, arm: str, seed: int, variant: str = "") -> str:
    return f"{task}-{arm}-s{seed}" + (f"-{variant}" if variant else "")


def run_config(
    task: str, arm: str, seed: int, out: Path, updates: int | None, variant: str = ""
) -> dict[str, Any]:
    """The task's shared TOML with the arm's changes, this seed, the task's warm start, the
    variant's changes (applied to every arm alike) and (optionally) fewer updates."""
    with open(STUDY["configs"] / f"{task}.toml", "rb") as f:
        cfg = tomllib.load(f)
    cfg["seed"] = seed
    cfg["name"] = "repro-" + run_name(task, arm, seed, variant)
    warm = STUDY["warm"] if STUDY["warm"] != Path() else out / "warm"
    cfg["init"]["checkpoint"] = str((warm / task).resolve())
    for key, value in [*arm_changes(arm).items(), *variant_changes(variant).items()]:
        section, _, field = key.rpartition(".")
        (cfg.setdefault(section, {}) if section else cfg)[field] = value
    if updates:
        cfg["train"]["num_updates"] = updates
    return cfg


@cache  # read once per process, as variants.toml is
def arms_table() -> dict[str, dict[str, Any]]:
    with open(CONFIGS / "arms.toml", "rb") as f:
        return tomllib.load(f)


def arm_changes(arm: str) -> dict[str, Any]:
    """The dotted-key changes that make an arm (configs/repro/arms.toml)."""
    table = arms_table()
    if arm not in table:
        sys.exit(f"no arm {arm!r} in {CONFIGS / 'arms.toml'} (arms: {', '.join(table)})")
    return {k: v for k, v in table[arm].items() if k != "description"}


# Keys of a variant that describe it rather than change the run config.
VARIANT_META = ("description", "unchanged")


@cache  # read once per process: the driver asks for every run it plans, the report per group
def variants() -> dict[str, dict[str, Any]]:
    with open(CONFIGS / "variants.toml", "rb") as f:
        return tomllib.load(f)


def variant_changes(variant: str) -> dict[str, Any]:
    """The dotted-key changes of a variant in configs/repro/variants.toml ({} for none)."""
    if not variant:
        return {}
    table = variants()
    if variant not in table:
        sys.exit(f"no variant {variant!r} in {CONFIGS / 'variants.toml'}")
    return {k: v for k, v in table[variant].items() if k not in VARIANT_META}


@cache
def unchanged_arms(variant: str) -> tuple[str, ...]:
    """The arms a variant leaves as they are (its ``unchanged`` list: e.g. a split of the PPO and
    SFT gradients on an arm that has only one of them): not run under it, their base runs stand
    in. A variant no longer in variants.toml (an old CSV's) has none."""
    listed = variants().get(variant, {}).get("unchanged", []) if variant else []
    known = arms_table()
    if not isinstance(listed, list) or not set(listed) <= set(known):
        sys.exit(
            f"{CONFIGS / 'variants.toml'} [{variant}]: unchanged = {listed!r} must list arms of "
            f"{CONFIGS / 'arms.toml'} ({', '.join(known)})"
        )
    return tuple(listed)


def plan_items(
    tasks: list[str],
    seeds: list[int],
    task_seeds: dict[str, list[int]],
    variant: str,
    plan: str,
) -> list[tuple[str, int, str]]:
    """(task, seed, variant) in run order: --plan as given, else seed by seed, task by task."""
    if plan:
        items = [item.split(":") for item in plan.split(",")]
        return [(t, int(seed), v) for t, seed, v in items]
    return [(t, seed, variant) for seed in seeds for t in tasks if seed in task_seeds.get(t, seeds)]


def recorded(rows: list[dict[str, Any]], out: Path, updates: int | None) -> set[str]:
    """Run names whose every update is already in the results CSV: a study resumed in another
    session (or on another machine) without this run's folder does not run it again."""
    warm = STUDY["warm"] if STUDY["warm"] != Path() else out / "warm"
    current = {
        t: warm_identity(warm / t)["warm_start"] for t in {r["task"] for r in rows}
    }  # a run from another start model (another machine's warm start) is not this one's
    last: dict[tuple[str, str, int, str], int] = {}
    for r in rows:
        if r.get("warm_start", "") != current[r["task"]] or current[r["task"]] == UNKNOWN_WARM:
            continue
        key = (r["task"], r["arm"], r["seed"], r.get("variant", ""))
        last[key] = max(last.get(key, -1), r["update"])
    done = set()
    for (task, arm, seed, variant), top in last.items():
        if not (STUDY["configs"] / f"{task}.toml").exists():
            continue
        cfg = run_config(task, arm, seed, out, updates, variant)
        if top >= cfg["train"]["num_updates"] - 1:
            done.add(run_name(task, arm, seed, variant))
    return done


def train_jobs(
    items: list[tuple[str, int, str]],
    arms: list[str],
    out: Path,
    updates: int | None,
    done: Collection[str] = (),
) -> list[Job]:
    """`gtr train` per (task, seed, variant) and arm not completed yet, in order; a run another
    process is driving right now, and one the results CSV already holds (`done`), are left
    alone."""
    jobs = []
    for task, seed, variant in items:
        for arm in arms:
            name = run_name(task, arm, seed, variant)
            run_dir = out / "runs" / name
            if arm in unchanged_arms(variant):
                print(f"skip  {name}: {variant} leaves {arm} as it is; its base run stands in")
                continue
            if name in done and run_status(run_dir) != "completed":
                print(f"skip  {name}: its updates are in the results CSV", flush=True)
                continue
            if run_status(run_dir) == "completed" or is_live(run_dir):
                continue
            if run_dir.exists():  # a half-finished run restarts from scratch
                for p in sorted(run_dir.rglob("*"), reverse=True):
                    p.unlink() if p.is_file() else p.rmdir()
            run_dir.mkdir(parents=True, exist_ok=True)
            cfg_path = run_dir / "config.toml"
            cfg_path.write_text(to_toml(run_config(task, arm, seed, out, updates, variant)))
            cmd = [GTR, "train", str(cfg_path)]
            jobs.append(Job(name, cmd, run_dir / "data", run_dir / "train.log"))
    return jobs


def is_live(run_dir: Path, stale_s: float = 120.0) -> bool:
    """Whether the run is 'running' with a fresh heartbeat (another driver is on it)."""
    db = run_dir / "data" / "gtr.sqlite3"
    if run_status(run_dir) != "running":
        return False
    with sqlite3.connect(db) as con:
        (beat,) = con.execute("SELECT heartbeat_at FROM runs ORDER BY id DESC LIMIT 1").fetchone()
    if not beat:
        return False
    last = datetime.fromisoformat(beat).replace(tzinfo=UTC)
    return (datetime.now(UTC) - last).total_seconds() < stale_s


def to_toml(cfg: dict[str, Any]) -> str:
    """A flat TOML writer for run configs (scalars at the top, one table per section)."""

    def val(v: Any) -> str:
        return json.dumps(v) if isinstance(v, str | bool) or v is None else repr(v)

    top = [f"{k} = {val(v)}" for k, v in cfg.items() if not isinstance(v, dict)]
    tables = [
        f"\n[{k}]\n" + "\n".join(f"{kk} = {val(vv)}" for kk, vv in v.items())
        for k, v in cfg.items()
        if isinstance(v, dict)
    ]
    return "\n".join(top) + "\n" + "\n".join(tables) + "\n"


# ---- collecting -----------------------------------------------------------------------------


def run_status(run_dir: Path) -> str | None:
    db = run_dir / "data" / "gtr.sqlite3"
    if not db.exists():
        return None
    with sqlite3.connect(db) as con:
        row = con.execute("SELECT status FROM runs ORDER BY id DESC LIMIT 1").fetchone()
    return row[0] if row else None


def read_updates(run_dir: Path) -> list[dict[str, Any]]:
    """Every update's metrics of the run in run_dir, with env_steps added, in order."""
    db = run_dir / "data" / "gtr.sqlite3"
    with sqlite3.connect(db) as con:
        run_id, config = con.execute(
            "SELECT id, config FROM runs ORDER BY id DESC LIMIT 1"
        ).fetchone()
        rows = con.execute(
            "SELECT idx, metrics, created_at FROM updates WHERE run_id = ? ORDER BY idx", (run_id,)
        ).fetchall()
    cfg = json.loads(config)
    per_update = cfg["train"]["num_envs"] * cfg["train"]["num_steps"]
    out = []
    for idx, metrics, created in rows:
        m = json.loads(metrics)
        if not m.get("trained"):
            continue
        out.append(
            {
                "update": idx,
                "env_steps": (idx + 1) * per_update,
                "created_at": created,
                **{k: v for k, v in m.items() if isinstance(v, int | float)},
            }
        )
    return out


def collect(out: Path, tasks: list[str], arms: list[str], seeds: list[int]) -> list[dict[str, Any]]:
    """Every update of every completed run (base and variants), tagged with its group."""
    rows = []
    warms: dict[str, dict[str, Any]] = {}  # warm folder -> its identity: hashed once
    for task in tasks:
        for variant in variants_found(out, task):
            for arm in arms:
                for seed in seeds:
                    run_dir = out / "runs" / run_name(task, arm, seed, variant)
                    if run_status(run_dir) != "completed":
                        continue
                    with open(run_dir / "config.toml", "rb") as f:
                        start = tomllib.load(f)["init"]["checkpoint"]
                    if start not in warms:
                        warms[start] = warm_identity(Path(start))
                    warm = warms[start]
                    group = group_name(task, variant, warm["warm_start"])
                    updates = read_updates(run_dir)
                    updates[-1] |= (
                        late_episodes(run_dir, len(updates) - 5)
                        | run_minutes(run_dir)
                        | corrector_cost(run_dir)
                        | final_outputs(run_dir)
                    )
                    for u in updates:
                        rows.append(
                            {
                                "group": group,
                                "task": task,
                                "variant": variant,
                                "arm": arm,
                                "seed": seed,
                                **warm,
                                **u,
                            }
                        )
    return rows


def final_outputs(run_dir: Path) -> dict[str, str]:
    """``greedy_samples``: what the run's final checkpoint writes on the first held-out deals
    (bench/greedy_samples.py, run once per run folder and kept there), as one JSON string for the
    CSV, so that --report-only can show outputs too; {} when it cannot be had (reported)."""
    kept = run_dir / "greedy_samples.json"
    if not kept.exists():
        done = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "greedy_samples.py"), str(run_dir)],
            cwd=ROOT, env=child_env(run_dir / "data", run_dir.parent.parent / "models"),
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        try:
            if done.returncode != 0:
                raise ValueError(done.stderr.strip()[-300:])
            samples = json.loads(done.stdout)
        except ValueError as e:  # a run whose outputs cannot be had is still reported
            print(f"  {run_dir.name}: no greedy samples: {e}", flush=True)
            return {}
        kept.write_text(json.dumps(samples))
    return {"greedy_samples": json.dumps(json.loads(kept.read_text()))}


def late_episodes(run_dir: Path, first_update: int) -> dict[str, float]:
    """Success and return of the training episodes begun in updates >= first_update."""
    with sqlite3.connect(run_dir / "data" / "gtr.sqlite3") as con:
        n, sr, er = con.execute(
            "SELECT count(*), avg(success), avg(total_return) FROM episodes"
            " WHERE finished AND update_idx >= ?",
            (first_update,),
        ).fetchone()
    return {"late_success": sr, "late_return": er, "late_episodes": n} if n else {}


def run_minutes(run_dir: Path) -> dict[str, float]:
    """Wall minutes of the run, warm-start load to the last update (others' load included)."""
    with sqlite3.connect(run_dir / "data" / "gtr.sqlite3") as con:
        start, end = con.execute(
            "SELECT started_at, finished_at FROM runs ORDER BY id DESC LIMIT 1"
        ).fetchone()
    if not (start and end):
        return {}
    span = datetime.fromisoformat(end) - datetime.fromisoformat(start)
    return {"run_minutes": span.total_seconds() / 60}


def corrector_cost(run_dir: Path) -> dict[str, float]:
    """What the run's corrector cost: finished corrections (``corrector_calls``, the key older
    studies wrote), requests sent to an endpoint (``corrector_api_calls``, retries included;
    0 for the oracle and the self-teacher, which call nothing), tokens, seconds of latency
    (summed), and the CPU minutes of the whole `gtr train` process (written by run_jobs)."""
    with sqlite3.connect(run_dir / "data" / "gtr.sqlite3") as con:
        calls, tokens, ms = con.execute(
            "SELECT count(*), coalesce(sum(tokens), 0), coalesce(sum(latency_ms), 0)"
            " FROM corrections WHERE status != 'pending'"
        ).fetchone()
        (api_calls,) = con.execute("SELECT coalesce(sum(calls), 0) FROM corrector_spend").fetchone()
    out = {
        "corrector_calls": float(calls),
        "corrector_api_calls": float(api_calls),
        "corrector_tokens": float(tokens),
        "corrector_seconds": ms / 1000,
    }
    usage = run_dir / "data" / "usage.json"
    if usage.exists():
        out["cpu_minutes"] = json.loads(usage.read_text())["cpu_seconds"] / 60
    return out


def warm_identity(warm: Path) -> dict[str, Any]:
    """Which start model a run began from: a hash of its weights (the same recipe trains other
    weights on another CPU, so arms are only comparable where this matches) and its greedy
    figures from ``warm_start.json``, kept in every row so the CSV alone can report it."""
    weights = sorted(warm.glob("*.safetensors"))
    if not weights:  # gone (or never made): no run can be matched with it
        return {"warm_start": UNKNOWN_WARM}
    h = hashlib.sha256()
    for f in weights:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    out: dict[str, Any] = {"warm_start": h.hexdigest()[:8]}
    info = warm / "warm_start.json"
    if info.exists():
        w = json.loads(info.read_text())
        out |= {f"warm/{k}": w[k] for k in ("eval/success", "eval/read", "eval/json") if k in w}
    return out


def group_name(task: str, variant: str, warm: str) -> str:
    """A group: runs compared with each other (one task, variant and warm start). Rows from
    before the warm start was recorded (no hash) keep the plain name."""
    name = f"{task} [{variant}]" if variant else task
    return f"{name} (warm {warm})" if warm else name


def variants_found(out: Path, task: str) -> list[str]:
    """ "" (the base settings) first, then the variants that have run folders for the task."""
    names = [p.name.split("-", 3) for p in (out / "runs").glob(f"{task}-*")]
    return ["", *sorted({n[3] for n in names if len(n) == 4})]


def read_csv(path: Path) -> list[dict[str, Any]]:
    """The rows write_csv wrote (numbers back as numbers, empty cells dropped)."""
    if not path.exists():
        return []
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            row: dict[str, Any] = {}
            for k, v in r.items():
                if v == "":
                    continue
                if k in ("seed", "update", "env_steps"):
                    row[k] = int(float(v))
                elif k in ("group", "task", "variant", "arm", "created_at", "warm_start"):
                    row[k] = v
                else:  # "2" stays an int and "2.0" a float: --report-only rewrites the same CSV
                    try:
                        row[k] = int(v) if v.lstrip("-").isdigit() else float(v)
                    except ValueError:
                        row[k] = v
            row.setdefault("variant", "")
            rows.append(row)
    return rows


def merge(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The CSV's rows with every run collected now replacing its old rows (studies append
    across sessions and machines: a run folder need not be on this machine to be reported)."""
    fresh = {(r["group"], r["arm"], r["seed"]) for r in new}
    return [r for r in old if (r["group"], r["arm"], r["seed"]) not in fresh] + new


def groups(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["group"] for r in rows))


def with_base_runs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows the page shows: a variant's group also holds the base group's runs (same task
    and warm start) of the arms the variant leaves unchanged, marked ``stands_in``, so that its
    changed arms are judged and paired against them on the same seeds. The CSV keeps only the
    rows of runs that ran."""
    out = list(rows)
    have = {(r["group"], r["arm"]) for r in rows}
    for group in groups(rows):
        first = next(r for r in rows if r["group"] == group)
        if not first.get("warm_start"):  # an early group: which start its base runs had is lost
            continue
        base = group_name(first["task"], "", first["warm_start"])
        for arm in unchanged_arms(first.get("variant", "")):
            if (group, arm) not in have:
                out += [
                    r | {"group": group, "variant": first["variant"], "stands_in": base}
                    for r in rows
                    if r["group"] == base and r["arm"] == arm
                ]
    return out


def stand_ins(rows: list[dict[str, Any]], group: str) -> list[str]:
    """The arms of a group shown from its base group (with_base_runs)."""
    arms = {r["arm"] for r in rows if r["group"] == group and r.get("stands_in")}
    return [a for a in ORDER if a in arms] + sorted(arms - set(ORDER))


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    keys = ["group", "task", "variant", "arm", "seed", "update", "env_steps", "created_at"]
    extra = sorted({k for r in rows for k in r} - set(keys))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys + extra)
        w.writeheader()
        w.writerows(rows)


def series(rows: list[dict[str, Any]], group: str, arm: str, key: str) -> dict[int, list[float]]:
    """seed -> the metric's values in update order (NaN where an update lacks it)."""
    out: dict[int, list[float]] = {}
    for r in rows:
        if r["group"] == group and r["arm"] == arm:
            out.setdefault(r["seed"], []).append(float(r.get(key, math.nan)))
    return out


def summarise(values: list[float], how: str) -> float:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return math.nan
    if how == "peak":  # update 0's rollout comes from the shared warm start: skip it
        return max(finite[1:] or finite)
    if how == "best":
        return max(finite)
    if how == "first":
        return finite[0]
    if how == "late":  # a 64-deal evaluation moves by ±0.1: the mean of the run's second half
        late = [v for v in values[len(values) // 2 :] if not math.isnan(v)]
        return sum(late) / len(late) if late else math.nan
    return finite[-1]


def mean_sd(xs: list[float]) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "–"
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return f"{m:.2f}"
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return f"{m:.2f} ± {sd:.2f}"


def table_md(rows: list[dict[str, Any]], arms: list[str]) -> str:
    """Per group: the task's warm start row, then one row per arm (mean ± sd over its seeds)."""
    head = "| task | arm | seeds | " + " | ".join(t for _, t, _ in TABLE) + " |"
    lines = [head, "|" + "---|" * (len(TABLE) + 3)]
    for group in groups(rows):
        w = next((r for r in rows if r["group"] == group and "warm/eval/success" in r), None)
        if w is not None:
            known = {
                "greedy SR final": w["warm/eval/success"],
                "probe relevance": w.get("warm/eval/read", math.nan),
                "probe JSON valid": w.get("warm/eval/json", math.nan),
            }
            cells = [f"{known[t]:.2f}" if t in known else "" for _, t, _ in TABLE]
            label = f"warm start {w['warm_start']}" if w.get("warm_start") else "warm start"
            lines.append(
                f"| {group} | {label} (greedy, 60 episodes) | – | " + " | ".join(cells) + " |"
            )
        same = stand_ins(rows, group)
        for arm in arms:
            per_seed = {k: series(rows, group, arm, k) for k, _, _ in TABLE}
            seeds = sorted(per_seed["success_rate"])
            if not seeds:
                continue
            cells = [
                mean_sd([summarise(per_seed[k][s], how) for s in seeds]) for k, _, how in TABLE
            ]
            label = f"{arm} (base run)" if arm in same else arm
            lines.append(f"| {group} | {label} | {len(seeds)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def final_per_seed(
    rows: list[dict[str, Any]], group: str, arm: str, key: str, how: str = "final"
) -> dict[int, float]:
    """seed -> the metric summarised over that seed's run (its last finite value by default)."""
    return {seed: summarise(v, how) for seed, v in series(rows, group, arm, key).items()}


def pairs(arms: list[str]) -> list[tuple[str, str]]:
    """The paper's ordering pair by pair, then every other arm against gtr and against rl4vlm
    (a new method is judged by both: does it reach GTR, does it beat plain RL)."""
    present = [a for a in ORDER if a in arms]
    out = list(zip(present, present[1:], strict=False))
    if "gtr" in arms and "rl4vlm" in arms and ("gtr", "rl4vlm") not in out:
        out.append(("gtr", "rl4vlm"))  # the headline gap, also where sft_only sits between
    others = [a for a in arms if a not in ORDER]
    return out + [(a, base) for base in ("gtr", "rl4vlm") if base in arms for a in others]


def paired_md(rows: list[dict[str, Any]], arms: list[str]) -> str:
    """Per group and pair: greedy success A - B on the seeds both ran (same warm start, same env
    seeds), final and as the mean of the second half's evaluations: mean ± sd, and on how many
    seeds A won, tied, lost."""
    lines = [
        "| task | A vs B | seeds | final: mean A − B | final: A won / tied / lost "
        "| 2nd half: mean A − B | 2nd half: A won / tied / lost |",
        "|---|---|---|---|---|---|---|",
    ]
    for group in groups(rows):
        for a, b in pairs(arms):
            final, late = (paired_diffs(rows, group, a, b, how) for how in ("final", "late"))
            if final:
                lines.append(
                    f"| {group} | {a} vs {b} | {len(final)} | {_wins(final)} | {_wins(late)} |"
                )
    return "\n".join(lines)


def paired_diffs(rows: list[dict[str, Any]], group: str, a: str, b: str, how: str) -> list[float]:
    """A − B of the greedy success summarised by `how`, on each seed both arms have it."""
    fa, fb = (final_per_seed(rows, group, x, JUDGE, how) for x in (a, b))
    common = sorted(
        s for s in fa.keys() & fb.keys() if not (math.isnan(fa[s]) or math.isnan(fb[s]))
    )
    return [fa[s] - fb[s] for s in common]


def _wins(d: list[float]) -> str:
    """Two table cells: the mean ± sd of the differences, and A won / tied / lost."""
    won, lost = sum(x > 1e-9 for x in d), sum(x < -1e-9 for x in d)
    return f"{mean_sd(d)} | {won} / {len(d) - won - lost} / {lost}"


def _mean(xs: list[float]) -> float:
    return _nanmean(tuple(xs))


def conclusion_md(
    rows: list[dict[str, Any]], max_share: float = 0.5, min_relevance: float = 0.3
) -> str:
    """One paragraph per group, computed from the table's own numbers: does GTR > SFT-only >
    RL4VLM hold on final greedy success (means and paired wins), and did RL4VLM's probe thoughts
    collapse (top-thought share > max_share or relevance < min_relevance) while GTR's did not?"""
    out = [] if rows else ["- No finished run in `docs/results/updates.csv` yet."]
    for group in groups(rows):
        finals = {
            a: {s: v for s, v in final_per_seed(rows, group, a, JUDGE).items() if not math.isnan(v)}
            for a in ORDER
        }
        if not all(finals.values()):
            missing = [a for a, f in finals.items() if not f]
            out.append(
                f"- **{group}**: not judged: no run of {', '.join(missing)} with a greedy "
                "evaluation (metrics.eval_episodes) has finished."
            )
            continue
        # Judged on the seeds every arm has finished: a mean over other seeds of one arm than of
        # another compares deals and starts, not arms (one seed moves the greedy figure by 0.3).
        shared = set.intersection(*(set(f) for f in finals.values()))
        if not shared:
            out.append(
                f"- **{group}**: not judged: no seed has finished for all of {', '.join(ORDER)}."
            )
            continue
        m = {a: _mean([f[s] for s in sorted(shared)]) for a, f in finals.items()}
        n = len(shared)
        extra = sorted({s for f in finals.values() for s in f} - shared)
        wins = []
        for a, b in zip(ORDER, ORDER[1:], strict=False):
            common = shared  # the seeds the means above are over, so both cite one n
            wins.append(
                f"{a} beat {b} on {sum(finals[a][s] > finals[b][s] for s in common)}"
                f" of {len(common)} seeds"
            )
        holds = m["gtr"] > m["sft_only"] > m["rl4vlm"]
        late = {
            a: _mean([final_per_seed(rows, group, a, JUDGE, "late")[s] for s in sorted(shared)])
            for a in ORDER
        }
        late_verdict = (
            "holds" if late["gtr"] > late["sft_only"] > late["rl4vlm"] else "does not hold"
        )
        share = {
            a: _mean(list(final_per_seed(rows, group, a, "probe_top_thought_share").values()))
            for a in ("gtr", "rl4vlm")
        }
        rel = {
            a: _mean(list(final_per_seed(rows, group, a, "probe_relevance").values()))
            for a in ("gtr", "rl4vlm")
        }
        collapsed = {a: share[a] > max_share or rel[a] < min_relevance for a in share}
        verdict = "holds" if holds else "does **not** hold"
        collapse = (
            "RL4VLM's probe thoughts collapsed and GTR's did not"
            if collapsed["rl4vlm"] and not collapsed["gtr"]
            else "no collapse contrast: "
            + (
                "both collapsed"
                if all(collapsed.values())
                else "GTR collapsed, RL4VLM did not"
                if collapsed["gtr"]
                else "neither collapsed"
            )
        )
        many = "s" if len(extra) > 1 else ""
        unpaired = (
            f"; seed{many} {', '.join(map(str, extra))} of some arms left out" if extra else ""
        )
        out.append(
            f"- **{group}** ({n} seed{'s' if n != 1 else ''} finished by every arm"
            f"{', preliminary: fewer than the 3 the study asks for' if n < 3 else ''}"
            f"{unpaired}; final greedy success on them): gtr {m['gtr']:.2f}, "
            f"sft_only {m['sft_only']:.2f}, rl4vlm {m['rl4vlm']:.2f}: the paper's ordering "
            f"{verdict} ({'; '.join(wins)}); by the mean of the second half's evaluations "
            f"gtr {late['gtr']:.2f}, sft_only {late['sft_only']:.2f}, rl4vlm "
            f"{late['rl4vlm']:.2f}: it {late_verdict}. Probe at the last update: top-thought share "
            f"gtr {share['gtr']:.2f} / rl4vlm {share['rl4vlm']:.2f}, relevance gtr "
            f"{rel['gtr']:.2f} / rl4vlm {rel['rl4vlm']:.2f}: {collapse}."
        )
    for j, group in enumerate(groups(rows)):  # the loop above wrote one line per group
        drift = thought_drift(rows, group, max_share, min_relevance)
        if drift:
            out[j] += " " + drift
        if same := stand_ins(rows, group):
            variant = next(r["variant"] for r in rows if r["group"] == group)
            out[j] += (
                f" {', '.join(same)}: the base group's runs, which {variant} leaves as they are"
                " (`unchanged` in configs/repro/variants.toml)."
            )
    return "\n".join(out)


def thought_drift(
    rows: list[dict[str, Any]], group: str, max_share: float, min_relevance: float
) -> str:
    """Every arm's probe relevance at its first and last update (means over seeds), on how many
    seeds it fell by more than a 64-state probe's noise (0.1), and which arms ended collapsed by
    the test above: the thought half of the claim for the new arms too, and a drift that has not
    reached collapse yet (RL4VLM's on Points24) shown as a number, not hidden by a yes/no."""
    present = list(dict.fromkeys(r["arm"] for r in rows if r["group"] == group))
    arms = [a for a in ORDER if a in present] + [a for a in present if a not in ORDER]
    parts, fell_all = [], []
    for arm in arms:
        first = final_per_seed(rows, group, arm, "probe_relevance", "first")
        last = final_per_seed(rows, group, arm, "probe_relevance")
        seeds = [s for s in last if not math.isnan(last[s]) and not math.isnan(first[s])]
        if not seeds:
            continue
        fell = sum(last[s] < first[s] - 0.1 for s in seeds)
        share = _mean(list(final_per_seed(rows, group, arm, "probe_top_thought_share").values()))
        end = _mean([last[s] for s in seeds])
        gone = end < min_relevance or (not math.isnan(share) and share > max_share)
        parts.append(
            f"{arm} {_mean([first[s] for s in seeds]):.2f} → {end:.2f}"
            f" (fell on {fell} of {len(seeds)}{'; collapsed' if gone else ''})"
        )
        if fell == len(seeds):
            fell_all.append(arm)
    if not parts:
        return ""
    every = f" Fell on every seed: {', '.join(fell_all)}." if fell_all else ""
    return (
        "Probe relevance, first → last update (mean over seeds; fell = by more than 0.1): "
        + "; ".join(parts)
        + "."
        + every
    )


def png_name(group: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "-", group).strip("-") + ".png"


def curve(
    rows: list[dict[str, Any]], group: str, arm: str, key: str
) -> tuple[list[float], list[float], list[float], list[float]]:
    """(env steps, mean over seeds, min, max) of one arm's metric, at the updates where some seed
    has it: a metric measured every k updates (the greedy evaluation) becomes k-spaced points
    instead of a line broken at every update that lacks it."""
    runs = series(rows, group, arm, key)
    if not runs:
        return [], [], [], []
    n = min(len(v) for v in runs.values())
    first = min(runs)
    steps = [
        r["env_steps"]
        for r in rows
        if r["group"] == group and r["arm"] == arm and r["seed"] == first
    ][:n]
    out: tuple[list[float], list[float], list[float], list[float]] = ([], [], [], [])
    for x, col in zip(steps, zip(*[v[:n] for v in runs.values()], strict=True), strict=True):
        finite = [v for v in col if not math.isnan(v)]
        if finite:
            for dest, value in zip(out, (x, _nanmean(col), min(finite), max(finite)), strict=True):
                dest.append(value)
    return out


def plot(rows: list[dict[str, Any]], group: str, arms: list[str], path: Path) -> None:
    """One figure per task: a panel per metric, mean over seeds with the min–max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 4, figsize=(18, 14))
    for ax in axes.flat[len(CURVES) :]:
        ax.set_visible(False)
    n_updates = len({r["update"] for r in rows if r["group"] == group})
    for ax, (key, title) in zip(axes.flat, CURVES, strict=False):
        drawn = False
        for i, arm in enumerate(arms):  # one colour per arm in every panel
            steps, mean, lo, hi = curve(rows, group, arm, key)
            if not steps:
                continue
            seeds = len(series(rows, group, arm, key))
            sparse = len(steps) < n_updates / 2  # e.g. the greedy evaluation, every 5th update
            marker = "o" if sparse else None
            colour = f"C{i % 10}"
            ax.plot(steps, mean, color=colour, marker=marker, ms=4, label=f"{arm} (n={seeds})")
            ax.fill_between(steps, lo, hi, color=colour, alpha=0.15)
            drawn = True
        if not drawn:
            ax.text(0.5, 0.5, "not recorded by these runs", ha="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("env steps")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{group}: mean over seeds, band = min–max")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _nanmean(xs: tuple[float, ...]) -> float:
    finite = [x for x in xs if not math.isnan(x)]
    return sum(finite) / len(finite) if finite else math.nan


# ---- the report -----------------------------------------------------------------------------


def stamp() -> str:
    return datetime.now(UTC).strftime("%H:%M:%S")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    py = platform.python_version()
    return f"{os.cpu_count()} cores ({cpu}), Python {py}, {platform.system()}"


def samples_md(rows: list[dict[str, Any]], arms: list[str]) -> list[str]:
    """Per group, each run's final greedy output on the first held-out deal (one deal for every
    run, so the arms read side by side) and how many of the kept deals its thought read right."""
    found = [r for r in rows if r.get("greedy_samples") and not r.get("stands_in")]
    if not found:
        return []
    out = [
        "### What the final checkpoints write (greedy, first step of held-out deals)",
        "",
        "Each run's final checkpoint on the first held-out deal (`bench/greedy_samples.py`); "
        "*reads state* counts the deals kept per run whose thought names the true cards.",
        "",
    ]
    order = {a: i for i, a in enumerate(arms)}
    for group in groups(found):
        out += [f"**{group}**", "", "| arm | seed | true state | output | reads state |"]
        out += ["|---|---|---|---|---|"]
        runs = sorted(
            (r for r in found if r["group"] == group),
            key=lambda r: (order.get(r["arm"], len(order)), r["seed"]),
        )
        for r in runs:
            samples = json.loads(r["greedy_samples"])
            first = samples[0]
            reads = sum(bool(x["reads_state"]) for x in samples)
            out.append(
                f"| {r['arm']} | {r['seed']} | {_cell(_state_text(first['state']))} | "
                f"{_cell(first['output'])} | {reads} of {len(samples)} |"
            )
        out.append("")
    return out


# What a run's algorithm sees: the sections compared with the paper's settings, and of [model]
# only the fields that are a fidelity choice (the model itself is 1M parameters against 7B).
COMPARED = ("env", "generation", "train", "corrector")
MODEL_FIELDS = ("finetune", "lora_r", "lora_alpha", "lora_dropout", "lora_targets", "value_head")


def settings_md(tasks: list[str]) -> list[str]:
    """Per task with a GPU preset (configs/repro/gpu/TASK.toml: the paper's settings), every
    setting where the tiny study's config differs from it, both validated with every default
    filled in (so a default that departs from the paper shows too): which fidelity switches the
    study uses and which it does not, read from the configs the runs were made from."""
    if str(ROOT) not in sys.path:  # run as a script, sys.path[0] is bench/
        sys.path.insert(0, str(ROOT))
    from shared.schemas import RunConfig  # pydantic only: the report needs no torch

    out: list[str] = []
    for task in tasks:
        tiny_path, gpu_path = CONFIGS / f"{task}.toml", CONFIGS / "gpu" / f"{task}.toml"
        if not (tiny_path.exists() and gpu_path.exists()):
            continue
        dumps = []
        for path in (tiny_path, gpu_path):
            with open(path, "rb") as f:
                dumps.append(RunConfig.model_validate(tomllib.load(f)).model_dump(mode="json"))
        tiny, gpu = dumps
        rows = []
        for section in ("model", *COMPARED):
            for field, value in tiny[section].items():
                if section == "model" and field not in MODEL_FIELDS:
                    continue
                if field.startswith("lora_") and tiny["model"]["finetune"] == "full":
                    continue  # no adapter is trained: its settings are not in play
                if value != gpu[section].get(field):
                    rows.append(
                        f"| `{section}.{field}` | {_setting(value)} | "
                        f"{_setting(gpu[section].get(field))} |"
                    )
        if not out:
            out += [
                "### The study's settings against the paper's",
                "",
                "Every setting of the study's `configs/repro/TASK.toml` (as committed; the `gtr` "
                "arm) that differs from the paper's, `configs/repro/gpu/TASK.toml`; what each "
                "switch means and the reference's value: `docs/fidelity.md` (why the tiny "
                "presets depart: its last section). The arms change the same keys on both "
                "(`configs/repro/arms.toml`).",
                "",
            ]
        out += [f"**{task}**", "", "| setting | this study | the paper's |", "|---|---|---|"]
        out += rows or ["| (none) | | |"]
        out.append("")
    return out


def _setting(value: Any) -> str:
    """A config value as a table cell: a string as it is, anything else as TOML-ish JSON."""
    return _cell(value if isinstance(value, str) else json.dumps(value))


def _state_text(state: dict[str, Any]) -> str:
    """The part of a card task's state a reader checks a thought against."""
    keys = [k for k in ("cards", "numbers", "target") if k in state]
    if not keys:
        return json.dumps(state)[:120]
    show = lambda v: " ".join(map(str, v)) if isinstance(v, list) else str(v)  # noqa: E731
    return ", ".join(f"{k} {show(state[k])}" for k in keys)


def _cell(text: str) -> str:
    """A model's text as one markdown table cell: HTML-escaped code, no pipes or line breaks."""
    safe = html.escape(" ".join(text.split())).replace("|", "&#124;")
    return f"<code>{safe}</code>" if safe else "(empty)"


def generated_md(rows: list[dict[str, Any]], arms: list[str], meta: dict[str, Any]) -> str:
    """The generated block, from the rows the page shows (``with_base_runs``)."""
    ran = sum(not r.get("stands_in") for r in rows)  # the CSV's rows, not the stand-ins
    parts = [
        BEGIN,
        "",
        "### Conclusion (computed from the tables below)",
        "",
        conclusion_md(rows),
        "",
        "### Table (mean ± sd over seeds; 'final' = last update; greedy SR = held-out "
        "deals played greedily)",
        "",
        table_md(rows, arms),
        "",
        "### Paired comparisons (same seeds and warm start; greedy success)",
        "",
        paired_md(rows, arms),
        "",
    ]
    for group in groups(rows):
        parts += [f"![{group} curves](results/{png_name(group)})", ""]
    parts += samples_md(rows, arms)
    parts += settings_md(sorted({r["task"] for r in rows}))
    commands = ["```bash", *meta["commands"], "```", ""] if meta["commands"] else []
    parts += [
        "### How this table was made",
        "",
        *commands,
        f"- Machine: {meta['machine']}",
        f"- Budget: {meta['budget']}",
        *[
            f"- Wall time of `{w['command']}`: {w['minutes']} min with --jobs {w['jobs']}, "
            f"finished {w['finished']}; 1-min load average between stages "
            f"{', '.join(str(x) for x in w['load_1min'])} (others' work included)"
            for w in meta.get("walls", [])
        ],
        *([f"- Wall time: {meta['wall_note']}"] if meta.get("wall_note") else []),
        f"- Raw data: `docs/results/updates.csv` ({ran} update rows), `docs/results/meta.json`",
        "",
        END,
    ]
    return "\n".join(parts)


def write_report(
    rows: list[dict[str, Any]],
    tasks: list[str],
    arms: list[str],
    out: Path,
    results: Path,
    meta: dict[str, Any],
) -> None:
    results.mkdir(parents=True, exist_ok=True)
    write_csv(rows, results / "updates.csv")
    (results / "meta.json").write_text(json.dumps(meta, indent=2))
    shown = with_base_runs(rows)
    for group in groups(shown):
        plot(shown, group, arms, results / png_name(group))
    md_path = results.parent / "results.md"
    text = md_path.read_text() if md_path.exists() else f"# Results\n\n{BEGIN}\n{END}\n"
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    md_path.write_text(head + generated_md(shown, arms, meta) + tail)
    print(f"wrote {md_path}, {results}/updates.csv and the curves", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--seeds", default="0,1,2", help="run order: seed by seed, as listed")
    ap.add_argument(
        "--task-seeds",
        default="",
        help="restrict a task's seeds, e.g. numberline=0+1 (state cuts in the report)",
    )
    ap.add_argument("--updates", type=int, help="override train.num_updates (pilots)")
    ap.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="training processes at once in --out, 1 torch thread each; runs another driver has"
        " going there count too (two drivers of --jobs 2 share 2 slots)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "repro")
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--variant", default="", help="a section of configs/repro/variants.toml")
    ap.add_argument(
        "--plan", default="", help="explicit run order TASK:SEED:VARIANT,... (VARIANT may be empty)"
    )
    ap.add_argument(
        "--config-dir",
        type=Path,
        default=CONFIGS,
        help="TASK.toml files of the study (arms.toml/variants.toml: configs/repro)",
    )
    ap.add_argument(
        "--warm-from",
        type=Path,
        help="use DIR/TASK as every arm's start instead of running gtr sft (GPU: the "
        "paper's SFT-initialised model)",
    )
    ap.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild docs/results.md from docs/results/updates.csv alone",
    )
    ap.add_argument(
        "--collect-only",
        action="store_true",
        help="merge the completed runs under --out into the CSV and rebuild the page, running "
        "nothing (a study stopped part-way: its finished runs are kept)",
    )
    args = ap.parse_args()
    if args.report_only and args.collect_only:
        sys.exit("--report-only and --collect-only exclude each other")
    if args.report_only and not (args.results / "updates.csv").is_file():
        # A mistyped --results would otherwise rebuild the page beside it from no rows at all.
        sys.exit(f"--report-only: no {args.results / 'updates.csv'} to rebuild the page from")
    tasks, arms = args.tasks.split(","), args.arms.split(",")
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        task_seeds = {
            t: [int(x) for x in v.split("+")]
            for t, _, v in (kv.partition("=") for kv in args.task_seeds.split(",") if kv)
        }
    except ValueError:
        sys.exit(f"--seeds {args.seeds!r} / --task-seeds {args.task_seeds!r}: seeds are integers")
    STUDY["configs"] = args.config_dir.resolve()
    STUDY["warm"] = args.warm_from.resolve() if args.warm_from else Path()
    for t in tasks:
        if not (STUDY["configs"] / f"{t}.toml").exists():
            sys.exit(f"no study config {STUDY['configs'] / f'{t}.toml'}")
        if args.warm_from and not (args.warm_from / t).is_dir():
            sys.exit(f"--warm-from: no folder {args.warm_from / t} (the start model for {t})")
    for a in arms:
        arm_changes(a)  # exits with the list of arms when one is unknown
    for v in {args.variant, *(item.rpartition(":")[2] for item in args.plan.split(",") if item)}:
        variant_changes(v)  # exit on an unknown variant (or a bad `unchanged`) before any run
        unchanged_arms(v)
    out = args.out.resolve()
    models = out / "models"
    started, loads = time.monotonic(), [os.getloadavg()[0]]
    ran = not (args.report_only or args.collect_only)
    if ran:
        if not args.warm_from:
            run_jobs(warm_jobs(tasks, out, args.results), args.jobs, models)
            for t in tasks:
                keep_warm(t, out / "warm" / t, args.results)
        loads.append(os.getloadavg()[0])
        items = plan_items(tasks, seeds, task_seeds, args.variant, args.plan)
        done = recorded(read_csv(args.results / "updates.csv"), out, args.updates)
        run_jobs(train_jobs(items, arms, out, args.updates, done), args.jobs, models)
        loads.append(os.getloadavg()[0])
    # --report-only rebuilds the page from the CSV alone; a study merges what it collected.
    kept = read_csv(args.results / "updates.csv")
    rows = kept if args.report_only else merge(kept, collect(out, tasks, arms, seeds))
    arms = [*arms, *sorted({r["arm"] for r in rows} - set(arms))]
    # The page shows every task in the CSV, not only this invocation's: a study run task by task
    # (or --report-only with the default --tasks) must not relabel what the page holds.
    shown = sorted({r["task"] for r in rows}) or tasks
    budget = {
        t: run_config(t, arms[0], 0, out, args.updates)["train"]
        for t in shown
        if (STUDY["configs"] / f"{t}.toml").is_file()  # a task this study has no config for
    }
    meta = previous_meta(args.results)
    meta |= {"tasks": shown, "arms": arms, "seeds": seeds}
    if ran:
        cmd = " ".join([".venv/bin/python", "bench/reproduce.py", *sys.argv[1:]])
        meta["commands"] = [*[c for c in meta.get("commands", []) if c != cmd], cmd]
        meta["walls"] = [
            *meta.get("walls", []),
            {
                "command": cmd,
                "minutes": round((time.monotonic() - started) / 60, 1),
                "jobs": args.jobs,
                "finished": f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
                "load_1min": [round(x, 1) for x in loads],
            },
        ]
        meta["machine"] = machine()
    meta["budget"] = "; ".join(
        f"{t}: {b['num_envs']} envs × {b['num_steps']} steps × {b['num_updates']} updates = "
        f"{b['num_envs'] * b['num_steps'] * b['num_updates']} env steps per run"
        for t, b in budget.items()
    )
    meta.setdefault("commands", [])
    meta.setdefault("machine", machine())
    write_report(rows, tasks, arms, out, args.results, meta)


def previous_meta(results: Path) -> dict[str, Any]:
    path = results / "meta.json"
    return json.loads(path.read_text()) if path.exists() else {}


if __name__ == "__main__":
    main()
