"""GTR's reading of an LM corrector's answer: no label for an unsolvable deal, and the
corrector's own action kept for the thought+action cloning ablation."""

from __future__ import annotations

import json

from services.corrector.answers import to_correction

KEYS = ["cards", "formula", "thoughts"]
FIXED = {"cards": [1, 2, 3, 4], "formula": "(", "thoughts": "start with (", "action": "("}


def test_unsolvable_deal_gives_no_label() -> None:
    answer = {"evaluation": "NO", "correction": FIXED, "possible_solution": "NO"}
    result = to_correction("points24", json.dumps(answer), KEYS)
    assert result.verdict == "incorrect" and result.corrected_thought is None
    assert result.extras["possible_solution"] is False


def test_the_correctors_action_is_kept_beside_the_thought() -> None:
    answer = {"evaluation": "NO", "correction": FIXED, "possible_solution": "YES"}
    result = to_correction("points24", json.dumps(answer), KEYS)
    assert "action" not in json.loads(result.corrected_thought or "{}")
    assert result.extras["action"] == "("
