"""Greedy evaluation on the real env pool, played by the expert and by an agent that can't write."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from services.controller.console import summary_columns
from services.controller.evaluate import evaluate, evaluate_deals, protocol_record
from services.env.service import EnvPool
from shared.schemas import RunConfig
from shared.seeds import eval_seed


@dataclass
class _Gen:
    text: str


class AlwaysPlus:
    """Always moves up: wins exactly the deals whose target lies above the current number."""

    def generate(self, images: list[Any], prompts: list[str], **kw: Any) -> list[_Gen]:
        assert kw["greedy"] is True
        return [_Gen('{"action": "+"}') for _ in images]


class Babbler:
    """Never writes a parsable answer."""

    def generate(self, images: list[Any], prompts: list[str], **kw: Any) -> list[_Gen]:
        return [_Gen("I am not sure") for _ in images]


def _cfg(**metrics: Any) -> RunConfig:
    return RunConfig.model_validate(
        {"task": "numberline", "env": {"image_size": 64, "invalid_action": "noop"}, **metrics}
    )


def test_a_model_that_cannot_write_never_succeeds_and_sessions_are_closed() -> None:
    pool = EnvPool()
    out = evaluate(pool, Babbler(), _cfg(), episodes=8)
    assert out["eval/episodes"] == 8
    assert out["eval/success_rate"] == 0.0
    assert out["eval/episode_return"] < 0  # every no-op costs
    assert len(pool) == 0


def test_success_counts_exactly_the_deals_the_agent_can_win() -> None:
    pool, cfg = EnvPool(), _cfg()
    deals = []
    for i in range(40):  # the same seeded deals the evaluation plays
        sid = pool.create("numberline", cfg.env, seed=eval_seed(i))
        deals.append(pool.reset(sid).state)
        pool.close(sid)
    winnable = sum(d["target"] > d["current"] for d in deals) / len(deals)
    assert 0 < winnable < 1
    out = evaluate(pool, AlwaysPlus(), cfg, episodes=40)
    assert out["eval/success_rate"] == pytest.approx(winnable)
    assert out["eval/episodes"] == 40
    # Per deal: deal i is the i-th seeded deal, won exactly when its target lies above.
    outcomes = evaluate_deals(pool, AlwaysPlus(), cfg, episodes=40)
    assert [o.deal for o in outcomes] == list(range(40))
    assert [o.seed for o in outcomes] == [eval_seed(i) for i in range(40)]
    assert [o.success for o in outcomes] == [d["target"] > d["current"] for d in deals]
    assert all(o.episode_length >= 1 for o in outcomes)


def test_summary_columns_follow_evaluations_then_spread_evenly() -> None:
    evaluated = [{"eval/success_rate": 0.5} if i in (0, 4, 9) else {} for i in range(10)]
    assert summary_columns(evaluated) == [0, 4, 9]
    assert summary_columns([{}] * 25) == [0, 5, 10, 14, 19, 24]
    assert summary_columns([{}]) == [0]
    assert summary_columns([]) == []
    many = [{"eval/success_rate": 1.0}] * 40
    cols = summary_columns(many)
    assert cols[0] == 0 and cols[-1] == 39 and len(cols) <= 7


@pytest.mark.parametrize("episodes", [1, 40])
def test_evaluation_is_paired_the_same_deals_every_time(episodes: int) -> None:
    pool = EnvPool()
    a = evaluate(pool, Babbler(), _cfg(), episodes=episodes)
    b = evaluate(pool, Babbler(), _cfg(), episodes=episodes)
    assert a == b


class TokenCounter(Babbler):
    """Records the token cap each greedy call was given."""

    def __init__(self) -> None:
        self.caps: list[int] = []

    def generate(self, images: list[Any], prompts: list[str], **kw: Any) -> list[_Gen]:
        self.caps.append(kw["max_new_tokens"])
        return super().generate(images, prompts, **kw)


def test_the_evaluation_plays_under_the_declared_protocol_not_the_training_env() -> None:
    """Two runs that train under different env rules are scored under one protocol: the same
    episodes, the same token cap, the same recorded protocol key."""
    protocol = {"env": {"image_size": 64, "invalid_action": "noop", "max_episode_steps": 3},
                "max_new_tokens": 24}  # fmt: skip
    a = _cfg(metrics={"eval_protocol": protocol})
    b = RunConfig.model_validate(
        {"task": "numberline", "env": {"image_size": 64, "invalid_action": "random",
         "max_episode_steps": 9}, "generation": {"max_new_tokens": 50},
         "metrics": {"eval_protocol": protocol}}
    )  # fmt: skip
    pool, policy = EnvPool(), TokenCounter()
    outcomes = evaluate_deals(pool, policy, a, episodes=6)
    assert {o.episode_length for o in outcomes} == {3}  # the protocol's limit, not the env's 10
    assert set(policy.caps) == {24}
    assert evaluate_deals(pool, Babbler(), b, episodes=6) == outcomes
    ka, kb = protocol_record(a), protocol_record(b)
    assert ka["key"] == kb["key"] and ka["env"]["max_episode_steps"] == 3
    # Without a declared protocol a run is evaluated under its own env, and says so.
    own = protocol_record(_cfg())
    assert own["key"] != ka["key"] and own["env"]["invalid_action"] == "noop"
