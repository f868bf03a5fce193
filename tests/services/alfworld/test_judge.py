"""The oracle's verdict judges every claim of an ALFWorld thought against the privileged state."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from tests.services.alfworld.conftest import Walk
from tests.services.alfworld.test_oracle import _state

# The heat-a-potato state of test_oracle: at countertop 2, apple 1 and potato 1 there, hands empty.
RIGHT = (
    "I am at countertop 2. I see apple 1, potato 1. I hold nothing. "
    "Next sub-goal: find and take a potato, so I take potato 1 from countertop 2."
)


def _verdict(thought: str, state: dict[str, Any]) -> str:
    """What the oracle corrector says of this thought with the expert's action."""
    from services.corrector.oracle import OracleCorrector
    from shared.schemas import CorrectionRequest

    output = json.dumps({"thoughts": thought, "action": "take potato 1 from countertop 2"})
    req = CorrectionRequest(task="alfworld", prompt="p", output=output, state=state)
    return OracleCorrector().correct(req).verdict


@pytest.mark.parametrize(
    ("thought", "problem"),
    [
        (RIGHT.replace("take a potato", "take a tomato"), "names tomato"),
        (RIGHT.replace("find and take a potato", "open the microwave"), "does not name"),
        (RIGHT.replace("take a potato", "take potatoes and an egg"), "names egg"),
        (RIGHT.replace("apple 1, potato 1", "apple 1, apple 1, apple 1"), "twice"),
        (RIGHT.replace("apple 1, potato 1", "apple 1, tomato 2"), "tomato 2"),
        (RIGHT.replace("apple 1, potato 1", "a tomato"), "tomato"),
        (RIGHT.replace("I see apple 1, potato 1.", "I see nothing."), "nothing"),
        (RIGHT.replace("I hold nothing", "I hold apple 1, potato 1 and mug 2"), "claims to hold"),
        (RIGHT.replace("I hold nothing", "I hold the potato 1"), "claims to hold potato 1"),
        (RIGHT.replace("I hold nothing. ", ""), "holds"),
        (RIGHT.replace("I am at countertop 2", "I am at fridge 1"), "at fridge 1"),
        (RIGHT.replace("I hold nothing.", "I hold nothing. I hold nothing."), "repeats"),
    ],
)
def test_wrong_claims_are_judged_incorrect(thought: str, problem: str) -> None:
    from services.env.alfworld.judge import thought_problems

    state = _state()
    problems = thought_problems(thought, state)
    assert any(problem in p for p in problems), problems
    assert _verdict(thought, state) == "incorrect"


@pytest.mark.parametrize(
    ("thought", "over"),
    [
        (RIGHT, {}),
        (RIGHT.replace("apple 1, potato 1", "a potato"), {}),  # bare types and omissions are fine
        (
            "I'm at countertop 2 and I see potato 1. I am holding the potato 1 (hot). "
            "Next sub-goal: put the hot potato in the sinkbasin, so I go to sinkbasin 1.",
            {"holding": "potato 1", "object_states": {"potato 1": ["hot"]}},
        ),
        (
            RIGHT.replace("I hold nothing", "I hold the apple 1").replace(
                "find and take a potato", "put down the apple and find a potato"
            ),
            {"holding": "apple 1"},
        ),
    ],
)
def test_right_thoughts_stay_correct(thought: str, over: dict[str, Any]) -> None:
    from services.env.alfworld.judge import thought_problems

    state = _state(**over)
    assert thought_problems(thought, state) == []
    assert _verdict(thought, state) == "correct"


def test_the_hot_claim_is_checked() -> None:
    from services.env.alfworld.judge import thought_problems

    thought = RIGHT.replace("I hold nothing", "I hold the potato 1 (hot)")
    assert thought_problems(thought, _state(holding="potato 1", object_states={})) != []


def test_the_oracle_thought_passes_on_made_up_and_real_states(walk: Walk) -> None:
    """Every oracle thought is judged right (300 made-up rooms and the real game's walk), and
    the same thought on a state whose task object is another type is judged wrong."""
    from services.env.alfworld import oracle_output
    from services.env.alfworld.corpus import _vocabulary, made_up_state
    from services.env.alfworld.judge import thought_problems

    rng = random.Random(0)
    vocab = _vocabulary()
    states = [made_up_state(rng, *vocab) for _ in range(300)] + [r[0] for r in walk[2]]
    for state in states:
        thought = oracle_output(state)["thoughts"]
        assert thought_problems(thought, state) == [], (thought, state)
        other = "tomato" if state["targets"]["object"] != "tomato" else "apple"
        swapped = {**state, "targets": {**state["targets"], "object": other}}
        assert thought_problems(thought, swapped) != [], (thought, swapped)
