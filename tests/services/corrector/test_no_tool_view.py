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
