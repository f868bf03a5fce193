"""How the controller tells an outage from a bug, waits for the services, and sends a lost
trainer task again: real servers, a real Redis and a real worker, nothing killed."""

from __future__ import annotations

import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from kombu.exceptions import OperationalError
from sqlalchemy import select

from services.api.service import create_run
from services.controller.backends import (
    CeleryTrainer,
    InProcessPolicy,
    InProcessTrainer,
    ThreadCorrections,
    queued_messages,
)
from services.controller.outages import Outage, is_interruption
from services.controller.service import RunDriver
from services.env import EnvPool
from services.env.app import create_app
from services.env.client import EnvClient, EnvServiceError
from services.env.service import EnvError, SessionNotFound
from services.policy.client import PolicyServiceError
from shared.db.models import Correction, Run, Step, Update
from shared.db.session import session_scope
from shared.queues import QUEUE_TRAINER, TASK_UPDATE, celery_app
from shared.schemas import RunConfig
from shared.settings import get_settings
from tests.conftest import celery_worker, free_port, live_server
from tests.e2e.helpers import tiny_config


def _caused_by_redis() -> RuntimeError:
    try:
        try:
            raise redis.exceptions.ConnectionError("Connection refused")
        except redis.exceptions.ConnectionError as e:
            raise RuntimeError("Retry limit exceeded ... result store backend") from e
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(
    ("error", "outage"),
    [
        (httpx.ConnectError("refused"), True),
        (httpx.RemoteProtocolError("Server disconnected"), True),
        (httpx.ReadTimeout("slow"), True),
        (SessionNotFound("a1b2"), True),
        (EnvServiceError("502: Bad Gateway", 502), True),
        (PolicyServiceError("/generate -> 500: boom", 500), True),
        (OperationalError("Connection refused"), True),
        (_caused_by_redis(), True),
        (PolicyServiceError("/generate -> 422: bad prompt", 422), False),
        (EnvError("illegal action"), False),
        (ValueError("a bug"), False),
    ],
)
def test_outages_are_told_from_the_runs_own_errors(error: Exception, outage: bool) -> None:
    assert is_interruption(error) is outage


def _driver(env_url: str, **kw: Any) -> RunDriver:
    with session_scope() as s:
        run_id = create_run(s, RunConfig(task="numberline"), "outage-test").id
    envs = EnvClient(env_url, timeout=5)
    return RunDriver(run_id, envs, policy=None, corrections=None, trainer=InProcessTrainer(), **kw)


def test_the_driver_waits_for_a_service_and_gives_up_with_the_reason(pg_url: str) -> None:
    port = free_port()
    driver = _driver(f"http://127.0.0.1:{port}", outage_s=1.0, max_interruptions=2)
    started = time.monotonic()
    with pytest.raises(Outage, match=r"EnvClient did not come back within 1 s.*ConnectError"):
        driver.outages.wait(httpx.ConnectError("refused"))
    assert time.monotonic() - started < 10

    with live_server(create_app(), port):  # the service is back
        driver.outages.outage_s = 60
        driver.outages.wait(httpx.ConnectError("refused"))
        driver._ride_out(httpx.ConnectError("refused"))
        driver._ride_out(httpx.ConnectError("refused"))
        with pytest.raises(Outage, match="gave up after 2 interruptions in a row"):
            driver._ride_out(httpx.ConnectError("refused"))


def test_a_lost_trainer_task_is_sent_again_and_a_queued_one_is_not(redis_url: str) -> None:
    """The update message is waiting (no worker yet): it is not duplicated. Then Redis loses it
    (the queue is emptied, as a restart without persistence does) and a worker comes: the
    controller sends the task again, and the worker's answer comes back."""
    celery_app.conf.broker_url = celery_app.conf.result_backend = redis_url
    celery_app.control.purge()
    trainer = CeleryTrainer(timeout_s=120, lost_after_s=1.0, slice_s=0.2)
    outcome: dict[str, BaseException] = {}

    def call() -> None:
        try:
            trainer.update(2**31 - 1, 0)  # no such run: the worker answers UpdateError
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            outcome["error"] = e

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while queued_messages(QUEUE_TRAINER) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2.0)  # past lost_after_s: a queued task counts as held
    assert queued_messages(QUEUE_TRAINER) == 1
    redis.Redis.from_url(redis_url).delete(QUEUE_TRAINER)  # the message is lost
    with celery_worker(QUEUE_TRAINER):
        thread.join(timeout=90)
    assert not thread.is_alive()
    assert type(outcome["error"]).__name__ == "UpdateError", outcome


def test_a_running_trainer_task_beats(redis_url: str) -> None:
    """What the controller reads to tell a worker at work: STARTED, with a beat that moves."""
    from services.trainer.tasks import _beating

    celery_app.conf.broker_url = celery_app.conf.result_backend = redis_url
    task = celery_app.tasks[TASK_UPDATE]
    task_id = f"beat-test-{time.monotonic_ns()}"
    task.push_request(id=task_id, is_eager=False)
    try:
        with _beating(task, every_s=0.1):
            time.sleep(0.5)
            first = celery_app.AsyncResult(task_id).info
            time.sleep(0.3)
            later = celery_app.AsyncResult(task_id)
            assert later.state == "STARTED" and later.info["beat"] > first["beat"] >= 2
        stopped = later.info["beat"]
        time.sleep(0.3)
        assert celery_app.AsyncResult(task_id).info["beat"] == stopped  # no beat after the task
    finally:
        task.pop_request()
        celery_app.AsyncResult(task_id).forget()


class _DropsAfterTraining(InProcessPolicy):
    """The real in-process policy, whose connection drops (as a restarted policy service's
    does) on the second load: the checkpoint of update 0, just trained."""

    def __init__(self, model_cfg: Any) -> None:
        super().__init__(model_cfg)
        self.loads = 0

    def load_weights(self, path: str) -> None:
        self.loads += 1
        if self.loads == 2:
            raise httpx.RemoteProtocolError("Server disconnected")
        super().load_weights(path)


@pytest.mark.slow  # a whole (tiny) embedded run
def test_an_update_trained_before_the_drop_is_finished_on_resume(warm_checkpoint: Path) -> None:
    """The drop comes after update 0 trained and before its probe, eval and correction stats:
    the resume finishes it (updates_done, probe metrics) instead of skipping to update 1."""
    cfg = RunConfig.model_validate(
        tomllib.loads(tiny_config(warm_checkpoint, envs=2, steps=2, updates=2, wait="none"))
    )
    with session_scope() as s:
        run_id = create_run(s, cfg, "drop-test").id
    policy = _DropsAfterTraining(cfg.model)
    corrections = ThreadCorrections("oracle", 0.0, 0, get_settings())
    driver = RunDriver(run_id, EnvPool(), policy, corrections, InProcessTrainer())
    assert driver.run() == "completed"
    assert policy.loads == 4 and driver.outages.interruptions == 0  # init, 0 (dropped), 0 again, 1
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.updates_done == 2
        metrics = s.scalars(select(Update.metrics).where(Update.run_id == run_id)).all()
        assert len(metrics) == 2
        assert all(m.get("trained") and "probe_relevance" in m for m in metrics), metrics
        assert all("corrections" in m for m in metrics)
        formed = s.scalars(
            select(Step.id).where(Step.run_id == run_id, Step.format_valid.is_(True))
        ).all()
        corrected = s.scalars(select(Correction.step_id).where(Correction.run_id == run_id)).all()
    assert sorted(corrected) == sorted(formed)  # the run's end left no correction missing
