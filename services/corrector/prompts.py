"""Evaluate-then-correct prompts of every task (GTR `gpt4o_interface.py`, paraphrased).

The system prompt states the game's rules; the user prompt asks the task's questions about the
player's thought, then for a JSON verdict and, when the thought is wrong, a corrected thought.
"""

from __future__ import annotations

import json
from typing import Any

from services.corrector.tools import TOOL_NAME

NOT_DETERMINED = "NOT DETERMINED"

SYSTEM: dict[str, str] = {
    "numberline": (
        "You are an expert judge of a number-line game. The image shows a target number and a "
        "current number, both between 0 and 5. Each turn the player chooses '+' (add 1) or '-' "
        "(subtract 1) to move the current number toward the target."
    ),
    "blackjack": (
        "You are an expert blackjack judge. The image shows the dealer's face-up card and the "
        "player's cards. The player chooses 'stand' or 'hit'. Aces count 1 or 11, J/Q/K count 10; "
        "going over 21 loses. The dealer draws to 17."
    ),
    "ezpoints": (
        "You are an expert judge of a card game. The image shows two cards and the current "
        "formula. J, Q and K count as 10. The player builds a formula equal to 12 one token per "
        "turn from ['1'..'10', '+', '*', '='], using each card's number exactly once, and writes "
        "'=' when the formula is complete."
    ),
    "points24": (
        "You are an expert judge of the 24-points card game. The image shows four cards and the "
        "current formula. J, Q and K count as 10, A counts as 1. The player builds a formula equal "
        "to 24 one token per turn from ['1'..'10', '+', '-', '*', '/', '(', ')', '='], using each "
        "card's number exactly once, and writes '=' when the formula is complete."
    ),
    "alfworld": (
        "You are an expert judge of a text household game (ALFWorld). The player reads the task "
        "and its observation and chooses one admissible action per turn to complete the task."
    ),
}

QUESTIONS: dict[str, list[str]] = {
    "numberline": [
        "What are the current number and the target number in the image? Do the numbers in the "
        "thought match them?",
        "Is the chosen move ('+' or '-') the one that brings the current number closer to the "
        "target?",
    ],
    "blackjack": [
        "What are the player's cards and total, and the dealer's visible card and total? Does the "
        "thought match them?",
        "Is the action ('stand' or 'hit') the right one for these totals?",
    ],
    "ezpoints": [
        "Which two cards are shown? Do the ranks in the thought match them, ignoring order?",
        "What formula does the thought propose, and does it equal 12?",
        "Is the action the right next single token of that formula, or '=' if it is complete?",
    ],
    "points24": [
        "Which four cards are shown? If the target formula is 'NOT DETERMINED', call the tool "
        f"`{TOOL_NAME}` with the four ranks and remember its results.",
        "Do the ranks in the thought match the cards, ignoring order?",
        "Does the formula the thought proposes match the target formula, or one of the tool's "
        "solutions?",
        "Is the action the right next single token of the formula, or '=' if it is complete?",
    ],
    "alfworld": [
        "What is the task, and what does the current observation say about progress toward it?",
        "Is the thought consistent with the observation and the task?",
        "Is the chosen action admissible and a sensible next step toward the task?",
    ],
}


# Points24 without the solver (the paper's no-tool ablation): nothing mentions a tool.
NO_TOOL_QUESTIONS: dict[str, list[str]] = {
    "points24": [
        "Which four cards are shown? If the target formula is 'NOT DETERMINED', work out a "
        "formula that makes 24 from them, or decide that none exists.",
        "Do the ranks in the thought match the cards, ignoring order?",
        "Does the formula the thought proposes match the target formula?",
        "Is the action the right next single token of the formula, or '=' if it is complete?",
    ],
}


def questions_for(task: str, tools: bool = True) -> list[str]:
    """The task's questions; tools=False drops every mention of the solver tool."""
    return QUESTIONS[task] if tools else NO_TOOL_QUESTIONS.get(task, QUESTIONS[task])


def user_prompt(
    task: str,
    thought: dict[str, Any] | str,
    thought_keys: list[str],
    formula: str | None,
    target_formula: str | None,
    tools: bool = True,
) -> str:
    """The evaluate-then-correct request with the player's thought appended."""
    asked = questions_for(task, tools)
    questions = "\n".join(f"({i + 1}) {q}" for i, q in enumerate(asked))
    answers = ", ".join(f'"answer{i + 1}"' for i in range(len(asked)))
    keys = ", ".join(json.dumps(k) for k in thought_keys)
    lines = [
        "A player looked at the image and wrote the thought below. It may be wrong. Answer:",
        questions,
        "Then evaluate the thought. If it is wrong, choose the right next single action and write "
        "the corrected thought.",
        f'Reply with one JSON object with the keys {answers}, "evaluation" ("YES" if the '
        'thought and action are right, "NO" otherwise) and "correction" (null when the '
        f"evaluation is YES, otherwise a JSON object with exactly the keys {keys} and the "
        "corrected values).",
    ]
    if task == "points24":
        lines.append(
            'Also give "possible_solution" ("NO" when the four cards cannot make 24, else '
            '"YES") and "target_formula" (the complete formula the player should build).'
        )
    if formula is not None:
        lines.append(f"[Current Formula] '{formula}'")
    shown = thought if isinstance(thought, str) else json.dumps(thought, ensure_ascii=False)
    lines.append(f"[Thought] {shown}")
    if task == "points24":
        lines.append(f"[Target Formula] '{target_formula or NOT_DETERMINED}'")
    return "\n".join(lines)


# State keys the env computes with its solver or expert: privileged facts the agent never sees.
# A corrector learns the card games' ones only through the solver tool (issue 40: `tools = false`
# must mean no solver at all); ALFWorld's (the expert's plan, the goal conditions met, the win,
# the game file) no corrector of the paper was given (issue 55).
SOLVER_KEYS = ("solvable", "completable")
ALFWORLD_SOLVER_KEYS = (
    "expert_plan",
    "goal_progress",
    "goal_condition_success_rate",
    "won",
    "game",
)
PRIVILEGED_KEYS = SOLVER_KEYS + ALFWORLD_SOLVER_KEYS


def agent_view(state: dict[str, Any]) -> dict[str, Any]:
    """The state as the agent sees it: the solver's and the expert's facts taken out."""
    return {k: v for k, v in state.items() if k not in PRIVILEGED_KEYS}


def describe_state(state: dict[str, Any]) -> str:
    """The observation as text, for endpoints without vision (what the agent sees)."""
    return "[Observation] " + json.dumps(agent_view(state), ensure_ascii=False)


# How the prompts above speak of the image, and what a text-only model reads instead.
_TEXT_ONLY = (
    ("The image shows", "The observation shows"),
    ("looked at the image", "read the observation"),
    ("in the image", "in the observation"),
    ("the image", "the observation"),
    ("image", "observation"),
)


def text_only(text: str) -> str:
    """A prompt for a model that gets the state as text: no mention of an image is left."""
    for seen, read in _TEXT_ONLY:
        text = text.replace(seen, read)
    return text


def inline_solutions(solutions: str) -> str:
    """The solver's answer for endpoints without tool calling."""
    return f"[Result of {TOOL_NAME} for the cards shown]\n{solutions}"


# One worked answer per task (another state than the step's), for a server that does not enforce
# the answer's schema: a small model copies a shape it has seen far more reliably than one it is
# told about. The answers follow QUESTIONS in number and order.
EXAMPLES: dict[str, dict[str, Any]] = {
    "numberline": {
        "answer1": "current 3, target 1; the thought reads current 1 and target 3: no match",
        "answer2": "no: 3 > 1, so '-' brings the current number closer",
        "evaluation": "NO",
        "correction": {"current number": 3, "target number": 1, "thoughts": "3 > 1, I choose '-'"},
    },
    "blackjack": {
        "answer1": "player 10 + 9 = 19, dealer shows 7; the thought says 19 against 7: it matches",
        "answer2": "no: hitting on 19 busts on most cards; stand",
        "evaluation": "NO",
        "correction": {"thoughts": "I have 19, the dealer shows 7, so I stand"},
    },
    "ezpoints": {
        "answer1": "cards 4 and 3; the thought reads [4, 3]: they match",
        "answer2": "4 + 3 = 7, not 12; 4 * 3 = 12",
        "answer3": "no: the formula is '4', the next token is '*'",
        "evaluation": "NO",
        "correction": {
            "cards": [4, 3],
            "formula": "4",
            "thoughts": "4 * 3 = 12, next I append '*'",
        },
    },
    "points24": {
        "answer1": "cards 2, 3, 4 and 1",
        "answer2": "the thought reads [2, 3, 4, 1]: they match",
        "answer3": "no: the thought proposes (2+3)*4+1 = 21; 2*3*4*1 = 24 is a solution",
        "answer4": "no: the formula is '2', the next token is '*'",
        "evaluation": "NO",
        "correction": {
            "cards": [2, 3, 4, 1],
            "formula": "2",
            "thoughts": "2*3*4*1 = 24, next I append '*'",
        },
        "possible_solution": "YES",
        "target_formula": "2*3*4*1",
    },
    "alfworld": {
        "answer1": "put a clean mug in the coffee machine; the mug is not taken yet",
        "answer2": "no: the thought says the mug is held, the observation says it is on the table",
        "answer3": "no: 'take mug 1 from table 1' is admissible and comes first",
        "evaluation": "NO",
        "correction": {"thoughts": "the mug is on table 1: I take mug 1 from table 1"},
    },
}


def answer_format(task: str, schema: dict[str, Any] | None, keys: list[str]) -> str:
    """The answer's JSON schema and one worked example, for a prompt to a server that does not
    enforce structured output (it ignores ``response_format``, or was only asked for JSON)."""
    example = dict(EXAMPLES[task])
    shown = example["correction"]
    example["correction"] = {k: shown.get(k, "...") for k in keys}
    lines = ["Your answer is one JSON object and nothing else: no prose before or after it."]
    if schema is not None:
        lines.append("It fits this JSON schema: " + json.dumps(schema, separators=(",", ":")))
    lines.append("A worked example, for another state: " + json.dumps(example, ensure_ascii=False))
    return "\n".join(lines)
