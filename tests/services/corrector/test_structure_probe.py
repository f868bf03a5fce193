"""A server that ignores structured output (it answers 200 and drops ``response_format``, as
``transformers serve`` does): ``gtr corrector test`` finds out and says so, the prompt then
carries the schema and a worked example, and a malformed answer's reason is shown."""

from __future__ import annotations

import json
from typing import Any

from click.testing import CliRunner

from services.corrector.base import CallTrace, CorrectorError
from services.corrector.cli import corrector as corrector_cli
from services.corrector.registry import describe_probe
from services.corrector.remote import OpenAICorrector
from shared.schemas import CorrectionRequest
from tests.services.corrector.conftest import FakeOpenAI, Reply, chat

YES = {"answer1": "2 and 4", "answer2": "yes", "evaluation": "YES", "correction": None}
SCHEMA_SAID = "It fits this JSON schema"


def _system(body: dict[str, Any]) -> str:
    return str(body["messages"][0]["content"])


def prose_unless_shown(body: dict[str, Any]) -> Reply:
    """A small chat model behind a server that ignores ``response_format``: prose with no JSON,
    unless the prompt shows the schema and an example; then prose around the JSON object."""
    if SCHEMA_SAID in _system(body):
        return chat(f"Sure! Here is my evaluation:\n{json.dumps(YES)}\nHope this helps.")
    return chat("The player read both numbers right and moves toward the target. Looks good!")


def _request() -> CorrectionRequest:
    agent = {"current number": 2, "target number": 4, "thoughts": "2 < 4", "action": "+"}
    state = {"current": 2, "target": 4}
    return CorrectionRequest(task="numberline", prompt="p", output=json.dumps(agent), state=state)


def test_the_probe_finds_a_server_that_ignores_response_format(fake_openai: FakeOpenAI) -> None:
    fake_openai.respond = prose_unless_shown
    corrector = OpenAICorrector(fake_openai.url, "m", None, {"max_retries": 0})
    found = corrector.probe()
    assert [(h.level, h.outcome) for h in found] == [
        ("json_schema", "ignored"),
        ("json_object_schema", "ignored"),
        ("json_object", "ignored"),
    ]
    said = describe_probe(found)
    assert "NOT enforced" in said and "schema and a worked example" in said
    # Each probe asked for its level; the correction then asks for none and shows the schema.
    formats = [r["json"]["response_format"]["type"] for r in fake_openai.requests]
    assert formats == ["json_schema", "json_object", "json_object"]
    assert corrector.correct(_request()).verdict == "correct"
    sent = fake_openai.requests[-1]["json"]
    assert "response_format" not in sent
    system = _system(sent)
    assert SCHEMA_SAID in system and '"evaluation":"NO"' not in system  # the schema, compact
    example = json.loads(system.split("A worked example, for another state: ")[1])
    assert set(example["correction"]) == {"current number", "target number", "thoughts"}


def test_a_server_that_enforces_the_schema_is_left_alone(fake_openai: FakeOpenAI) -> None:
    fake_openai.then(chat('{"probe": "kiwi-7"}'), chat(json.dumps(YES)))
    corrector = OpenAICorrector(fake_openai.url, "m", None, {"max_retries": 0})
    found = corrector.probe()
    assert [(h.level, h.outcome) for h in found] == [("json_schema", "enforced")]
    assert "is enforced with json_schema" in describe_probe(found)
    assert corrector.correct(_request()).verdict == "correct"
    sent = fake_openai.requests[-1]["json"]
    assert sent["response_format"]["type"] == "json_schema" and SCHEMA_SAID not in _system(sent)


def test_without_a_probe_the_first_stray_answer_switches_the_prompt(
    fake_openai: FakeOpenAI,
) -> None:
    """A run does not probe: the first answer that ignores the requested schema fails (with its
    reason), and from then on the prompt carries the schema and the example."""
    fake_openai.respond = prose_unless_shown
    corrector = OpenAICorrector(fake_openai.url, "m", None, {"max_retries": 0})
    trace = CallTrace()
    try:
        corrector.correct(_request(), trace)
        raise AssertionError("a prose answer must fail")
    except CorrectorError as e:
        assert e.kind == "malformed" and e.reason.startswith("answer is not JSON")
    assert corrector.schema_enforced is False
    assert corrector.correct(_request()).verdict == "correct"
    first, second = (r["json"] for r in fake_openai.requests)
    assert SCHEMA_SAID not in _system(first) and SCHEMA_SAID in _system(second)


def test_a_wrong_answer_in_the_schema_does_not_switch_the_prompt(fake_openai: FakeOpenAI) -> None:
    """A server that enforces the schema (llama.cpp's grammar) can still carry a model's own
    mistake: NO without a correction fits the schema. That answer fails with its reason, but the
    server is not taken for one that ignores the schema."""
    no_fix = json.dumps({**YES, "evaluation": "NO"})
    fake_openai.then(chat('{"probe": "kiwi-7"}'), chat(no_fix), chat(json.dumps(YES)))
    corrector = OpenAICorrector(fake_openai.url, "m", None, {"max_retries": 0})
    corrector.probe()
    try:
        corrector.correct(_request())
        raise AssertionError("NO without a correction must fail")
    except CorrectorError as e:
        assert e.reason == "evaluation is NO but 'correction' is no JSON object"
    assert corrector.schema_enforced is True
    assert corrector.correct(_request()).verdict == "correct"
    last = fake_openai.requests[-1]["json"]
    assert last["response_format"]["type"] == "json_schema" and SCHEMA_SAID not in _system(last)


def _register(fake: FakeOpenAI) -> str:
    name = f"probe-{fake.url.split('/')[-2]}"
    added = CliRunner().invoke(corrector_cli, ["add", name, "--base-url", fake.url, "--model", "m"])
    assert added.exit_code == 0, added.output
    return name


def test_gtr_corrector_test_says_what_the_server_honours(fake_openai: FakeOpenAI) -> None:
    fake_openai.respond = prose_unless_shown
    name = _register(fake_openai)
    tried = CliRunner().invoke(corrector_cli, ["test", name])
    assert tried.exit_code == 0, tried.output
    assert (
        "structured output: json_schema ignored, json_object_schema ignored, json_object "
        "ignored: the schema is NOT enforced by this server" in tried.output
    )
    for level in ("json_schema", "json_object_schema", "json_object"):  # each answer's reason
        assert f"  {level} ignored: malformed: answer is not JSON\n" in tried.output
    assert "verdict: correct" in tried.output and "Hope this helps." in tried.output
    assert "4 request(s)" in tried.output  # three probes and the sample


def test_gtr_corrector_test_gives_the_reason_of_a_malformed_answer(
    fake_openai: FakeOpenAI,
) -> None:
    fake_openai.default = chat("I think the player is <b>right</b>.")
    name = _register(fake_openai)
    tried = CliRunner().invoke(corrector_cli, ["test", name])
    assert tried.exit_code == 1
    assert "error: malformed: answer is not JSON" in tried.output, tried.output
    assert "raw answer: I think the player is <b>right</b>." in tried.output
    fake_openai.default = chat(json.dumps({**YES, "evaluation": "NO"}))
    wrong = CliRunner().invoke(corrector_cli, ["test", name])
    assert "error: malformed: evaluation is NO but 'correction' is no JSON object" in wrong.output


def test_the_probe_of_a_server_that_is_down_says_nothing_is_known() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    corrector = OpenAICorrector(f"http://127.0.0.1:{port}/v1", "m", None, {"max_retries": 0})
    found = corrector.probe()
    assert [(h.level, h.outcome) for h in found] == [("json_schema", "failed")]
    said = describe_probe(found)
    assert said.endswith(
        "(transport: the endpoint could not be reached (refused, reset or timed out)); not known"
    )
    assert corrector.schema_enforced is None  # nothing learnt: the run asks as before
