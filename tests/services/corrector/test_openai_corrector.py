"""The OpenAI-compatible corrector against a real local server speaking chat completions."""

from __future__ import annotations

import base64
import io
import json
import time

import pytest
from PIL import Image

from services.corrector.base import CallTrace, CorrectorError
from services.corrector.remote import OpenAICorrector
from services.corrector.resilience import Budget, BudgetExceeded
from shared.schemas import CorrectionRequest
from tests.services.corrector.conftest import FakeOpenAI, Reply, chat
from tests.services.corrector.helpers import alfworld_states

FAST = {"backoff_base_s": 0.01, "backoff_max_s": 0.05, "timeout_s": 5}
AGENT = {
    "current number": 2,
    "target number": 4,
    "thoughts": "2 is below 4, so I add 1",
    "action": "+",
}


def _png() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), "white").save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _request(output: dict | str = AGENT) -> CorrectionRequest:
    text = output if isinstance(output, str) else json.dumps(output)
    return CorrectionRequest(
        task="numberline",
        image_png_b64=_png(),
        prompt="Move toward the target.",
        output=text,
        state={"current": 2, "target": 4},
    )


def _answer(evaluation: str, correction: dict | None = None) -> str:
    return json.dumps(
        {
            "answer1": "current 2, target 4",
            "answer2": "+ is right",
            "evaluation": evaluation,
            "correction": correction,
        }
    )


def _corrector(fake: FakeOpenAI, budget: Budget | None = None, **params) -> OpenAICorrector:
    return OpenAICorrector(fake.url, "fake-model", "sk-test-secret", {**FAST, **params}, budget)


def test_correct_verdict_and_what_is_sent(fake_openai: FakeOpenAI) -> None:
    fake_openai.then(chat(_answer("YES"), tokens=77))
    trace = CallTrace()
    result = _corrector(fake_openai, vision=True).correct(_request(), trace)
    assert result.verdict == "correct" and result.corrected_thought is None
    assert result.tokens == 77 and trace.attempts == 1 and result.latency_ms > 0
    assert "answer1: current 2" in result.reasoning
    sent = fake_openai.requests[0]
    assert sent["path"].endswith("/v1/chat/completions")
    assert sent["headers"]["authorization"] == "Bearer sk-test-secret"
    body = sent["json"]
    assert body["model"] == "fake-model" and body["temperature"] == 0.4
    assert body["response_format"]["type"] == "json_schema" and "tools" not in body
    user = body["messages"][1]["content"]
    assert user[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert '[Thought] {"current number": 2, "target number": 4' in user[0]["text"]
    assert '"action"' not in user[0]["text"].split("[Thought]")[1]


def test_incorrect_gives_the_corrected_thought_in_the_agents_key_order(
    fake_openai: FakeOpenAI,
) -> None:
    fixed = {
        "thoughts": "4 is above 2: add 1",
        "target number": 4,
        "current number": 2,
        "action": "+",
    }
    fake_openai.then(chat(_answer("NO", fixed)))
    result = _corrector(fake_openai).correct(_request({**AGENT, "current number": 5}))
    assert result.verdict == "incorrect"
    assert list(json.loads(result.corrected_thought or "")) == [
        "current number",
        "target number",
        "thoughts",
    ]


def test_vision_off_sends_one_plain_string_that_never_mentions_an_image(
    fake_openai: FakeOpenAI,
) -> None:
    # llama.cpp's chat templates drop list content: a text-only request must be a plain string.
    fake_openai.then(chat(_answer("YES")))
    _corrector(fake_openai).correct(_request())  # vision is off unless declared
    system, user = fake_openai.requests[0]["json"]["messages"]
    assert isinstance(user["content"], str) and isinstance(system["content"], str)
    assert '"target": 4' in user["content"] and "[Thought]" in user["content"]
    assert "image" not in (system["content"] + user["content"]).lower()


@pytest.mark.parametrize("task", ["numberline", "blackjack", "ezpoints", "points24"])
def test_text_only_prompts_of_every_task_speak_of_the_observation(task: str) -> None:
    from services.corrector import prompts

    text = prompts.text_only(
        prompts.SYSTEM[task] + prompts.user_prompt(task, "t", ["thoughts"], "1+", None)
    )
    assert "image" not in text.lower() and "observation" in text


def test_structured_output_degrades_step_by_step_as_the_server_refuses(
    fake_openai: FakeOpenAI,
) -> None:
    refused = Reply(400, {"error": {"message": "response_format type not supported"}})
    prose = "Sure! Here is my verdict:\n" + _answer("YES") + "\nHope this helps."
    fake_openai.then(refused, refused, refused, chat(prose), chat(_answer("YES")))
    corrector = _corrector(fake_openai)
    assert corrector.correct(_request()).verdict == "correct"  # extracted from the prose
    assert corrector.correct(_request()).verdict == "correct"
    formats = [r["json"].get("response_format") for r in fake_openai.requests]
    schema = formats[0]["json_schema"]["schema"]
    assert formats[0]["type"] == "json_schema"
    assert schema["properties"]["evaluation"]["enum"] == ["YES", "NO"]
    correction = schema["properties"]["correction"]["anyOf"][1]
    assert correction["required"] == ["current number", "target number", "thoughts"]
    assert schema["required"] == ["answer1", "answer2", "evaluation", "correction"]
    assert formats[1] == {"type": "json_object", "schema": schema}  # llama-cpp-python's form
    assert formats[2] == {"type": "json_object"}
    assert formats[3] is None and formats[4] is None  # remembered: no more refusals


@pytest.mark.parametrize(
    "content, why",
    [
        ("this is not json", "not JSON"),
        (json.dumps({"answer1": "x"}), "evaluation"),
        (json.dumps({"evaluation": "MAYBE"}), "YES or NO"),
        (_answer("NO", None), "no JSON object"),
        (_answer("NO", {"thoughts": "add one"}), "lacks the keys"),
    ],
)
def test_malformed_answers_fail_with_their_reason(
    fake_openai: FakeOpenAI, content: str, why: str
) -> None:
    fake_openai.then(chat(content))
    trace = CallTrace()
    with pytest.raises(CorrectorError) as err:
        _corrector(fake_openai).correct(_request({**AGENT, "current number": 5}), trace)
    assert err.value.kind == "malformed" and why in err.value.reason
    assert err.value.raw == content and trace.tokens == 30


def test_a_500_then_success_is_retried(fake_openai: FakeOpenAI) -> None:
    fake_openai.then(Reply(500, {"error": {"message": "boom"}}), chat(_answer("YES")))
    trace = CallTrace()
    assert _corrector(fake_openai).correct(_request(), trace).verdict == "correct"
    assert trace.attempts == 2 and len(fake_openai.requests) == 2


def test_a_timeout_is_retried(fake_openai: FakeOpenAI) -> None:
    slow = chat(_answer("YES"))
    slow.delay_s = 1.5
    fake_openai.then(slow, chat(_answer("YES")))
    trace = CallTrace()
    assert _corrector(fake_openai, timeout_s=0.3).correct(_request(), trace).verdict == "correct"
    assert trace.attempts == 2


def test_retries_give_up_with_a_transport_failure(fake_openai: FakeOpenAI) -> None:
    fake_openai.default = Reply(503, {"error": {"message": "overloaded"}})
    trace = CallTrace()
    with pytest.raises(CorrectorError) as err:
        _corrector(fake_openai, max_retries=2).correct(_request(), trace)
    assert err.value.kind == "transport" and "HTTP 503" in err.value.reason
    assert trace.attempts == 3 and len(fake_openai.requests) == 3


def test_a_client_error_is_not_retried(fake_openai: FakeOpenAI) -> None:
    fake_openai.default = Reply(401, {"error": {"message": "bad key"}})
    with pytest.raises(CorrectorError) as err:
        _corrector(fake_openai).correct(_request())
    assert err.value.kind == "transport" and "401" in err.value.reason
    assert len(fake_openai.requests) == 1


def test_429_honours_retry_after(fake_openai: FakeOpenAI) -> None:
    fake_openai.then(
        Reply(429, {"error": {"message": "slow down"}}, {"Retry-After": "1"}), chat(_answer("YES"))
    )
    start = time.monotonic()
    trace = CallTrace()
    # The backoff alone would wait ~10 ms: only the server's Retry-After explains a 1 s wait.
    assert _corrector(fake_openai).correct(_request(), trace).verdict == "correct"
    assert time.monotonic() - start >= 0.95 and trace.attempts == 2


def test_the_call_budget_runs_out(fake_openai: FakeOpenAI) -> None:
    fake_openai.default = chat(_answer("YES"), tokens=10)
    budget = Budget(max_calls=2)
    corrector = _corrector(fake_openai, budget)
    corrector.correct(_request())
    corrector.correct(_request())
    with pytest.raises(BudgetExceeded, match="call budget of 2"):
        corrector.correct(_request())
    assert len(fake_openai.requests) == 2 and budget.tokens == 20


def test_the_token_budget_runs_out(fake_openai: FakeOpenAI) -> None:
    fake_openai.default = chat(_answer("YES"), tokens=60)
    corrector = _corrector(fake_openai, Budget(max_tokens=100))
    corrector.correct(_request())
    corrector.correct(_request())
    with pytest.raises(BudgetExceeded, match="token budget"):
        corrector.correct(_request())
    assert len(fake_openai.requests) == 2


def test_the_circuit_opens_then_half_opens_and_closes(fake_openai: FakeOpenAI) -> None:
    corrector = _corrector(fake_openai, max_retries=0, breaker_threshold=2, breaker_cooldown_s=0.5)
    fake_openai.then(Reply(500, {}), Reply(500, {}))
    for _ in range(2):
        with pytest.raises(CorrectorError, match="transport"):
            corrector.correct(_request())
    with pytest.raises(CorrectorError) as err:
        corrector.correct(_request())
    assert err.value.kind == "circuit_open" and len(fake_openai.requests) == 2
    time.sleep(0.6)
    fake_openai.then(Reply(500, {}))  # the half-open trial fails: open again at once
    with pytest.raises(CorrectorError, match="transport"):
        corrector.correct(_request())
    assert corrector.breaker.state == "open"
    time.sleep(0.6)
    fake_openai.then(chat(_answer("YES")))
    assert corrector.correct(_request()).verdict == "correct"
    assert corrector.breaker.state == "closed" and len(fake_openai.requests) == 4


def test_malformed_answers_do_not_open_the_circuit(fake_openai: FakeOpenAI) -> None:
    fake_openai.default = chat("not json")
    corrector = _corrector(fake_openai, breaker_threshold=1)
    for _ in range(3):
        with pytest.raises(CorrectorError, match="malformed"):
            corrector.correct(_request())
    assert corrector.breaker.state == "closed"


def test_alfworld_uses_its_own_prompt_and_keys(fake_openai: FakeOpenAI) -> None:
    state = next(alfworld_states(1))
    agent = {"thoughts": "I am lost", "action": "look"}
    fixed = {"thoughts": "I should go to the countertop", "action": "go to countertop 1"}
    fake_openai.then(chat(json.dumps({"evaluation": "NO", "correction": fixed})))
    req = CorrectionRequest.model_validate(
        {
            "task": "alfworld",
            "prompt": "p",
            "output": json.dumps(agent),
            "state": state,
            "history": ["look"],
        }
    )
    result = _corrector(fake_openai).correct(req)
    assert json.loads(result.corrected_thought or "") == {"thoughts": fixed["thoughts"]}
    body = fake_openai.requests[0]["json"]
    assert body["max_tokens"] == 600
    assert "[Admissible actions]" in body["messages"][1]["content"]


def test_alfworld_without_the_state_is_judged_from_its_prompt(fake_openai: FakeOpenAI) -> None:
    """A request with no privileged state (any client of POST /v1/correct may send one) gets the
    corrector's own ALFWorld prompt, read from the agent's prompt; the answers it asks for are
    the ones the schema holds, as many as the env's prompt with the state asks for."""
    from services.corrector import prompts
    from services.env.alfworld.prompts import corrector_prompt

    agent = {"thoughts": "the mug is on the counter", "action": "take mug 1 from countertop 1"}
    answers = {"answer1": "a", "answer2": "b", "answer3": "c", "evaluation": "YES"}
    fake_openai.then(chat(json.dumps({**answers, "correction": None})))
    req = CorrectionRequest(
        task="alfworld",
        prompt="Your task is to: put a clean mug in the coffeemachine.",
        output=json.dumps(agent),
    )
    assert _corrector(fake_openai).correct(req).verdict == "correct"
    body = fake_openai.requests[0]["json"]
    system, user = (m["content"] for m in body["messages"])
    assert system == prompts.text_only(prompts.SYSTEM["alfworld"])
    assert user.startswith("[Prompt] Your task is to: put a clean mug in the coffeemachine.")
    assert prompts.text_only(prompts.QUESTIONS["alfworld"][1]) in user and "[Thought]" in user
    schema = body["response_format"]["json_schema"]["schema"]
    asked = [k for k in schema["properties"] if k.startswith("answer")]
    assert asked == ["answer1", "answer2", "answer3"]
    _, with_state = corrector_prompt(next(alfworld_states(1)), [], json.dumps(agent))
    assert all(f'"{k}"' in with_state for k in asked) and '"answer4"' not in with_state


@pytest.mark.parametrize(
    "body, why",
    [
        ("<html>Bad gateway</html>", "unreadable response"),
        ({"choices": []}, "not a chat completion"),
        ({"object": "error"}, "not a chat completion"),
        ({"choices": [{"message": {"role": "assistant", "content": None}}]}, "no text content"),
    ],
)
def test_bodies_that_are_not_chat_completions(fake_openai: FakeOpenAI, body, why: str) -> None:  # type: ignore[no-untyped-def]
    fake_openai.then(Reply(body=body))
    with pytest.raises(CorrectorError) as err:
        _corrector(fake_openai).correct(_request())
    assert err.value.kind == "malformed" and why in err.value.reason


def test_a_500_that_refuses_the_request_shape_steps_down_instead_of_retrying(
    fake_openai: FakeOpenAI,
) -> None:
    # What llama-cpp-python 0.3.36 answers to response_format json_schema.
    refused = Reply(
        500,
        {
            "error": {
                "message": "1 validation error: {'loc': ('body', 'response_format', 'type'), "
                "'msg': \"Input should be 'text' or 'json_object'\"}",
                "type": "internal_server_error",
            }
        },
    )
    fake_openai.then(refused, chat(_answer("YES")))
    assert _corrector(fake_openai).correct(_request()).verdict == "correct"
    first, second = (r["json"]["response_format"]["type"] for r in fake_openai.requests)
    assert (first, second) == ("json_schema", "json_object")
