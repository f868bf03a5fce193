"""A run whose envs the policy service hosts (GTR_POLICY_HOSTS_ENVS): the controller reaches the
env routes under the policy service's /env, and its rollout steps go through the policy
service's own loop, which steps those sessions in process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest
from sqlalchemy import select

from services.api.service import create_run
from services.controller.backends import InProcessTrainer
from services.controller.service import RunDriver
from services.controller.stack import _wait_healthy
from services.env.client import EnvClient
from services.policy.app import create_app as policy_app
from services.policy.client import PolicyClient
from services.policy.service import Policy
from shared.db.models import Update
from shared.db.session import session_scope
from shared.schemas import RunConfig
from shared.settings import Settings
from tests.conftest import free_port, live_server
from tests.e2e.helpers import ROOT, counts, tiny_config


@pytest.mark.slow  # a whole (tiny) run through a service
def test_a_run_steps_the_envs_its_policy_service_hosts(pg_url: str, warm_checkpoint: Path) -> None:
    cfg = RunConfig.model_validate(
        tomllib.loads(tiny_config(warm_checkpoint, envs=3, steps=3, updates=2, wait="none"))
    )
    with session_scope() as s:
        run_id = create_run(s, cfg, "hosted-envs").id
    base = json.loads((warm_checkpoint / "policy.json").read_text())["base_model"]
    app = policy_app(Policy.load(base), settings=Settings(policy_hosts_envs=True))
    with live_server(app) as url, PolicyClient(url) as policy, EnvClient(f"{url}/env") as envs:
        driver = RunDriver(run_id, envs, policy, None, InProcessTrainer())
        assert driver.run() == "completed"
        stats = policy.stats()
        open_after = envs.pool_id(), len(app.state.envs)
    c = counts(run_id)
    assert c["steps"] == c["env_steps"] == 3 * 3 * 2 and c["dup_steps"] == 0, c
    assert stats["samples"] >= 18  # the run's generations went through the service
    assert open_after == (stats["env_pool"], 0)  # the run closed what it opened there
    with session_scope() as s:
        rows = s.scalars(select(Update.metrics).where(Update.run_id == run_id)).all()
    assert len(rows) == 2
    for metrics in rows:
        assert metrics["trained"]
        # The service's loop ran each rollout (its stream was waited on), and stepped in process.
        assert metrics["time/stream_wait_s"] > 0 and metrics["time/env_s"] > 0


@pytest.mark.slow  # a whole (tiny) run, and a policy service started twice
def test_a_restarted_policy_service_takes_its_sessions_and_the_run_goes_on(
    pg_url: str, warm_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The sessions die with the process that hosts them: kill -9 the policy service mid-run and
    start it again; the controller rides it out (new sessions, the last checkpoint reloaded) and
    the run completes with every step recorded once."""
    E, S, U = 2, 4, 3
    cfg = RunConfig.model_validate(
        tomllib.loads(tiny_config(warm_checkpoint, envs=E, steps=S, updates=U, wait="none"))
    )
    with session_scope() as s:
        run_id = create_run(s, cfg, "hosted-restart").id
    base = json.loads((warm_checkpoint / "policy.json").read_text())["base_model"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "services.cli", "policy", "serve", "--host-envs"]
    argv += ["--model", base, "--port", str(port)]
    env = {**os.environ, "GTR_DATA_DIR": str(tmp_path), "GTR_TORCH_THREADS": "1"}

    def start() -> subprocess.Popen:
        with open(tmp_path / "policy.log", "ab") as log:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        _wait_healthy("policy service", url, proc, timeout_s=120)
        return proc

    proc = start()
    caplog.set_level(logging.WARNING, logger="gtr.controller")
    ended: list[str] = []
    with PolicyClient(url) as policy, EnvClient(f"{url}/env") as envs:
        driver = RunDriver(run_id, envs, policy, None, InProcessTrainer(), outage_s=120)
        thread = threading.Thread(target=lambda: ended.append(driver.run()), daemon=True)
        try:
            thread.start()
            deadline = time.monotonic() + 240
            while counts(run_id)["steps"] <= E * S + 1:  # the second update's rollout is on
                assert time.monotonic() < deadline and thread.is_alive(), ended
                time.sleep(0.2)
            proc.kill()
            proc.wait()
            proc = start()
            thread.join(timeout=300)
        finally:
            proc.kill()
            proc.wait()
    assert ended == ["completed"], (tmp_path / "policy.log").read_text()[-3000:]
    c = counts(run_id)
    assert c["steps"] == c["env_steps"] == E * S * U and c["dup_steps"] == 0, c
    assert c["checkpoints"] == U, c
    said = [r.getMessage() for r in caplog.records if r.name == "gtr.controller"]
    assert any("interrupted (1 of" in m for m in said), said  # the kill landed mid-run
