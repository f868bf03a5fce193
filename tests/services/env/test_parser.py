"""The action parser: format and action validity reported apart; the reference's fallbacks."""

from __future__ import annotations

import json

import pytest

from services.env import make_env


def _parse(task: str, text: object):  # noqa: ANN202
    return make_env(task).unwrapped.parse(text)


def test_valid_output() -> None:
    text = (
        '{"cards": [4, 3], "formula": "4", '
        '"thoughts": "4 * 3 = 12, next I append \'*\'", "action": "*"}'
    )
    p = _parse("ezpoints", text)
    assert p.format_valid and p.action_valid and p.action == 11 and p.action_text == "*"
    assert json.loads(p.thought) == {
        "cards": [4, 3],
        "formula": "4",
        "thoughts": "4 * 3 = 12, next I append '*'",
    }
    assert p.fields["cards"] == [4, 3]


def test_missing_key_is_format_invalid_but_action_valid() -> None:
    p = _parse("points24", '{"thoughts": "x", "action": "10"}')
    assert not p.format_valid and p.action_valid and p.action == 9
    assert p.thought == '{"thoughts": "x"}'


@pytest.mark.parametrize(
    ("task", "text", "expected"),
    [
        ("blackjack", '{"thoughts": "t", "action": "HIT"}', "hit"),
        ("blackjack", '{"thoughts": "t", "action": " stand "}', "stand"),
        ("blackjack", '{"thoughts": "t", "action": "I will hit"}', "hit"),
        (
            "numberline",
            '{"current number": 1, "target number": 2, "thoughts": "", "action": "+"}',
            "+",
        ),
        ("points24", '{"cards": [], "formula": "", "thoughts": "", "action": 10}', "10"),
        ("points24", '{"cards": [], "formula": "", "thoughts": "", "action": "10"}', "10"),
    ],
)
def test_action_values(task: str, text: str, expected: str) -> None:
    env = make_env(task).unwrapped
    p = env.parse(text)
    assert p.action_valid and env.action_names[p.action] == expected


@pytest.mark.parametrize(
    ("task", "text"),
    [
        ("numberline", '{"current number": 1, "target number": 2, "thoughts": "", "action": "5"}'),
        ("numberline", '{"current number": 1, "target number": 2, "thoughts": "", "action": "+-"}'),
        ("blackjack", '{"thoughts": "", "action": "hit or stand"}'),
        ("blackjack", '{"thoughts": "", "action": null}'),
        ("blackjack", '{"thoughts": "", "action": true}'),
        ("points24", '{"cards": [], "formula": "", "thoughts": "", "action": "1+2"}'),
        ("ezpoints", ""),
        ("ezpoints", "   "),
    ],
)
def test_no_single_legal_action(task: str, text: str) -> None:
    p = _parse(task, text)
    assert p.action is None and not p.action_valid


def test_broken_json_falls_back_to_the_reference_projection() -> None:
    # Trailing junk after the object: not valid JSON, but the action after "action": is read.
    p = _parse("numberline", '{"current number": 1, "thoughts": "x", "action": "+"} trailing')
    assert not p.format_valid and p.action == 1 and p.thought is None and p.fields == {}
    p = _parse("blackjack", 'thoughts: stand? "ACTION": "Stand"}')
    assert p.action == 0 and p.action_text == '"Stand"}'
    # No "action" key: only the last character counts (the reference's find() == -1).
    assert _parse("numberline", "I think - is right, so +").action == 1
    assert _parse("numberline", "+ is right, so choose -.").action is None
    # '10' is read before '1' on the points games.
    assert _parse("points24", '"action": "10"').action == 9
    assert _parse("points24", '"action": "10 or 2"').action is None


def test_never_raises_on_odd_input() -> None:
    for text in [None, 12, "[1, 2]", '"action"', "{" * 5000, '{"action": {"x": 1}}', "\x00"]:
        p = _parse("points24", text)
        assert not p.format_valid
    assert _parse("points24", "[1, 2]").fields == {}


def test_the_thought_keeps_its_characters_as_written() -> None:
    """Stored as written, not as \\u escapes: the text PostgreSQL's search indexes."""
    text = '{"thoughts": "café → 12 «ok» \\"q\\" <b>", "action": "-"}'
    p = _parse("numberline", text)
    assert p.thought == '{"thoughts": "café → 12 «ok» \\"q\\" <b>"}'
    assert "\\u" not in p.thought and json.loads(p.thought)["thoughts"].startswith("café")
