"""The oracle corrector on many seeded states of every task, with and without noise."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import pytest

from services.corrector.base import CorrectorError
from services.corrector.oracle import OracleCorrector, agrees, ideal_output, misread_output
from shared.schemas import CorrectionRequest, EnvConfig
from tests.services.corrector.helpers import alfworld_states, env_ready

CARD_TASKS = ("numberline", "ezpoints", "points24", "blackjack")


def card_states(task: str, n: int, seed: int = 0) -> Iterator[dict[str, Any]]:
    """States met by an expert that acts at random 30 % of the time (partial formulas too)."""
    env_ready()
    from services.env import make_env
    from services.env.expert import expert_output

    rng = random.Random(seed)
    env = make_env(task, EnvConfig(image_size=32), seed=seed)
    env.reset()
    game: Any = env.unwrapped
    for _ in range(n):
        state = game.state()
        yield state
        if rng.random() < 0.3:
            action = rng.randrange(len(game.action_names))
        else:
            action = game.action_names.index(expert_output(task, state)["action"])
        _, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            env.reset()


def states(task: str, n: int) -> Iterator[dict[str, Any]]:
    return alfworld_states(n) if task == "alfworld" else card_states(task, n)


def request(task: str, state: dict[str, Any], output: dict[str, Any]) -> CorrectionRequest:
    return CorrectionRequest.model_validate(
        {"task": task, "prompt": "p", "output": json.dumps(output), "state": state}
    )


@pytest.mark.parametrize("task", [*CARD_TASKS, "alfworld"])
def test_the_oracle_is_right_on_many_states(task: str) -> None:
    oracle = OracleCorrector()
    rng = random.Random(1)
    n = 60 if task == "points24" else 120
    for state in states(task, n):
        ideal = ideal_output(task, state)
        assert oracle.correct(request(task, state, ideal)).verdict == "correct", state
        wrong = misread_output(task, state, ideal, rng)
        assert not agrees(task, wrong, ideal, state)
        result = oracle.correct(request(task, state, wrong))
        if state.get("solvable") is False:  # GTR: no solution, nothing to teach
            assert result.verdict == "incorrect" and result.corrected_thought is None
            assert result.extras["possible_solution"] is False
            continue
        assert result.verdict == "incorrect" and result.corrected_thought is not None
        fixed = {**json.loads(result.corrected_thought), "action": ideal["action"]}
        assert "action" not in json.loads(result.corrected_thought)
        assert agrees(task, fixed, ideal, state), (state, result.corrected_thought)


def test_compares_parsed_fields_not_strings() -> None:
    state = next(card_states("numberline", 1))
    ideal = ideal_output("numberline", state)
    # Same reading written differently: numbers as strings, spaced action.
    same = {
        **ideal,
        "current number": str(ideal["current number"]),
        "action": f" {ideal['action']}",
    }
    assert OracleCorrector().correct(request("numberline", state, same)).verdict == "correct"


def test_points_extras_carry_the_target_formula() -> None:
    state = next(s for s in card_states("points24", 50, seed=3) if s["solvable"])
    extras = OracleCorrector().correct(request("points24", state, {})).extras
    assert extras["possible_solution"] is True
    from services.env.solver import evaluate

    assert evaluate(extras["target_formula"]) == 24


def test_a_deal_with_no_solution_gets_no_corrected_thought() -> None:
    """GTR's rule: "possible_solution" NO means no SFT label (and, with corrector.feedback, the
    end of the episode), as a remote corrector's answer gives; the oracle, exact or fallible,
    writes none, where it would otherwise teach "the cards cannot make 24, append '='"."""
    from services.corrector.fallible import FallibleCorrector
    from tests.services.corrector.test_fallible import _agent, _points24_state

    none = _points24_state(["HA", "SA", "DA", "CA"], [])  # 1 1 1 1: no way to 24
    solvable = _points24_state(["HK", "S4", "D2", "CA"], [])
    assert none["solvable"] is False and solvable["solvable"] is True
    exact, fallible = OracleCorrector(), FallibleCorrector({"misread": 0.0})
    for corrector in (exact, fallible):
        for state in (none, solvable):
            got = corrector.correct(request("points24", state, _agent(state, ")")))
            assert got.verdict == "incorrect"
            assert got.extras["possible_solution"] is state["solvable"]
            assert (got.corrected_thought is None) is (not state["solvable"]), got
        # An agent that says so and submits is right: nothing to correct either way.
        right = ideal_output("points24", none)
        assert corrector.correct(request("points24", none, right)).verdict == "correct"


@pytest.mark.parametrize("task, p", [("numberline", 0.3), ("ezpoints", 0.1), ("blackjack", 0.5)])
def test_noise_p_errs_at_rate_p(task: str, p: float) -> None:
    oracle = OracleCorrector(noise=p, seed=7)
    n, errors = 400, 0
    for state in states(task, n):
        ideal = ideal_output(task, state)
        result = oracle.correct(request(task, state, ideal))
        if result.verdict == "incorrect":
            errors += 1
    # Binomial(400, p): 4 standard deviations at most.
    assert abs(errors / n - p) <= 4 * (p * (1 - p) / n) ** 0.5


def test_noise_always_writes_a_wrong_thought() -> None:
    oracle = OracleCorrector(noise=1.0, seed=0)
    for task in CARD_TASKS:
        for state in card_states(task, 30):
            ideal = ideal_output(task, state)
            result = oracle.correct(request(task, state, ideal))
            assert result.verdict == "incorrect"
            # Wrong in the thought itself, whatever action the agent pairs it with.
            thought = json.loads(result.corrected_thought or "{}")
            assert not agrees(task, {**thought, "action": ideal["action"]}, ideal, state), thought


def test_the_oracle_needs_the_state() -> None:
    req = CorrectionRequest(task="numberline", prompt="p", output="{}")
    with pytest.raises(CorrectorError, match="privileged state"):
        OracleCorrector().correct(req)
