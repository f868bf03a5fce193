"""Greedy evaluation: the policy plays fixed held-out episodes, one batch, no learning.

The training success rate is a running mean over sampled episodes: it lags and, at the tiny
scale, moves less than its noise (tiny-numberline.md: judge by the greedy evaluation). Evaluating
the same seeded deals after each update makes successive figures a paired comparison. Nothing here
is recorded as a step or counted in the env-step budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.schemas import RunConfig
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
    """Play deals 0..episodes-1 greedily in parallel; the outcome of each that finished."""
    env = cfg.env.model_copy(update={"display_size": 0})  # never recorded: no frames for people
    seeds = [eval_seed(i) for i in range(episodes)]
    sessions = [envs.create(cfg.task, env, seed=seed) for seed in seeds]
    try:
        obs = {sid: envs.reset(sid) for sid in sessions}
        finished: dict[str, tuple[bool, float, int]] = {}
        # Every task truncates its episodes; the cap only guards against an env that would not.
        for _ in range(cfg.env.max_episode_steps or 1000):
            live = [sid for sid in sessions if sid not in finished]
            if not live:
                break
            gens = greedy_generate(
                policy, [obs[sid] for sid in live], cfg.generation.max_new_tokens
            )
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


def summarize(outcomes: list[DealOutcome]) -> dict[str, float]:
    """Success rate, mean return and length over the finished deals."""
    n = max(len(outcomes), 1)
    return {
        "eval/success_rate": sum(o.success for o in outcomes) / n,
        "eval/episode_return": sum(o.episode_return for o in outcomes) / n,
        "eval/episode_length": sum(o.episode_length for o in outcomes) / n,
        "eval/episodes": float(len(outcomes)),
    }


def evaluate(envs: Envs, policy: RolloutPolicy, cfg: RunConfig, episodes: int) -> dict[str, float]:
    """Play ``episodes`` greedy episodes in parallel; success rate, mean return and length."""
    return summarize(evaluate_deals(envs, policy, cfg, episodes))
