"""Bring your own corrector: adaptive concurrency against a server that answers one request at a
time, one call per step, and no retry storm through our own `/v1/correct` service."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import select

from services.controller.backends import (
    ThreadCorrections,
    record_missing_as_failed,
    withdraw_backlog,
)
from services.corrector.app import create_app
from services.corrector.base import CallTrace, CorrectorError
from services.corrector.remote import HttpCorrector, OpenAICorrector
from services.corrector.resilience import AdaptiveLimit
from shared.db import models
from shared.db.session import session_scope
from shared.schemas import CorrectionRequest
from shared.settings import get_settings
from tests.conftest import live_server
from tests.services.corrector.conftest import FakeOpenAI, OneSlot, Reply, chat
from tests.services.corrector.helpers import make_run, make_step

STATE = {"current": 2, "target": 4}
YES = json.dumps({"answer1": "2 and 4", "answer2": "yes", "evaluation": "YES", "correction": None})


def _agent(i: int) -> dict:
    return {"current number": 2, "target number": 4, "thoughts": f"step {i}", "action": "+"}


def _request(i: int) -> CorrectionRequest:
    return CorrectionRequest(
        task="numberline", prompt="p", output=json.dumps(_agent(i)), state=STATE
    )


def _thoughts(fake: FakeOpenAI) -> list[str]:
    """Which step each request to the fake was about."""
    return [
        json.loads(r["json"]["messages"][1]["content"].split("[Thought] ")[1])["thoughts"]
        for r in fake.requests
    ]


def test_aimd_grows_while_latency_holds_and_halves_once_per_overload() -> None:
    limit = AdaptiveLimit(max_limit=8, start=1)
    for _ in range(1 + 2 + 3):  # fast answers: +1 after each window of `limit` calls
        limit.feedback(limit.acquire(), 0.1, False)
        limit.release()
    assert limit.limit == 4
    tickets = [limit.acquire() for _ in range(4)]
    for t in tickets:  # four requests sent together all time out: one cut, not four
        limit.feedback(t, None, True)
        limit.release()
    assert limit.limit == 2 and limit.cuts == 1
    for _ in range(6):  # queueing at the server (latency x3): the limit holds
        limit.feedback(limit.acquire(), 0.3, False)
        limit.release()
    assert limit.limit == 2


def test_a_one_at_a_time_server_gets_each_step_once_without_timeouts(
    fake_openai: FakeOpenAI,
) -> None:
    fake_openai.serial = OneSlot()  # like llama.cpp with one slot: the rest queue in line
    # Three times the scale first written (0.1 s, 0.6 s): the same queue-to-timeout ratios, and
    # a loaded host's scheduling jitter (tenths of a second) no longer times out a request.
    fake_openai.default = Reply(body=chat(YES).body, delay_s=0.3)
    params = {"timeout_s": 1.8, "max_retries": 2, "backoff_base_s": 0.01, "concurrency": 8}
    corrector = OpenAICorrector(fake_openai.url, "m", None, params)
    with ThreadPoolExecutor(8) as pool:  # the embedded pool's eight threads
        results = list(pool.map(lambda i: corrector.correct(_request(i)).verdict, range(16)))
    assert results == ["correct"] * 16
    # AIMD kept the queue at the server short: nothing timed out, nothing was sent twice.
    assert sorted(_thoughts(fake_openai)) == sorted(f"step {i}" for i in range(16))
    # At most 5 in flight: the last in the server's line waits 5 x 0.3 s, inside the 1.8 s
    # timeout (a loaded host's slower answers once opened it to 5; the fixed 8 would time out).
    assert corrector.limit.peak_in_flight <= 5 < 8


def test_a_fixed_concurrency_of_8_times_out_on_the_same_server(fake_openai: FakeOpenAI) -> None:
    fake_openai.serial = OneSlot()
    fake_openai.default = Reply(body=chat(YES).body, delay_s=0.1)
    params = {"timeout_s": 0.45, "max_retries": 0, "concurrency": 8, "adaptive": False}
    corrector = OpenAICorrector(fake_openai.url, "m", None, params)

    def one(i: int) -> str:
        try:
            return corrector.correct(_request(i)).verdict
        except CorrectorError as e:
            return e.reason

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    assert any("timeout" in r for r in results), results  # what the issue saw, for contrast


def test_unusable_answer_is_422_through_our_service_never_retried(
    fake_openai: FakeOpenAI,
) -> None:
    garbage = "I think the player is right!! <b>yes</b>"
    fake_openai.default = chat(garbage)
    backend = OpenAICorrector(fake_openai.url, "m", None, {"max_retries": 0})
    with live_server(create_app(backend, "openai")) as url:
        client = HttpCorrector(url, params={"max_retries": 4, "backoff_base_s": 0.01})
        trace = CallTrace()
        with pytest.raises(CorrectorError) as err:
            client.correct(_request(0), trace)
    assert len(fake_openai.requests) == 1 and trace.attempts == 1  # one model call, no retries
    assert err.value.kind == "malformed" and "HTTP 422" in err.value.reason
    assert "not JSON" in err.value.reason and err.value.raw == garbage


def test_embedded_pool_calls_each_step_once_and_reports_its_backlog(
    pg_url: str, fake_openai: FakeOpenAI
) -> None:
    fake_openai.serial = OneSlot()
    # Each answer takes 1 s: the run's withdrawal below comes well before a slot frees.
    fake_openai.default = Reply(body=chat(YES).body, delay_s=1.0)
    inline = {"name": "byo", "kind": "openai", "base_url": fake_openai.url, "model": "m"}
    inline["params"] = {"max_retries": 0, "concurrency": 1, "timeout_s": 5}
    with session_scope() as s:
        run = make_run(s, corrector={"name": "byo"})
        steps = [make_step(s, "numberline", STATE, _agent(i), run=run, idx=i).id for i in range(4)]
        run_id = run.id
    pool = ThreadCorrections("byo", 0.0, 0, get_settings(), inline=inline)
    pool.submit(run_id, steps)
    pool.submit(run_id, steps)  # a sweep sending them again must not call twice
    deadline = threading.Event()
    while not pool._running and not deadline.wait(0.02):  # the first step is sent
        pass
    waiting = sorted(pool.backlog(steps))
    assert len(waiting) == 3  # one slot: the other three wait, unsent
    # The run gives up on two of them: taken out of the queue, recorded skipped, never sent.
    # (Withdrawn, not just read: a slot freeing in between must not send one recorded unsent.)
    gone = withdraw_backlog(pool, waiting[:2])
    assert gone == set(waiting[:2]) and not pool.backlog(waiting[:2])
    # A slot frees (the first answer) before the run records them: it must go to the one
    # step still queued, not to a withdrawn one.
    limit = time.monotonic() + 10
    while waiting[2] not in pool.in_flight(steps) and time.monotonic() < limit:
        time.sleep(0.02)
    assert waiting[2] in pool.in_flight(steps)
    record_missing_as_failed(run_id, waiting[:2], "byo", 1.0, gone)
    pool.close()
    with session_scope() as s:
        rows = s.scalars(
            select(models.Correction).where(models.Correction.step_id.in_(steps))
        ).all()
        outcome = {r.step_id: (r.status, (r.error or "")[:16]) for r in rows}
    assert len(fake_openai.requests) == 2  # each step at most once; the withdrawn ones never
    assert sorted(_thoughts(fake_openai)) == sorted(
        f"step {steps.index(i)}" for i in steps if i not in gone
    )
    assert [outcome[i] for i in waiting[:2]] == [("failed", "skipped: backlog")] * 2
    assert sorted(v for k, v in outcome.items() if k not in gone) == [("done", "")] * 2


def test_cli_add_list_test_rm_on_the_settings_database(fake_openai: FakeOpenAI) -> None:
    from click.testing import CliRunner

    from services.corrector.cli import corrector

    fake_openai.default = chat(YES, tokens=12)
    run = CliRunner().invoke
    name = f"cli-{fake_openai.url.split('/')[-2]}"
    added = run(corrector, ["add", name, "--base-url", fake_openai.url, "--model", "m"])
    assert added.exit_code == 0, added.output
    again = run(corrector, ["add", name, "--base-url", fake_openai.url, "--model", "m"])
    assert again.exit_code == 1 and "exists" in again.output
    bad = run(corrector, ["add", "x", "--base-url", "ftp://h", "--params", '{"nope": 1}'])
    assert bad.exit_code != 0 and "Traceback" not in bad.output
    assert name in run(corrector, ["list"]).output
    tried = run(corrector, ["test", name])
    assert tried.exit_code == 0 and "verdict: correct" in tried.output
    assert f"raw answer: {YES}" in tried.output  # what the model said, as it said it
    sent = fake_openai.requests[-1]["json"]["messages"][1]["content"]
    assert isinstance(sent, str) and "image" not in sent.lower()
    assert run(corrector, ["rm", name]).exit_code == 0
    gone = run(corrector, ["test", name])
    assert gone.exit_code == 1 and "no corrector named" in gone.output


@pytest.mark.parametrize(
    "fields, why",
    [
        ({"kind": "openai", "model": "m"}, "needs base_url"),
        ({"kind": "openai", "base_url": "http://h/v1"}, "needs model"),
        ({"base_url": "http://h/v1"}, "need kind"),
    ],
)
def test_inline_corrector_config_is_checked(fields: dict, why: str) -> None:
    from pydantic import ValidationError

    from shared.schemas import CorrectorConfig

    with pytest.raises(ValidationError, match=why):
        CorrectorConfig.model_validate(fields)


def test_an_inline_corrector_is_built_like_a_registered_one(fake_openai: FakeOpenAI) -> None:
    from services.corrector.service import build_corrector
    from shared.schemas import CorrectorConfig

    cfg = CorrectorConfig.model_validate(
        {"kind": "openai", "base_url": fake_openai.url, "model": "m", "params": {"tools": False}}
    )
    assert cfg.name == "inline"
    with session_scope() as s:
        built = build_corrector(cfg.name, s, get_settings(), inline=cfg.inline())
        assert isinstance(built, OpenAICorrector) and built.params.tools is False
        bad = {**(cfg.inline() or {}), "base_url": "file:///etc/passwd"}
        with pytest.raises(CorrectorError, match="inline corrector: base_url must start"):
            build_corrector(cfg.name, s, get_settings(), inline=bad)
