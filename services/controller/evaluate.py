"""Greedy evaluation: the policy plays fixed held-out episodes, one batch, no learning.

The training success rate is a running mean over sampled episodes: it lags and, at the tiny
scale, moves less than its noise (tiny-numberline.md: judge by the greedy evaluation). Evaluating
the same seeded deals after each update makes successive figures a paired comparison. Nothing here
is recorded as a step or counted in the env-step budget.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.evalrules import eval_rules
from shared.schemas import EvalProtocol, RunConfig
from shared.seeds import eval_seed

if TYPE_CHECKING:
    from services.controller.backends import Envs
    from services.policy.protocol import RolloutPolicy
    from services.policy.schemas import Generation

CHUNK = 32  # generation batch: keeps each policy-service request small


@dataclass(frozen=True)
class DealOutcome:
    """One evaluation deal's episode (stored as an `eval_outcomes` row)."""

    deal: int  # index in the evaluation set: the same deal in every run of a task
    seed: int  # the env seed it was dealt from (shared/seeds.py: never a training seed)
    success: bool
    episode_return: float
    episode_length: int


def protocol(cfg: RunConfig) -> EvalProtocol:
    """The run's evaluation protocol: its declared ``metrics.eval_protocol``, else its own env
    and token cap (``shared.evalrules``: the warm start tool evaluates under it too)."""
    return eval_rules(cfg)


def protocol_record(cfg: RunConfig) -> dict[str, Any]:
    """What a run records of the protocol it was evaluated under (``runs.info``): the settings,
    the deal count and the deal seeds' origin, and a short key two runs are compared by."""
    p = protocol(cfg)
    settings = {
        "task": cfg.task,
        "env": p.env.model_dump(mode="json"),
        "max_new_tokens": p.max_new_tokens,
        "episodes": cfg.metrics.eval_episodes,
        "deals": "eval_seed(i) = 2**60 + i",
    }
    return settings | {"key": protocol_key(settings)}


def protocol_key(settings: dict[str, Any]) -> str:
    """A short hash of a protocol's settings (its ``key`` left out)."""
    body = {k: v for k, v in settings.items() if k != "key"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


def greedy_generate(
    policy: RolloutPolicy, observations: list[Any], max_new_tokens: int
) -> list[Generation]:
    """Greedy outputs for many observations, CHUNK per policy call."""
    gens: list[Generation] = []
    for i in range(0, len(observations), CHUNK):
        chunk = observations[i : i + CHUNK]
        gens += policy.generate(
            [o.image for o in chunk],
            [o.prompt for o in chunk],
            greedy=True,
            max_new_tokens=max_new_tokens,
        )
    return gens


def evaluate_deals(
    envs: Envs, policy: RolloutPolicy, cfg: RunConfig, episodes: int
) -> list[DealOutcome]:
    """Play deals 0..episodes-1 greedily in parallel, under the run's evaluation protocol
    (``protocol``: the same rules for every arm of a study); the outcome of each that finished."""
    rules = protocol(cfg)
    env = rules.env  # never recorded: no frames for people
    seeds = [eval_seed(i) for i in range(episodes)]
    sessions = [envs.create(cfg.task, env, seed=seed) for seed in seeds]
    try:
        obs = {sid: envs.reset(sid) for sid in sessions}
        finished: dict[str, tuple[bool, float, int]] = {}
        # Every task truncates its episodes; the cap only guards against an env that would not.
        for _ in range(env.max_episode_steps or 1000):
            live = [sid for sid in sessions if sid not in finished]
            if not live:
                break
            gens = greedy_generate(policy, [obs[sid] for sid in live], rules.max_new_tokens)
            results = envs.step_batch([(sid, g.text) for sid, g in zip(live, gens, strict=True)])
            for sid, r in zip(live, results, strict=True):
                obs[sid] = r.observation
                if r.done:
                    finished[sid] = (bool(r.success), r.episode_return, r.episode_length)
    finally:
        for sid in sessions:
            try:
                envs.close(sid)
            except Exception:  # closing is best effort: the env service may be the thing failing
                pass
    return [
        DealOutcome(i, seed, *finished[sid])
        for i, (sid, seed) in enumerate(zip(sessions, seeds, strict=True))
        if sid in finished
    ]


START_UPDATE = -1  # eval_outcomes.update_idx of the start's evaluation, before update 0


def summarize(outcomes: list[DealOutcome], prefix: str = "eval/") -> dict[str, float]:
    """Success rate, mean return and length over the finished deals (``eval_start/``: the
    start's, recorded with update 0)."""
    n = max(len(outcomes), 1)
    return {
        f"{prefix}success_rate": sum(o.success for o in outcomes) / n,
        f"{prefix}episode_return": sum(o.episode_return for o in outcomes) / n,
        f"{prefix}episode_length": sum(o.episode_length for o in outcomes) / n,
        f"{prefix}episodes": float(len(outcomes)),
    }


def evaluate(envs: Envs, policy: RolloutPolicy, cfg: RunConfig, episodes: int) -> dict[str, float]:
    """Play ``episodes`` greedy episodes in parallel; success rate, mean return and length."""
    return summarize(evaluate_deals(envs, policy, cfg, episodes))
