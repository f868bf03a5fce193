"""Shared pieces of the end-to-end tests: a tiny run config and the store counts of a run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select, update

from shared.db.models import Checkpoint, Correction, Episode, Run, Step, Study, Update
from shared.db.session import session_scope

ROOT = Path(__file__).resolve().parents[2]


def cancel_active_runs() -> None:
    """Cancel every queued or running study and run in the session's database, before and after
    a test's controller works on it: a controller claims any such run, so one an earlier test of
    this worker left (test_api.py leaves ten queued runs, launched with no controller) would be
    driven before the test's own, and the test's must not reach a later test's controller."""
    active = ("queued", "running")
    with session_scope() as s:
        s.execute(update(Study).where(Study.status.in_(active)).values(status="cancelled"))
        s.execute(update(Run).where(Run.status.in_(active)).values(status="cancelled"))


TINY = """
name = "e2e"
task = "numberline"
algorithm = "gtr"
seed = 1
[env]
image_size = 64
[model]
image_size = 64
finetune = "full"
[generation]
max_new_tokens = 40
[init]
kind = "checkpoint"
checkpoint = "{checkpoint}"
[train]
num_envs = {envs}
num_steps = {steps}
num_updates = {updates}
minibatch_size = 8
ppo_epochs = 1
[corrector]
wait = "{wait}"
wait_timeout_s = 60
[metrics]
probe_states = 4
"""


def make_warm_checkpoint(root: Path) -> Path:
    """A short warm start (vision warm-up + oracle SFT) on NumberLine, saved under ``root``: the
    runs of the tests and benchmarks start from a policy that already writes valid JSON."""
    from services.trainer.warmstart import init_policy
    from shared.schemas import RunConfig

    cfg = RunConfig.model_validate(
        {
            "task": "numberline",
            "seed": 0,
            "env": {"image_size": 64},
            "model": {"image_size": 64, "finetune": "full"},
            "init": {
                "kind": "warm_start",
                "vision_steps": 150,
                "sft_samples": 128,
                "sft_steps": 150,
            },
        }
    )
    policy, _ = init_policy(cfg, root / "base")
    policy.save(root / "policy")
    return root / "policy"


def tiny_config(
    checkpoint: Path, envs: int = 2, steps: int = 4, updates: int = 2, wait: str = "update"
) -> str:
    """A tiny NumberLine run that starts from a warm-started checkpoint (it writes valid JSON)."""
    return TINY.format(checkpoint=checkpoint, envs=envs, steps=steps, updates=updates, wait=wait)


def tiny_run(checkpoint: Path, changes: dict | None = None, **kw: Any) -> dict[str, Any]:
    """``tiny_config`` as a dict, with ``changes``: a dict value updates that section, any other
    value replaces the key (``algorithm="grpo"``, ``train={"group_size": 2}``)."""
    cfg = tomllib.loads(tiny_config(checkpoint, **kw))
    for key, value in (changes or {}).items():
        if isinstance(value, dict):
            cfg.setdefault(key, {}).update(value)
        else:
            cfg[key] = value
    return cfg


def counts(run_id: int, url: str | None = None) -> dict[str, int]:
    with session_scope(url) as s:

        def n(model, *where) -> int:  # type: ignore[no-untyped-def]
            return int(s.scalar(select(func.count()).select_from(model).where(*where)) or 0)

        dup_steps = s.execute(
            select(Step.episode_id, Step.idx)
            .where(Step.run_id == run_id)
            .group_by(Step.episode_id, Step.idx)
            .having(func.count() > 1)
        ).all()
        dup_corr = s.execute(
            select(Correction.step_id)
            .where(Correction.run_id == run_id)
            .group_by(Correction.step_id, Correction.corrector)
            .having(func.count() > 1)
        ).all()
        run = s.get(Run, run_id)
        assert run is not None
        return {
            "steps": n(Step, Step.run_id == run_id),
            "episodes": n(Episode, Episode.run_id == run_id),
            "corrections": n(Correction, Correction.run_id == run_id),
            "corrections_done": n(
                Correction, Correction.run_id == run_id, Correction.status == "done"
            ),
            "pending": n(Correction, Correction.run_id == run_id, Correction.status == "pending"),
            "checkpoints": n(Checkpoint, Checkpoint.run_id == run_id, Checkpoint.update_idx >= 0),
            "updates": n(Update, Update.run_id == run_id),
            "dup_steps": len(dup_steps),
            "dup_corrections": len(dup_corr),
            "env_steps": run.env_steps,
        }


def wait_status(
    base_url: str, headers: dict, run_id: int, statuses: tuple[str, ...], timeout_s: float
) -> dict:
    deadline = time.monotonic() + timeout_s
    run: dict = {}
    while time.monotonic() < deadline:
        run = httpx.get(f"{base_url}/api/runs/{run_id}", headers=headers, timeout=10).json()
        if run["status"] in statuses:
            return run
        time.sleep(0.5)
    raise AssertionError(f"run {run_id} still {run.get('status')} after {timeout_s}s: {run}")


@contextmanager
def process(
    args: list[str], log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", *args],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
