"""A run with more envs than one policy-service request takes (``MAX_SAMPLES``; a run may have
256): through real env and policy services it completes, where every rollout step used to be
refused with a 422."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from sqlalchemy import select

from services.api.service import create_run
from services.controller.backends import InProcessTrainer
from services.controller.service import RunDriver
from services.env import EnvPool
from services.env.app import create_app as env_app
from services.env.client import EnvClient
from services.policy.app import create_app as policy_app
from services.policy.client import PolicyClient
from services.policy.schemas import MAX_SAMPLES
from services.policy.service import Policy
from shared.db.models import Update
from shared.db.session import session_scope
from shared.schemas import RunConfig
from shared.settings import Settings
from tests.conftest import live_server
from tests.e2e.helpers import counts, tiny_config


@pytest.mark.slow  # a whole (tiny) run through two services
def test_a_run_wider_than_a_request_completes_through_the_services(
    pg_url: str, warm_checkpoint: Path
) -> None:
    envs = MAX_SAMPLES + 2
    cfg = RunConfig.model_validate(
        tomllib.loads(tiny_config(warm_checkpoint, envs=envs, steps=1, updates=1, wait="none"))
    )
    with session_scope() as s:
        run_id = create_run(s, cfg, "wide-run").id
    base = json.loads((warm_checkpoint / "policy.json").read_text())["base_model"]
    with live_server(env_app(EnvPool(), settings=Settings())) as env_url:
        # The policy service steps that env service: the loop it offers takes MAX_SAMPLES
        # sessions, so this run's controller steps them itself.
        app = policy_app(Policy.load(base), settings=Settings(env_service_url=env_url))
        with live_server(app) as policy_url, PolicyClient(policy_url) as policy:
            driver = RunDriver(run_id, EnvClient(env_url), policy, None, InProcessTrainer())
            assert driver.run() == "completed"
            stats = policy.stats()
    c = counts(run_id)
    assert c["steps"] == c["env_steps"] == envs, c
    assert stats["largest_batch"] <= MAX_SAMPLES < stats["samples"]  # split into requests
    with session_scope() as s:
        (metrics,) = s.scalars(select(Update.metrics).where(Update.run_id == run_id)).all()
    assert metrics["trained"] and "time/stream_wait_s" not in metrics
    assert metrics["time/generate_s"] > 0 and metrics["time/env_s"] > 0
