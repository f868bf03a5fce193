"""GTR's corrector feedback (corrector.feedback): what a step's correction does to its episode."""

from __future__ import annotations

from services.controller.feedback import decide


def test_no_solution_truncates() -> None:
    fb = decide({"possible_solution": False, "target_formula": "(1+1)*12"}, "(")
    assert fb.truncate and fb.target_formula is None


def test_target_formula_is_kept_while_the_formula_follows_it() -> None:
    fb = decide({"possible_solution": True, "target_formula": "(10 + 2) * (4 - 1)"}, "(10+")
    assert not fb.truncate and fb.target_formula == "(10+2)*(4-1)"


def test_leaving_the_target_formula_truncates() -> None:
    fb = decide({"possible_solution": True, "target_formula": "(10+2)*(4-1)"}, "(4")
    assert fb.truncate and fb.target_formula == "(10+2)*(4-1)"


def test_nothing_to_say_changes_nothing() -> None:
    assert decide({}, "1").truncate is False and decide(None, None).target_formula is None
    # The episode already ended (formula None): a target is remembered, nothing truncated.
    assert not decide({"target_formula": "4*6"}, None).truncate
