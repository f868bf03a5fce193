"""`tools = false` leaves no trace of the solver: a text-only corrector reads the state as the
agent sees it (cards, formula), never the env's solver verdicts `solvable` / `completable`."""

from __future__ import annotations

import json
from typing import Any

from services.corrector.remote import HttpCorrector, OpenAICorrector
from services.env import make_env
from shared.schemas import CorrectionRequest, EnvConfig
from tests.services.corrector.conftest import FakeOpenAI, Reply, chat

VERDICT = {"answer1": "x", "evaluation": "YES", "correction": None, "possible_solution": "YES"}


def _real_points24_request() -> CorrectionRequest:
    """A real Points24 state one token in, as the env writes it (solver keys included)."""
    env = make_env("points24", EnvConfig(image_size=32), seed=5)
    env.reset()
    u: Any = env.unwrapped
    env.step(u.action_names.index("("))
    state = json.loads(json.dumps(u.state()))
    assert {"solvable", "completable"} <= set(state)  # the env does compute them
    output = {"cards": state["numbers"], "formula": "(", "thoughts": "I go on", "action": "2"}
    return CorrectionRequest(
        task="points24", prompt=u.prompt(), output=json.dumps(output), state=state
    )


def test_text_only_corrector_without_tools_sees_what_the_agent_sees(
    fake_openai: FakeOpenAI,
) -> None:
    req = _real_points24_request()
    fake_openai.then(chat(json.dumps(VERDICT)))
    OpenAICorrector(fake_openai.url, "m", None, {"tools": False}).correct(req)
    text = fake_openai.requests[0]["json"]["messages"][1]["content"]
    seen = json.loads(text.split("\n")[0].removeprefix("[Observation] "))
    assert seen["cards"] == req.state["cards"] and seen["formula_text"] == "("  # type: ignore[index]
    assert "solvable" not in text and "completable" not in text


def test_http_corrector_without_tools_gets_no_solver_verdicts(fake_openai: FakeOpenAI) -> None:
    req = _real_points24_request()
    base = fake_openai.url.removesuffix("/v1")
    fake_openai.then(Reply(body={"verdict": "correct"}), Reply(body={"verdict": "correct"}))
    HttpCorrector(base, None, {"tools": False}).correct(req)
    HttpCorrector(base, None, {"tools": True}).correct(req)
    off, on = (r["json"]["state"] for r in fake_openai.requests)
    assert "solvable" not in off and "completable" not in off and off["cards"]
    assert {"solvable", "completable"} <= set(on)  # the privileged protocol, tools on


def _real_alfworld_request() -> CorrectionRequest:
    """A real ALFWorld state as the env writes it: the expert's plan, the goal conditions met,
    the win and the game file included."""
    import importlib.util

    from tests.conftest import need
    from tests.services.alfworld.conftest import REAL, make

    need(importlib.util.find_spec("alfworld") is not None, "the alfworld extra is not installed")
    need(REAL.is_dir(), f"the ALFWorld sample is missing at {REAL}")
    env = make(REAL)
    state = json.loads(json.dumps(env.state()))
    assert {"expert_plan", "goal_progress", "won", "game"} <= set(state)
    output = {"thoughts": "I look for the potato", "action": "look"}
    return CorrectionRequest(
        task="alfworld", prompt=env.prompt(), output=json.dumps(output), state=state
    )


ALFWORLD_PRIVATE = ("expert_plan", "goal_progress", "goal_condition_success_rate", "won", "game")


def test_alfworld_text_only_corrector_gets_no_expert_facts(fake_openai: FakeOpenAI) -> None:
    """The leak closed for the card games is closed on ALFWorld too (issue 55): a text-only
    corrector reads the task, what is in front and held, the admissible actions, never the
    expert's plan, the goal conditions met, the win or the game file."""
    req = _real_alfworld_request()
    fake_openai.then(chat(json.dumps({"evaluation": "YES", "correction": None})))
    OpenAICorrector(fake_openai.url, "m", None, {"tools": False, "vision": False}).correct(req)
    text = fake_openai.requests[0]["json"]["messages"][1]["content"]
    seen = json.loads(text.split("\n")[0].removeprefix("[Observation] "))
    assert seen["task"] == req.state["task"] and seen["admissible"]  # type: ignore[index]
    for key in ALFWORLD_PRIVATE:
        assert key not in seen, key


def test_alfworld_http_corrector_without_tools_gets_no_expert_facts(
    fake_openai: FakeOpenAI,
) -> None:
    req = _real_alfworld_request()
    base = fake_openai.url.removesuffix("/v1")
    fake_openai.then(Reply(body={"verdict": "correct"}))
    HttpCorrector(base, None, {"tools": False}).correct(req)
    sent = fake_openai.requests[0]["json"]["state"]
    assert sent["admissible"] and not set(ALFWORLD_PRIVATE) & set(sent)
