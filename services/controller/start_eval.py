"""The start's evaluation (update -1), played once per start: the arms of a study's seed start
from the same weights under one protocol, so the first of them to evaluate its start plays the
deals and the others take its outcomes.

A greedy evaluation is a function of the weights, the model they load into, the generation
settings and the protocol (env rules, token cap, deals): ``start_key`` hashes exactly those,
with the start weights' sha256 the trainer records (``runs.info.init_weights_sha256``). A run
whose key matches a run of its team and task that has recorded its start's outcomes copies
them and records where they came from (``runs.info.start_eval``: ``key``, ``reused_from``);
otherwise it plays them. Without a recorded digest nothing is reused.

Arms of a seed often reach their start together (a study queues them once their shared warm
start is built). Each first claims the key (``start_eval.claimed_at``); of the live claimants
still playing it (running, heartbeat under STALE_S old), the earliest claim (then the lowest
id) plays and the others wait for its outcomes, polling, while they can still be cancelled. A
claimant that stops beating, ends, or keeps them waiting past MAX_WAIT_S is not waited for.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.controller import store
from services.controller.evaluate import (
    START_UPDATE,
    DealOutcome,
    evaluate_deals,
    protocol_record,
    summarize,
)
from services.controller.outages import check_cancel
from shared.db.models import EvalOutcome, Run, utcnow
from shared.db.session import session_scope
from shared.schemas import RunConfig

if TYPE_CHECKING:
    from services.controller.backends import Envs
    from services.policy.protocol import RolloutPolicy


STALE_S = 30.0  # a claimant whose heartbeat (services/controller/loop.py: every 5 s) is older
MAX_WAIT_S = 3600.0  # the longest a run waits for another's start outcomes
POLL_S = 1.0


@dataclass
class StartEval:
    outcomes: list[DealOutcome]
    key: str | None  # start_key; None: the start weights' digest was not recorded
    reused_from: int | None  # the run whose outcomes these are; None: played by this run


def start_key(cfg: RunConfig, weights_sha256: str | None) -> str | None:
    """What the start's greedy evaluation depends on, hashed; None without the weights' digest."""
    if not weights_sha256:
        return None
    body = {
        "weights": weights_sha256,
        "model": cfg.model.model_dump(mode="json"),
        "generation": cfg.generation.model_dump(mode="json"),
        "protocol": protocol_record(cfg),
    }
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def evaluate_start(
    run_id: int, envs: Envs, policy: RolloutPolicy, cfg: RunConfig, episodes: int
) -> StartEval:
    """The start's outcomes on ``episodes`` deals: another run's of the same key, else played;
    stored at once (update -1, ``runs.info.start_eval``), so a sibling starting later finds
    them. Update 0's row gets their figures (``start_figures``)."""
    with session_scope() as s:
        run = store.run_row(s, run_id)
        key = start_key(cfg, (run.info or {}).get("init_weights_sha256"))
        if key is not None:  # claimed before looking: of two at once, one sees the other
            claim = {"key": key, "reused_from": None, "claimed_at": time.time()}
            run.info = {**(run.info or {}), "start_eval": claim}
    found = _wait_for_start(run_id, key, episodes) if key is not None else None
    if found is not None:
        start = StartEval(found[1], key, found[0])
    else:
        start = StartEval(evaluate_deals(envs, policy, cfg, episodes), key, None)
    with session_scope() as s:
        run = store.run_row(s, run_id)
        store.record_eval_outcomes(s, run_id, START_UPDATE, start.outcomes)
        if key is not None:
            run.info = {
                **(run.info or {}),
                "start_eval": {"key": key, "reused_from": start.reused_from, "done": True},
            }
    return start


def _wait_for_start(run_id: int, key: str, episodes: int) -> tuple[int, list[DealOutcome]] | None:
    """Another run's outcomes of this start: recorded already, or once the live claimant ahead
    of this run has played them; None when this run is to play them."""
    waited = 0.0
    while True:
        with session_scope() as s:
            run = store.run_row(s, run_id)
            found = recorded_start(s, run, key, episodes)
            if found is not None or waited >= MAX_WAIT_S or not _claimant_ahead(s, run, key):
                return found
        check_cancel(run_id)
        time.sleep(POLL_S)
        waited += POLL_S


def _claimant_ahead(session: Session, run: Run, key: str) -> bool:
    """Whether a live run of the team and task claimed this key before this run (the earlier
    claim, then the lower id) and is still playing it."""
    fresh = utcnow() - timedelta(seconds=STALE_S)
    others = session.scalars(
        select(Run)
        .where(Run.team == run.team, Run.task == run.task, Run.id != run.id)
        .where(Run.status == "running", Run.heartbeat_at >= fresh)
        .where(Run.info[("start_eval", "key")].as_string() == key)
    ).all()
    mine = (float((run.info or {}).get("start_eval", {}).get("claimed_at", 0.0)), run.id)
    playing = [o for o in others if not o.info["start_eval"].get("done")]
    return any((float(o.info["start_eval"].get("claimed_at", 0.0)), o.id) < mine for o in playing)


def recorded_start(
    session: Session, run: Run, key: str, episodes: int
) -> tuple[int, list[DealOutcome]] | None:
    """The earliest other run of the team and task with this start key and its start's
    outcomes recorded on as many deals (the run id and its outcomes); None if there is none."""
    candidates = session.scalars(
        select(Run.id)
        .where(Run.team == run.team, Run.task == run.task, Run.id != run.id)
        .where(Run.info[("start_eval", "key")].as_string() == key)
        .order_by(Run.id)
    ).all()
    for other in candidates:
        rows = session.scalars(
            select(EvalOutcome)
            .where(EvalOutcome.run_id == other, EvalOutcome.update_idx == START_UPDATE)
            .order_by(EvalOutcome.deal)
        ).all()
        if rows and all(r.deal < episodes for r in rows):  # the same deals (the key says so)
            outcomes = [
                DealOutcome(r.deal, r.seed, r.success, r.episode_return, r.episode_length)
                for r in rows
            ]
            return other, outcomes
    return None


def start_figures(start: StartEval) -> dict[str, Any]:
    """The start's ``eval_start/`` figures for update 0's row (``eval_start/reused``: 1 where
    another run played them)."""
    reused = float(start.reused_from is not None)
    return summarize(start.outcomes, "eval_start/") | {"eval_start/reused": reused}
