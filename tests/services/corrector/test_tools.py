"""Points24: tool calling with the solver, several rounds, the answer inlined for an endpoint
that refuses tools, and no solver at all with tools off (the no-tool ablation)."""

from __future__ import annotations

import json

import pytest

from services.corrector.base import CallTrace, CorrectorError
from services.corrector.remote import OpenAICorrector
from services.corrector.tools import NO_SOLUTION, TOOL_NAME, card_value, run_tool, solve_text
from services.env.solver import solve
from shared.schemas import CorrectionRequest
from tests.services.corrector.conftest import FakeOpenAI, Reply, chat, tool_call

AGENT = {"cards": [10, 4, 2, 1], "formula": "(", "thoughts": "I start with '('", "action": "("}
CARDS = {"card1": "K", "card2": "4", "card3": "2", "card4": "A"}


def _request(state: dict | None = None) -> CorrectionRequest:
    return CorrectionRequest(
        task="points24", prompt="Make 24.", output=json.dumps(AGENT), state=state
    )


def _final(target: str) -> str:
    return json.dumps(
        {
            "answer1": "K 4 2 A",
            "answer2": "yes",
            "answer3": "yes",
            "answer4": "yes",
            "evaluation": "YES",
            "correction": None,
            "possible_solution": "YES",
            "target_formula": target,
        }
    )


def test_tool_call_round_trip(fake_openai: FakeOpenAI) -> None:
    fake_openai.then(
        chat(None, [tool_call("call_1", TOOL_NAME, CARDS)], tokens=40),
        chat(_final("(10+2)*(4-1)"), tokens=50),
    )
    trace = CallTrace()
    corrector = OpenAICorrector(fake_openai.url, "m", None, {"backoff_base_s": 0.01})
    result = corrector.correct(_request(), trace)
    assert result.verdict == "correct" and result.extras["target_formula"] == "(10+2)*(4-1)"
    assert result.tokens == 90 and trace.attempts == 2
    first, second = (r["json"] for r in fake_openai.requests)
    assert first["tools"][0]["function"]["name"] == TOOL_NAME
    assert "[Target Formula] 'NOT DETERMINED'" in first["messages"][1]["content"]
    assistant, tool = second["messages"][-2:]
    assert assistant["tool_calls"][0]["id"] == "call_1"
    assert tool == {"role": "tool", "tool_call_id": "call_1", "content": solve_text([10, 4, 2, 1])}
    assert tool["content"].split("\n")[0] == solve([10, 4, 2, 1], 24)[0]


def test_several_tool_rounds_then_a_tool_less_final_call(fake_openai: FakeOpenAI) -> None:
    bad = {**CARDS, "card4": "Z"}
    fake_openai.then(
        chat(None, [tool_call("a", TOOL_NAME, bad)]),
        chat(None, [tool_call("b", TOOL_NAME, CARDS)]),
        chat(_final("(10+2)*(4-1)")),
    )
    corrector = OpenAICorrector(fake_openai.url, "m", None, {"max_tool_rounds": 2})
    assert corrector.correct(_request()).verdict == "correct"
    bodies = [r["json"] for r in fake_openai.requests]
    assert ["tools" in b for b in bodies] == [True, True, False]
    assert bodies[1]["messages"][-1]["content"].startswith("error: bad arguments")


def test_tools_off_is_a_corrector_without_the_solver(fake_openai: FakeOpenAI) -> None:
    # The paper's no-tool ablation: no tool offered, no solver answer pasted, no tool named.
    fake_openai.then(chat(_final("(10+2)*(4-1)")))
    corrector = OpenAICorrector(fake_openai.url, "m", None, {"tools": False})
    corrector.correct(_request({"cards": [13, 4, 2, 1], "formula": []}))
    body = fake_openai.requests[0]["json"]
    content = body["messages"][1]["content"]  # a plain string: no image unless vision is on
    text = content if isinstance(content, str) else content[0]["text"]
    assert "tools" not in body
    assert solve_text([10, 4, 2, 1]).split("\n")[0] not in text and TOOL_NAME not in text
    assert "[Target Formula] 'NOT DETERMINED'" in text and "work out a formula" in text


@pytest.mark.parametrize(
    "rank, value", [("A", 1), ("7", 7), ("10", 10), ("J", 10), ("k", 10), (12, 10)]
)
def test_card_values(rank: str, value: int) -> None:
    assert card_value(rank) == value


def test_run_tool_reports_no_solution_and_unknown_tools() -> None:
    assert (
        run_tool(TOOL_NAME, json.dumps({"card1": "A", "card2": "A", "card3": "A", "card4": "A"}))
        == NO_SOLUTION
    )
    assert run_tool("rm_rf", "{}").startswith("error: unknown tool")


def test_an_endpoint_refusing_tools_gets_plain_requests(fake_openai: FakeOpenAI) -> None:
    refusal = Reply(
        400, {"error": {"message": '"auto" tool choice requires --enable-auto-tool-choice'}}
    )
    fake_openai.then(refusal, chat(_final("(10+2)*(4-1)")), chat(_final("(10+2)*(4-1)")))
    corrector = OpenAICorrector(fake_openai.url, "m", None, {"backoff_base_s": 0.01})
    state = {"numbers": [10, 4, 2, 1], "formula": [], "target_formula": "NOT DETERMINED"}
    trace = CallTrace()
    assert corrector.correct(_request(state), trace).verdict == "correct"
    corrector.correct(_request(state))
    first, second, third = (r["json"] for r in fake_openai.requests)
    assert "tools" in first and "response_format" in first
    for body in (second, third):  # tools dropped first; the schema then constrains the answer
        assert "tools" not in body and body["response_format"]["type"] == "json_schema"
        assert solve_text([10, 4, 2, 1]) in body["messages"][1]["content"]
    assert trace.attempts == 2


def test_a_refusal_without_tools_to_drop_is_a_failure(fake_openai: FakeOpenAI) -> None:
    fake_openai.default = Reply(400, {"error": {"message": "image input is not supported"}})
    corrector = OpenAICorrector(fake_openai.url, "m", None, {"tools": False, "json_mode": False})
    with pytest.raises(CorrectorError, match="HTTP 400: image input is not supported"):
        corrector.correct(_request())
    assert len(fake_openai.requests) == 1
