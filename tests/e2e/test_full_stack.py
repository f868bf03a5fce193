"""A run launched over REST trains through every service as a separate process."""

from __future__ import annotations

import os
import signal
import tomllib
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.e2e.helpers import counts, process, tiny_config, wait_status

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(full_stack: dict, warm_checkpoint: Path) -> dict:
    """The session's stack (tests/e2e/conftest.py) and the NumberLine runs' warm checkpoint."""
    return {**full_stack, "checkpoint": warm_checkpoint}


def _launch(stack: dict, **kw) -> int:  # type: ignore[no-untyped-def]
    cfg = tomllib.loads(tiny_config(stack["checkpoint"], **kw))
    r = httpx.post(
        f"{stack['urls']['api']}/api/runs", json=cfg, headers=stack["headers"], timeout=10
    )
    assert r.status_code == 201, r.text
    return int(r.json()["id"])


def test_run_over_rest_completes_with_consistent_counts(stack: dict) -> None:
    with process(["worker", "corrector"], stack["logs"] / "corrector.log", stack["env"]):
        run_id = _launch(stack, envs=2, steps=4, updates=2)
        run = wait_status(
            stack["urls"]["api"], stack["headers"], run_id, ("completed", "failed"), 300
        )
    assert run["status"] == "completed", run["error"]
    c = counts(run_id)
    assert c["steps"] == c["env_steps"] == 2 * 4 * 2
    assert c["dup_steps"] == 0 and c["dup_corrections"] == 0
    assert c["checkpoints"] == 2 and c["updates"] == 2
    assert c["corrections"] > 0 and c["pending"] == 0  # strict wait: every correction recorded
    updates = httpx.get(
        f"{stack['urls']['api']}/api/runs/{run_id}/updates", headers=stack["headers"]
    ).json()["items"]
    assert [u["idx"] for u in updates] == [0, 1]
    for u in updates:
        assert {"losses/policy", "format_valid_rate", "probe_relevance"} <= set(u["metrics"])


def test_cancel_in_the_middle(stack: dict) -> None:
    with process(["worker", "corrector"], stack["logs"] / "corrector-cancel.log", stack["env"]):
        run_id = _launch(stack, envs=2, steps=4, updates=50, wait="none")
        wait_status(stack["urls"]["api"], stack["headers"], run_id, ("running",), 120)
        r = httpx.post(f"{stack['urls']['api']}/api/runs/{run_id}/cancel", headers=stack["headers"])
        assert r.status_code == 200
        run = wait_status(
            stack["urls"]["api"],
            stack["headers"],
            run_id,
            ("cancelled", "failed", "completed"),
            180,
        )
    assert run["status"] == "cancelled"
    assert run["updates_done"] < 50
    assert counts(run_id)["dup_steps"] == 0


def test_killed_corrector_worker_loses_nothing_silently(stack: dict) -> None:
    run_id = _launch(stack, envs=2, steps=4, updates=3, wait="update")
    with process(
        ["worker", "corrector"], stack["logs"] / "corrector-kill1.log", stack["env"]
    ) as worker:
        wait_status(stack["urls"]["api"], stack["headers"], run_id, ("running",), 120)
        import time

        deadline = time.monotonic() + 120
        while counts(run_id)["steps"] < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
    with process(["worker", "corrector"], stack["logs"] / "corrector-kill2.log", stack["env"]):
        run = wait_status(
            stack["urls"]["api"], stack["headers"], run_id, ("completed", "failed"), 300
        )
    assert run["status"] == "completed", run["error"]
    c = counts(run_id)
    assert c["dup_steps"] == 0 and c["dup_corrections"] == 0
    assert c["steps"] == 2 * 4 * 3 and c["checkpoints"] == 3


def test_a_service_down_at_start_fails_the_run_clearly(stack: dict, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    env = {**stack["env"], "GTR_ENV_SERVICE_URL": dead}
    stack["procs"]["controller"].send_signal(
        signal.SIGSTOP
    )  # only the broken controller may claim it
    try:
        with process(["controller", "--poll", "0.5"], tmp_path / "controller-broken.log", env):
            run_id = _launch(stack)
            run = wait_status(
                stack["urls"]["api"], stack["headers"], run_id, ("failed", "completed"), 180
            )
    finally:
        stack["procs"]["controller"].send_signal(signal.SIGCONT)
    assert run["status"] == "failed"
    assert "env service" in run["error"] and dead in run["error"]
