"""A finished tiny run (plus a collapsing one and a failed one) for the UI tests.

The runs' rows and their curves (twelve updates of every metric) are written here; the traces
are not: their episodes are played in the real NumberLine env by a scripted agent that misreads
now and then, written by the controller's recorder, and corrected by the real oracle through
``record_correction``, so every derived column (``corrected_steps`` above all) is the product's.
The browser tests on a really trained run use the session's ``real_run`` fixture (conftest.py).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session

from services.api.auth import create_token
from services.controller.recorder import add_step, close_episode, open_episode, touch_episode
from services.corrector.oracle import OracleCorrector
from services.corrector.service import record_correction
from services.env import EnvPool
from shared.db.models import Checkpoint, Run, Update
from shared.schemas import EnvConfig
from shared.storage import blob_store

T0 = datetime(2026, 11, 20, 9, 0, tzinfo=UTC)


@dataclass
class Seeded:
    """Ids and secrets the tests need."""

    run_id: int
    collapse_run_id: int
    failed_run_id: int
    write_token: str
    read_token: str
    admin_token: str
    corrected_step_ids: list[int] = field(default_factory=list)
    steps: int = 0


def _curve(u: int, n: int, start: float, end: float, rng: random.Random, noise: float) -> float:
    x = u / max(n - 1, 1)
    return start + (end - start) * (1 - math.exp(-3 * x)) / (1 - math.exp(-3)) + rng.gauss(0, noise)


def healthy_metrics(u: int, n: int, rng: random.Random) -> dict[str, float]:
    """Metrics of a GTR run that learns and keeps its thoughts tied to the state."""
    c = lambda a, b, s=0.02: round(_curve(u, n, a, b, rng, s), 4)  # noqa: E731
    return {
        "success_rate": c(0.45, 0.93),
        "episode_return": c(-1.2, 0.8, 0.08),
        "episode_length": c(4.8, 2.6, 0.1),
        "format_valid_rate": c(0.9, 0.99, 0.01),
        "action_valid_rate": c(0.88, 0.99, 0.01),
        "corrected_rate": c(0.42, 0.08),
        "state_relevance": c(0.62, 0.95),
        "distinct_1": c(0.31, 0.28),
        "distinct_2": c(0.52, 0.47),
        "self_bleu_2": c(0.61, 0.66),
        "thoughts_per_state": c(1.9, 1.4, 0.05),
        "thought_length": c(21.0, 18.5, 0.4),
        "thought_entropy": c(1.4, 0.9, 0.03),
        "corrector_latency_ms": c(2.1, 2.0, 0.2),
        "probe_top_thought_share": c(0.1, 0.17),
        "probe_relevance": c(0.6, 0.95),
        "probe_distinct_thoughts": c(0.8, 0.9),
        "losses/policy": c(0.05, -0.01, 0.01),
        "losses/value": c(0.9, 0.2, 0.04),
        "losses/sft": c(1.6, 0.35, 0.03),
        "approx_kl": c(0.004, 0.012, 0.001),
        "clipfrac": c(0.02, 0.08, 0.005),
        "lr": round(1e-3 * (0.5 + 0.5 * math.cos(math.pi * u / n)), 6),
        "grad_norm": c(2.0, 0.8, 0.1),
        "explained_variance": c(0.1, 0.7, 0.03),
    }


def collapse_metrics(u: int, n: int, rng: random.Random) -> dict[str, float]:
    """Plain PPO on EZPoints: one thought takes over the probe set and relevance falls."""
    c = lambda a, b, s=0.02: round(_curve(u, n, a, b, rng, s), 4)  # noqa: E731
    return {
        "success_rate": c(0.3, 0.12),
        "episode_return": c(-0.8, -1.6, 0.1),
        "corrected_rate": c(0.5, 0.9),
        "state_relevance": c(0.7, 0.1),
        "distinct_2": c(0.5, 0.05),
        "self_bleu_2": c(0.6, 0.97),
        "thought_length": c(24.0, 11.0, 0.3),
        "thought_entropy": c(1.3, 0.1, 0.02),
        "probe_top_thought_share": c(0.12, 0.97),
        "probe_relevance": c(0.7, 0.05),
        "losses/policy": c(0.03, 0.0, 0.01),
        "losses/value": c(1.1, 0.7, 0.05),
        "approx_kl": c(0.005, 0.03, 0.002),
    }


def _config(name: str, task: str, algorithm: str, num_updates: int) -> dict:
    return {
        "name": name,
        "task": task,
        "algorithm": algorithm,
        "seed": 0,
        "train": {"num_envs": 4, "num_steps": 8, "num_updates": num_updates},
        "corrector": {"name": "oracle", "noise": 0.0},
        "metrics": {"probe_states": 60},
    }


def _add_run(session: Session, name: str, task: str, algorithm: str, n: int, **kw: object) -> Run:
    run = Run(
        name=name,
        task=task,
        algorithm=algorithm,
        config=_config(name, task, algorithm, n),
        total_env_steps=4 * 8 * n,
        num_updates=n,
        created_at=T0,
        started_at=T0 + timedelta(seconds=5),
        **kw,
    )
    session.add(run)
    session.flush()
    return run


IMAGE = 96  # the env renders the frames at this size


def _agent_text(state: dict, misread: bool, malformed: bool, rng: random.Random) -> str:
    """What a half-trained agent writes (the model's part, scripted): it may misread the target,
    then moves toward what it read; now and then the output is cut off."""
    current, target = state["current"], state["target"]
    seen = (target + rng.choice([-1, 1])) % (state["max_position"] + 1) if misread else target
    action = "+" if seen > current else "-"
    words = "increase" if action == "+" else "decrease"
    text = json.dumps(
        {
            "current number": current,
            "target number": seen,
            "thoughts": f"The current number is {current} and the target is {seen}, "
            f"so I should {words} it.",
            "action": action,
        }
    )
    return text[: rng.randint(20, 60)] if malformed else text


def _add_episode(
    session: Session,
    run: Run,
    upd: int,
    env_index: int,
    seq: int,
    rng: random.Random,
    out: Seeded,
    pool: EnvPool,
    oracle: OracleCorrector,
) -> None:
    """One episode played in the real env, written by the controller's recorder and corrected
    by the real oracle through ``record_correction`` (which keeps ``corrected_steps``)."""
    sid = pool.create("numberline", EnvConfig(image_size=IMAGE), seed=rng.randint(0, 10**6))
    try:
        obs, blobs = pool.reset(sid), blob_store()
        cursor = open_episode(session, run.id, env_index, seq, upd)
        misread_p = max(0.05, 0.45 - 0.04 * upd)
        for t in range(10):
            text = _agent_text(obs.state, rng.random() < misread_p, rng.random() < 0.06, rng)
            r = pool.step_batch([(sid, text)])[0]
            step = add_step(
                session,
                blobs,
                image=obs.image,
                run_id=run.id,
                episode_id=cursor.episode_id,
                idx=t,
                update_idx=upd,
                rollout_pos=t * 4 + env_index,
                prompt=obs.prompt,
                output=text,
                thought=r.parsed.thought,
                action_text=r.parsed.action_text,
                parsed_action=r.action,
                format_valid=bool(r.parsed.format_valid),
                action_valid=bool(r.parsed.action_valid),
                reward=float(r.reward),
                done=bool(r.done),
                value=round(rng.uniform(-0.5, 0.9), 3),
                logprob=round(-rng.uniform(0.05, 2.0), 3),
                thought_entropy=round(rng.uniform(0.5, 1.5), 3),
                state=obs.state,
            )
            session.flush()
            cursor.length += 1
            cursor.total_return += float(r.reward)
            out.steps += 1
            if step.format_valid:
                corr = record_correction(session, step.id, "oracle", oracle)
                if corr.verdict == "incorrect":
                    out.corrected_step_ids.append(step.id)
            if r.done:
                close_episode(session, cursor, bool(r.success))
                return
            touch_episode(session, cursor)
            obs = r.observation
        close_episode(session, cursor, False)  # the seed's own step limit: a failure
    finally:
        pool.close(sid)


def seed_demo(
    session: Session, team: str = "ui-lab", updates: int = 12, traced: tuple[int, ...] = (0, 5, 11)
) -> Seeded:
    """Insert the three runs of `team` and three tokens; the caller commits."""
    rng = random.Random(7)
    run = _add_run(
        session,
        "numberline-gtr-tiny",
        "numberline",
        "gtr",
        updates,
        team=team,
        status="completed",
        updates_done=updates,
        env_steps=4 * 8 * updates,
        finished_at=T0 + timedelta(minutes=updates + 1),
    )
    collapse = _add_run(
        session,
        "ezpoints-rl4vlm-collapse",
        "ezpoints",
        "rl4vlm",
        40,
        team=team,
        status="running",
        updates_done=18,
        env_steps=4 * 8 * 18,
        alarm=True,
    )
    failed = _add_run(
        session,
        "points24-gtr-gpt4o",
        "points24",
        "gtr",
        50,
        team=team,
        status="failed",
        error="corrector 'gpt4o' unreachable: budget exhausted after 3 retries",
    )
    out = Seeded(
        run.id,
        collapse.id,
        failed.id,
        write_token=create_token(session, "ui-write", "write", team)[1],
        read_token=create_token(session, "ui-read", "read", team)[1],
        admin_token=create_token(session, "ui-admin", "admin", team)[1],
    )
    for u in range(updates):
        session.add(
            Update(
                run_id=run.id,
                idx=u,
                metrics=healthy_metrics(u, updates, rng),
                created_at=T0 + timedelta(minutes=u + 1),
            )
        )
    for u in range(18):
        m = collapse_metrics(u, 40, rng)
        alarm = m["probe_top_thought_share"] > 0.5 or m["probe_relevance"] < 0.3
        session.add(
            Update(
                run_id=collapse.id,
                idx=u,
                metrics=m,
                alarm=alarm,
                created_at=T0 + timedelta(minutes=u + 1),
            )
        )
    pool, oracle = EnvPool(), OracleCorrector(noise=0.0, seed=7)
    for u in traced:
        for env in range(4):
            for seq in range(2):
                _add_episode(session, run, u, env, u * 2 + seq, rng, out, pool, oracle)
    for u in (-1, *range(3, updates, 4)):
        session.add(
            Checkpoint(
                run_id=run.id,
                update_idx=u,
                path=f"run-{run.id}/" + ("init" if u < 0 else f"update-{u:05d}"),
                size_bytes=4_200_000 + 10 * u,
                sha256=f"{u + 10:064x}",
                created_at=T0 + timedelta(minutes=u + 1),
            )
        )
    session.flush()
    return out
