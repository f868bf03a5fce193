"""The exact judge (several paths count), the fallible oracle's errors per kind at their rates,
and the accuracy every correction records against the judge."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from pydantic import ValidationError
from scipy.stats import binomtest

from services.corrector.fallible import KINDS, FallibleCorrector, state_seed
from services.corrector.oracle import (
    OracleCorrector,
    accurate,
    exact_correct,
    good_actions,
    ideal_output,
)
from services.corrector.rows import InvalidCorrector, _check_params
from services.corrector.service import build_corrector, record_correction
from services.env import make_env
from shared.schemas import CorrectionRequest, CorrectorConfig, CorrectorErrors, EnvConfig
from shared.settings import get_settings
from tests.services.corrector.helpers import make_run, make_step
from tests.services.corrector.test_oracle import card_states, request

CARD_TASKS = ("numberline", "ezpoints", "points24", "blackjack")


def _points24_state(cards: list[str], tokens: list[str]) -> dict[str, Any]:
    env = make_env("points24", EnvConfig(image_size=32), seed=0)
    env.reset(options={"cards": cards})
    u: Any = env.unwrapped
    for tok in tokens:
        env.step(u.action_names.index(tok))
    return json.loads(json.dumps(u.state()))


def _agent(state: dict[str, Any], action: str) -> dict[str, Any]:
    """A well-read thought with the given action (the thought names no formula)."""
    cards = ", ".join(str(n) for n in state["numbers"])
    return {
        "cards": state["numbers"],
        "formula": state["formula_text"],
        "thoughts": f"the cards are {cards}, next I append '{action}'",
        "action": action,
    }


def test_any_action_that_keeps_a_win_reachable_is_correct() -> None:
    # K 4 2 A: (10+2)*(4-1), 10*2+4*1, (10-4)*(2*... : many first tokens keep a way to 24.
    state = _points24_state(["HK", "S4", "D2", "CA"], [])
    good = good_actions("points24", state)
    assert good is not None and {"(", "10", "4", "2"} <= good and ")" not in good
    expert = ideal_output("points24", state)["action"]
    other = next(a for a in ("10", "4", "2", "(") if a != expert)
    oracle = OracleCorrector()
    assert oracle.correct(request("points24", state, _agent(state, other))).verdict == "correct"
    assert oracle.correct(request("points24", state, _agent(state, ")"))).verdict == "incorrect"
    # One token in: '10 *' keeps 10*2+4*1 and '10 /' keeps 10/1*2+4; '10 +' loses every way.
    good = good_actions("points24", _points24_state(["HK", "S4", "D2", "CA"], ["10"]))
    assert good == {"*", "/"}
    # A formula that can no longer win: only '=' (end the hopeless episode) is right.
    dead = _points24_state(["HA", "SA", "DA", "CA"], ["1"])
    assert good_actions("points24", dead) == {"="}


def test_a_false_sum_in_the_thought_is_wrong_even_with_a_good_action() -> None:
    state = _points24_state(["HK", "S4", "D2", "CA"], [])
    right = {**_agent(state, "10"), "thoughts": "10 * 2 + 4 * 1 = 24, next I append '10'"}
    wrong = {**right, "thoughts": "10 * 2 + 4 + 1 = 24, next I append '10'"}
    assert exact_correct("points24", right, state)
    assert not exact_correct("points24", wrong, state)


def _outputs(task: str, state: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The expert's output, or the same thought with a random action (a mix of right and wrong)."""
    ideal = ideal_output(task, state)
    if rng.random() < 0.5:
        return ideal
    names = make_env(task, EnvConfig(image_size=32)).unwrapped.action_names  # type: ignore[attr-defined]
    return {**ideal, "action": rng.choice(names)}


@pytest.mark.parametrize("task", CARD_TASKS)
def test_exact_oracle_is_always_accurate_and_each_error_kind_is_not(task: str) -> None:
    rng = random.Random(3)
    states = list(card_states(task, 60 if task == "points24" else 120, seed=2))
    exact = OracleCorrector()
    for state in states:
        req = request(task, state, _outputs(task, state, rng))
        assert accurate(req, exact.correct(req)) is True
    for kind in KINDS:
        wrong = FallibleCorrector({kind: 1.0}, seed=1)
        marks = []
        for state in states:
            req = request(task, state, ideal_output(task, state))
            result = wrong.correct(req)
            assert result.extras["error"] == kind
            marks.append(accurate(req, result))
        # An expert output judged by a corrector that always errs: mostly wrong verdicts.
        share = sum(bool(m) for m in marks) / len(marks)
        assert share < 0.5, (kind, share)


def test_error_kinds_are_drawn_at_their_configured_rates() -> None:
    errors = CorrectorErrors(misread=0.2, arithmetic=0.1, choice=0.15)
    corrector = FallibleCorrector(errors, seed=7)
    states = list(card_states("ezpoints", 400, seed=5))
    drawn = [
        corrector.correct(request("ezpoints", s, ideal_output("ezpoints", s))).extras["error"]
        for s in states
    ]
    for kind in KINDS:
        k = sum(d == kind for d in drawn)
        assert binomtest(k, len(drawn), getattr(errors, kind)).pvalue > 1e-3, (kind, k)
    assert drawn.count(None) > 0


def test_per_state_errors_repeat_on_every_visit_at_their_rate() -> None:
    """errors.draw = per_state: a state met again gets the same answer, wrong or right, as a real
    corrector's mistakes repeat; per_call errs afresh each time, so that most repeated visits of
    a state get the right label (a far kinder corrector). The per-state rate is the configured
    one, over states."""
    distinct = {state_seed(0, "ezpoints", s): s for s in card_states("ezpoints", 300, seed=4)}
    states = list(distinct.values())
    per_state = FallibleCorrector({"choice": 0.3, "draw": "per_state"}, seed=3)
    per_call = FallibleCorrector({"choice": 0.3}, seed=3)
    kinds, flips = [], 0
    for state in states:
        req = request("ezpoints", state, ideal_output("ezpoints", state))
        answers = {per_state.correct(req).model_dump_json(exclude={"latency_ms"}) for _ in range(4)}
        assert len(answers) == 1  # four visits, one answer
        kinds.append(per_state.correct(req).extras["error"])
        flips += len({per_call.correct(req).verdict for _ in range(4)}) > 1
    assert binomtest(kinds.count("choice"), len(kinds), 0.3).pvalue > 1e-3
    assert flips > len(states) // 4  # per call, a state's verdict changes between visits
    # Another seed is another corrector: its mistakes fall on other states.
    other = FallibleCorrector({"choice": 0.3, "draw": "per_state"}, seed=4)
    mine = [
        other.correct(request("ezpoints", s, ideal_output("ezpoints", s))).extras["error"]
        for s in states
    ]
    assert mine != kinds


def test_errors_are_a_typed_oracle_setting() -> None:
    assert CorrectorConfig(errors={"choice": 0.1}).errors.choice == 0.1  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="at most 1"):
        CorrectorConfig(errors={"misread": 0.6, "choice": 0.6})  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="name it 'oracle'"):
        CorrectorConfig(name="gpt4o", errors={"choice": 0.1})  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="set one"):
        CorrectorConfig(noise=0.1, errors={"choice": 0.1})  # type: ignore[arg-type]
    assert _check_params("oracle", {"errors": {"misread": 0.1}}) == {"errors": {"misread": 0.1}}
    with pytest.raises(InvalidCorrector, match=r"params.errors.misread"):
        _check_params("oracle", {"errors": {"misread": 2}})


def test_each_correction_records_its_accuracy_for_the_run(db) -> None:  # type: ignore[no-untyped-def]
    from services.controller.correction_stats import ACCURACY, update_figures

    run = make_run(db, "ezpoints", corrector={"errors": {"choice": 0.5}})
    corrector = build_corrector(
        "oracle", db, get_settings(), seed=0, errors=run.config["corrector"]["errors"]
    )
    assert isinstance(corrector, FallibleCorrector)
    marks = []
    for i, state in enumerate(card_states("ezpoints", 40, seed=9)):
        step = make_step(db, "ezpoints", state, ideal_output("ezpoints", state), run=run, idx=i)
        row = record_correction(db, step.id, "oracle", corrector)
        assert row.status == "done" and isinstance(row.extras["accurate"], bool)
        req = CorrectionRequest(task="ezpoints", prompt="p", output=step.output, state=state)
        assert accurate(req, corrector_answer(row)) == row.extras["accurate"]
        marks.append(row.extras["accurate"])
    figures = update_figures(db, run.id, 0)
    assert figures[ACCURACY] == pytest.approx(sum(marks) / len(marks))
    assert 0.2 < figures[ACCURACY] < 0.8  # half the answers name a wrong action


def corrector_answer(row: Any) -> Any:
    from shared.schemas import Correction

    return Correction(
        verdict=row.verdict, corrected_thought=row.corrected_thought, extras=row.extras
    )
