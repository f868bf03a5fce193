"""A pipeline that keeps up with the rollout (issue 53): the endpoint's limit opens to what the
arrivals need (Little's law) once its probe is answered, holds once latency rises, halves on a
push-back; Retry-After pauses every caller; RPM/TPM buckets pace the requests and cap the need;
the embedded pool has a thread per request the endpoint may have in flight."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import select

from services.controller.backends import ThreadCorrections
from services.corrector.base import CorrectorError
from services.corrector.remote import HttpCorrector, RemoteParams
from services.corrector.resilience import AdaptiveLimit, RateLimit
from shared.db.models import Correction
from shared.db.session import session_scope
from shared.schemas import CorrectionRequest
from shared.settings import Settings
from tests.conftest import ROOT, free_port, live_server


def _answer(limit: AdaptiveLimit, n: int, latency_s: float) -> None:
    """``n`` answers, each in ``latency_s`` (arrivals are set apart by ``_arrive``)."""
    for _ in range(n):
        limit.feedback(0, latency_s, False)


def _arrive(limit: AdaptiveLimit, per_s: float, seconds: float) -> None:
    """Arrivals at ``per_s`` over the last ``seconds``, as the limit measures them."""
    now = time.monotonic()
    limit._arrivals.extend(now - seconds + i / per_s for i in range(int(per_s * seconds)))


def test_slow_start_opens_to_littles_law_need_then_aimd() -> None:
    limit = AdaptiveLimit(max_limit=256, start=4)
    _arrive(limit, per_s=32, seconds=10)  # 32 steps a second at 2 s: 64 in flight needed
    limit.latency_s = 2.0
    windows = []
    for _ in range(6):
        _answer(limit, limit.limit, 2.0)
        windows.append(limit.limit)
    # The probe's window of answers: the latency is known, the limit goes to the need at once.
    assert windows == [64, 65, 66, 67, 68, 69], windows  # then one more a window, never 128
    assert limit.needed == 64
    before = limit.limit
    tickets = [limit.acquire() for _ in range(3)]
    for t in tickets:  # a 503 to three requests sent together: one cut
        limit.feedback(t, None, True)
        limit.release()
    assert limit.limit == before // 2 and limit.cuts == 1 and not limit.slow_start
    assert limit.peak_in_flight == 3
    cut = limit.limit
    _answer(limit, cut, 2.0)
    assert limit.limit == cut + 1  # additive from now on


def test_calls_waiting_count_in_the_need_and_unknown_need_doubles() -> None:
    limit = AdaptiveLimit(max_limit=256, start=4)
    _answer(limit, 4, 1.0)  # no arrivals measured yet: the need is unknown, double
    assert limit.limit == 8 and limit.needed is None
    limit._arrivals.extend([time.monotonic() - 100.0, time.monotonic() - 99.0])
    limit.waiting = 100  # a backlog that arrived long ago (the end of a run)
    assert limit.needed == 100
    _answer(limit, 8, 1.0)
    assert limit.limit == 100  # the 100 waiting, in one round trip
    small = AdaptiveLimit(max_limit=256, start=1)
    small._arrivals.extend([time.monotonic() - 1.0, time.monotonic()])
    small.waiting = 100
    _answer(small, 1, 1.0)  # one answer says little about the server: double, not 100
    assert small.limit == 2


def test_rising_latency_ends_slow_start_and_holds() -> None:
    limit = AdaptiveLimit(max_limit=256, start=4)
    _arrive(limit, per_s=100, seconds=10)  # a need of 100 at 1 s
    _answer(limit, 4, 1.0)
    assert limit.limit == 100
    _answer(limit, 100, 2.5)  # requests queue at the server
    assert limit.limit == 100 and not limit.slow_start


def test_retry_after_pauses_every_caller() -> None:
    limit = AdaptiveLimit(max_limit=8, start=8)
    limit.pause(0.4)
    started = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: limit.wait_pause(), range(4)))
    assert 0.35 <= time.monotonic() - started < 2.0


def test_rpm_paces_requests_and_tpm_the_tokens() -> None:
    rpm = RateLimit(rpm=600, tpm=None)  # 10 a second, a burst of 600 allowed at first
    rpm.requests = 0.0  # the burst is spent
    started = time.monotonic()
    for _ in range(5):
        rpm.wait()
    assert 0.4 <= time.monotonic() - started < 1.5  # ~0.1 s each
    tpm = RateLimit(rpm=None, tpm=6000)  # 100 tokens a second
    tpm.spent(tpm.wait(), 6000)  # one call used the whole minute's tokens
    started = time.monotonic()
    done = threading.Event()
    threading.Thread(target=lambda: (tpm.wait(), done.set()), daemon=True).start()
    assert not done.wait(0.5)  # no tokens left: the next call waits
    tpm.tokens = 7000.0
    assert done.wait(6)


def test_the_rate_limits_cap_the_need() -> None:
    """At 600 requests a minute and 2 s an answer, 20 in flight use the whole allowance: the
    limit opens to 20, not to the 100 waiting (they would only wait on the bucket, each holding
    a slot)."""
    limit = AdaptiveLimit(max_limit=256, start=4)
    limit.pace = RateLimit(rpm=600, tpm=None).per_s
    _arrive(limit, per_s=50, seconds=10)
    limit.waiting = 100
    _answer(limit, 4, 2.0)
    assert limit.needed == 20 and limit.limit == 20
    tokens = RateLimit(rpm=None, tpm=60_000)  # 1,000 tokens a second, 500 a call: 2 calls/s
    tokens.spent(tokens.wait(), 500)
    assert tokens.per_s() == 2.0


def test_defaults_suit_a_hosted_api_and_the_pool_has_a_thread_per_slot(pg_url: str) -> None:
    p = RemoteParams()
    assert p.concurrency >= 256 and p.concurrency_start > 1 and p.adaptive
    inline = {
        "name": "hosted",
        "kind": "http",
        "base_url": "http://127.0.0.1:9",
        "params": {"concurrency": 300},
    }
    pool = ThreadCorrections("hosted", 0.0, 0, Settings(), inline=inline)
    try:
        assert pool.pool._max_workers == 300  # eight threads would cap 300 in flight at 8
    finally:
        pool.close()


def _read_request(conn: socket.socket) -> None:
    """Read one HTTP request, head and body (its Content-Length), from ``conn``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    while length and len(body) < int(length.group(1)):
        chunk = conn.recv(65536)
        if not chunk:
            return
        body += chunk


def test_a_dropped_kept_alive_connection_is_retried_without_halving_the_limit() -> None:
    """A server that closes the connection without answering (what a kept-alive connection
    meets when the server's keep-alive timeout fires as the request goes out) is retried and
    leaves the limit alone; a refused connection is a push-back and halves it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def drop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            with conn:
                # The whole request arrives; no response is ever written. Closing with part of
                # it unread would reset the connection (RST: a refusal), not close it.
                _read_request(conn)

    threading.Thread(target=drop, daemon=True).start()
    params = {"max_retries": 1, "backoff_base_s": 0.01, "concurrency_start": 8}
    agent = {"current number": 2, "target number": 4, "thoughts": "2 < 4", "action": "+"}
    req = CorrectionRequest(
        task="numberline", prompt="p", output=json.dumps(agent), state={"current": 2, "target": 4}
    )
    try:
        dropped = HttpCorrector(f"http://127.0.0.1:{listener.getsockname()[1]}", params=params)
        with pytest.raises(CorrectorError, match="Server disconnected") as err:
            dropped.correct(req)
        assert err.value.kind == "transport"
        assert dropped.limit.cuts == 0 and dropped.limit.limit == 8
    finally:
        listener.close()
    refused = HttpCorrector(f"http://127.0.0.1:{free_port()}", params=params)
    with pytest.raises(CorrectorError, match="connection failed"):
        refused.correct(req)
    assert refused.limit.cuts == 1 and refused.limit.limit == 4


HOLD_S = 20.0  # the longest a held answer waits for the rest to come (a client times out at 60 s)


@contextmanager
def counting_corrector(
    delay_s: float, hold_until: int | None = None, probe_gate: threading.Event | None = None
) -> Iterator[tuple[str, dict[str, Any]]]:
    """A real `POST /v1/correct` server that answers 'correct' after ``delay_s`` and counts the
    requests in flight at once (``peak``) and, per request, how many were in flight and how many
    had been answered when it came (``arrivals``).

    ``hold_until``: a request that comes after the first answer is answered only once that many
    requests have come in all (or HOLD_S have passed): a client that waits for answers before it
    sends more is then seen waiting, however loaded the host that runs it. ``probe_gate``: the
    requests that come before any answer (the probe) are answered once it is set (or HOLD_S have
    passed), then after ``delay_s``."""
    from fastapi import FastAPI

    app = FastAPI()
    seen: dict[str, Any] = {"now": 0, "peak": 0, "total": 0, "answered": 0, "arrivals": []}
    arrived: dict[str, asyncio.Event] = {}

    @app.post("/v1/correct")
    async def correct(body: dict) -> dict:  # type: ignore[type-arg]
        seen["now"] += 1
        seen["total"] += 1
        seen["peak"] = max(seen["peak"], seen["now"])
        seen["arrivals"].append((seen["now"], seen["answered"]))
        everyone = arrived.setdefault("all", asyncio.Event())
        if hold_until is not None and seen["total"] >= hold_until:
            everyone.set()
        if hold_until is not None and seen["answered"] > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(everyone.wait(), HOLD_S)
        else:
            if probe_gate is not None:
                await asyncio.to_thread(probe_gate.wait, HOLD_S)
            await asyncio.sleep(delay_s)
        seen["now"] -= 1
        seen["answered"] += 1
        return {"verdict": "correct", "corrected_thought": None, "extras": {}, "reasoning": ""}

    with live_server(app) as url:
        yield url, seen


def test_the_need_is_in_flight_one_round_trip_after_the_probe(pg_url: str) -> None:
    """Embedded, a slow endpoint and a backlog of 100 steps: the probe's 4 requests come back,
    and before any later request is answered the other 96 are in flight (the Little's-law need
    is the backlog here), not the 8 or 32 of a slow start that waits for answers to grow. The
    endpoint answers the probe once the 100 calls are at the limit (in flight or waiting for a
    slot), and holds every later answer until the 100 have come (at most HOLD_S): a slow start
    is seen stalled, and a loaded host has time to start the threads (an endpoint that
    answered regardless, at 2 s, 4 s and 1 s, had a loaded host's pool reach the limit with 87,
    51 and 71 of the 96 by the probe's return)."""
    from services.controller.backends import wait_for_corrections
    from tests.services.corrector.helpers import make_run, make_step

    agent = {"current number": 2, "target number": 4, "thoughts": "2 < 4", "action": "+"}
    backlog = threading.Event()
    with counting_corrector(1.0, hold_until=100, probe_gate=backlog) as (url, seen):
        inline = {"name": "slow", "kind": "http", "base_url": url, "params": {"concurrency": 256}}
        with session_scope() as s:
            run = make_run(s, corrector={"name": "slow"})
            state = {"current": 2, "target": 4}
            ids = [make_step(s, "numberline", state, agent, run=run, idx=i).id for i in range(100)]
            run_id = run.id
        pool = ThreadCorrections("slow", 0.0, 0, Settings(), inline=inline)
        try:
            assert pool.corrector.limit.limit == 4  # type: ignore[attr-defined]
            pool.submit(run_id, ids)
            limit = pool.corrector.limit  # type: ignore[attr-defined]
            deadline = time.monotonic() + 60
            while limit.in_flight + limit.waiting < 100 and time.monotonic() < deadline:
                time.sleep(0.02)
            backlog.set()
            assert wait_for_corrections(run_id, ids, timeout_s=60) == 0
        finally:
            pool.close()
    probe = [n for n, answered in seen["arrivals"] if answered == 0]
    second = [n for n, answered in seen["arrivals"] if 0 < answered <= 4]
    assert max(probe) == 4 and len(probe) == 4, probe
    assert len(second) == 96 and max(second) == 96, (len(second), max(second, default=0))
    assert seen["total"] == 100  # one call per step
    with session_scope() as s:
        statuses = s.scalars(select(Correction.status).where(Correction.run_id == run_id)).all()
    assert statuses == ["done"] * 100


def test_a_corrector_worker_has_its_threads_in_flight_at_a_slow_endpoint(
    pg_url: str, redis_url: str
) -> None:
    """Full stack: `gtr worker corrector --concurrency 48` against a 1 s endpoint, 96 steps queued
    at once: the worker's threads and the endpoint's limit (doubling from 4) let tens of requests in
    flight, not the eight of before; every step is corrected."""
    from services.controller.backends import CeleryCorrections, wait_for_corrections
    from shared.queues import celery_app
    from tests.services.corrector.helpers import make_run, make_step

    celery_app.conf.broker_url = celery_app.conf.result_backend = redis_url
    celery_app.control.purge()  # no task of an earlier session's worker

    agent = {"current number": 2, "target number": 4, "thoughts": "2 < 4", "action": "+"}
    with counting_corrector(1.0) as (url, seen):
        with session_scope() as s:
            run = make_run(s, corrector={"name": "slow", "kind": "http", "base_url": url})
            state = {"current": 2, "target": 4}
            ids = [make_step(s, "numberline", state, agent, run=run, idx=i).id for i in range(96)]
            run_id = run.id
        env = {**os.environ, "GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS": "true"}
        cmd = [sys.executable, "-m", "services.cli", "worker", "corrector", "--concurrency", "48"]
        worker = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
        try:
            CeleryCorrections("slow").submit(run_id, ids)
            assert wait_for_corrections(run_id, ids, timeout_s=90) == 0
        finally:
            worker.terminate()
            worker.wait(timeout=30)
            celery_app.control.purge()
    with session_scope() as s:
        where = (Correction.run_id == run_id, Correction.corrector == "slow")
        statuses = s.scalars(select(Correction.status).where(*where)).all()
    assert statuses == ["done"] * 96
    assert seen["total"] == 96  # one call per step
    assert seen["peak"] >= 16, seen  # 4, 8, 16, 32...; the former default capped it at 8
