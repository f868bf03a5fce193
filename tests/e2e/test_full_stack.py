"""A run launched over REST trains through every service as a separate process.

The ALFWorld run (issue #9's acceptance check) shares this module's stack: its warm start runs in
the trainer worker, its rendered images go to the blob store, the Celery corrector corrects it."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import signal
import tomllib
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from PIL import Image
from sqlalchemy import select

from services.api.auth import create_token
from shared.db.models import Episode, Step
from shared.db.session import session_scope
from tests.conftest import free_port, need
from tests.e2e.helpers import cancel_active_runs, counts, process, tiny_run, wait_status
from tests.services.alfworld.conftest import SAMPLE

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def full_stack(
    pg_url: str, redis_url: str, default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict]:
    """API, env and policy services, a trainer worker and a controller, on the test database.

    Corrector workers are left to the tests (some kill theirs). The policy service starts on the
    default tiny model and follows each run's checkpoints to that run's own base model (ALFWorld).
    """
    from services.controller.stack import _wait_healthy

    logs = tmp_path_factory.mktemp("stack-logs")
    model = default_model_dir
    port = free_port()
    urls = {
        "api": f"http://127.0.0.1:{port}",
        "env": f"http://127.0.0.1:{free_port()}",
        "policy": f"http://127.0.0.1:{free_port()}",
    }
    env = {
        "GTR_ENV_SERVICE_URL": urls["env"],
        "GTR_POLICY_SERVICE_URL": urls["policy"],
        # The default: the policy service runs each rollout's loop (POST /rollout), ALFWorld's
        # included. The controller's own loop through the services (GTR_POLICY_STEPS_ENVS=false,
        # or a run wider than one request) runs whole in controller/test_wide_runs.py.
    }
    env_port, policy_port = urls["env"].rsplit(":", 1)[1], urls["policy"].rsplit(":", 1)[1]
    cancel_active_runs()
    with ExitStack() as stack:
        stack.callback(cancel_active_runs)
        procs = {
            "api": stack.enter_context(
                process(["serve", "--port", str(port)], logs / "api.log", env)
            ),
            "env": stack.enter_context(
                process(["env", "serve", "--port", env_port], logs / "env.log", env)
            ),
            "policy": stack.enter_context(
                process(
                    ["policy", "serve", "--model", str(model), "--port", policy_port],
                    logs / "policy.log",
                    env,
                )
            ),
            "trainer": stack.enter_context(
                process(["worker", "trainer"], logs / "trainer.log", env)
            ),
            "controller": stack.enter_context(
                process(["controller", "--poll", "0.5"], logs / "controller.log", env)
            ),
        }
        for name in ("api", "env", "policy"):
            _wait_healthy(name, urls[name], procs[name])
        with session_scope() as s:
            token = create_token(s, "e2e")[1]
        yield {
            "urls": urls,
            "procs": procs,
            "env": env,
            "logs": logs,
            "token": token,
            "headers": {"Authorization": f"Bearer {token}"},
        }


@pytest.fixture(scope="module")
def stack(full_stack: dict, warm_checkpoint: Path) -> dict:
    """The stack and the NumberLine runs' warm checkpoint."""
    return {**full_stack, "checkpoint": warm_checkpoint}


def _launch(stack: dict, changes: dict | None = None, **kw) -> int:  # type: ignore[no-untyped-def]
    cfg = tiny_run(stack["checkpoint"], changes, **kw)
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
        # The policy service ran the rollout loop: the controller waited on its stream.
        assert u["metrics"]["time/stream_wait_s"] > 0 and u["metrics"]["time/env_s"] > 0


def test_gtr_grpo_with_the_self_teacher_over_rest(stack: dict) -> None:
    """GTR-Turbo's SFT mode as a worker: the Celery corrector serves the run's merged checkpoints;
    gtr_grpo's groups of 2 envs play one deal each through the env service."""
    api, headers = stack["urls"]["api"], stack["headers"]
    changes = {
        "algorithm": "gtr_grpo",
        "env": {"max_episode_steps": 2},  # episodes end inside the rollout: complete groups
        # A small lr keeps update 1's policy writing JSON as the warm start does, so update 1
        # has steps for the merged teacher to correct (at lr 1e-3 it sometimes had none).
        "train": {"group_size": 2, "lr": 1e-5},
        "corrector": {"backend": "self_teacher"},
        # The authors' merge, the acting policy included: update 1 is corrected by checkpoint 0
        # (the default lag 1 would leave it out until update 2).
        "teacher": {"lag": 0},
    }
    with process(["worker", "corrector"], stack["logs"] / "corrector-turbo.log", stack["env"]):
        run_id = _launch(stack, changes, envs=4, steps=2, updates=2)
        run = wait_status(api, headers, run_id, ("completed", "failed"), 300)
    assert run["status"] == "completed", run["error"]
    c = counts(run_id)
    assert c["steps"] == 4 * 2 * 2 and c["updates"] == 2 and c["pending"] == 0
    for u in httpx.get(f"{api}/api/runs/{run_id}/updates", headers=headers).json()["items"]:
        assert u["metrics"]["grpo/groups"] >= 2 and u["metrics"]["grpo/episodes"] >= 4
    with session_scope() as s:  # a group's envs start the same deals, the other group others
        firsts = s.execute(
            select(Episode.update_idx, Episode.env_index, Step.state)
            .join(Step, Step.episode_id == Episode.id)
            .where(Episode.run_id == run_id, Step.idx == 0)
            .order_by(Episode.id)
        ).all()
    for u in (0, 1):
        first = {e: next(st for k, i, st in firsts if (k, i) == (u, e)) for e in range(4)}
        assert first[0] == first[1] and first[2] == first[3] and first[0] != first[2]

    ckpts = httpx.get(f"{api}/api/runs/{run_id}/checkpoints", headers=headers).json()["items"]
    ckpt0 = next(x["id"] for x in ckpts if x["update_idx"] == 0)
    done = httpx.get(
        f"{api}/api/runs/{run_id}/corrections",
        params={"status": "done", "limit": 500},
        headers=headers,
    ).json()["items"]
    assert done and all(x["corrector"] == "self_teacher" and x["tokens"] == 0 for x in done)
    with session_scope() as s:
        rows = s.execute(select(Step.id, Step.update_idx).where(Step.run_id == run_id))
        update_of = {step_id: update_idx for step_id, update_idx in rows}
    # Update 0 is corrected by the warm start, update 1 by the merge of checkpoint 0.
    teachers = {update_of[x["step_id"]]: x["extras"]["teacher_checkpoint_ids"] for x in done}
    assert teachers == {0: [], 1: [ckpt0]}
    for x in done:
        assert x["extras"]["teacher_checkpoint_ids"] == teachers[update_of[x["step_id"]]]
    late = next(x for x in done if update_of[x["step_id"]] == 1)
    step = httpx.get(f"{api}/api/steps/{late['step_id']}", headers=headers).json()
    assert [c["extras"]["teacher_checkpoint_ids"] for c in step["corrections"]] == [[ckpt0]]
    page = httpx.get(f"{api}/runs/{run_id}/steps/{late['step_id']}", headers=headers)
    assert f'data-teacher-checkpoints="{ckpt0}"' in page.text and "no API call" in page.text

    cost = httpx.get(f"{api}/api/runs/{run_id}", headers=headers).json()["corrector_cost"]
    assert cost["calls"] == 0 and cost["tokens"] == 0 and cost["seconds"] > 0
    page = httpx.get(f"{api}/runs/{run_id}", headers=headers)
    assert '<b data-field="corrector-calls">0 API calls</b>' in page.text


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


# ---- ALFWorld on the sample games -----------------------------------------------------------

ALF_ENVS, ALF_STEPS, ALF_UPDATES = 2, 4, 2
# configs/alfworld-tiny.toml's warm start, shortened: still ~1/2 of sampled outputs are well-formed
# (docs/alfworld.md), so a 16-step run gets corrections with near certainty. Batches of 4 halve its
# time (each SFT step reads ~360-token prompts) for as many well-formed samples as batches of 8:
# 30 of 48 on held-out states after 120 steps in both, and under ~80 steps nearly none.
ALFWORLD = f"""
name = "alfworld-e2e"
task = "alfworld"
algorithm = "gtr"
seed = 0
[env]
image_size = 64
[env.options]
games = "{SAMPLE}"
[model]
image_size = 64
finetune = "full"
[generation]
max_new_tokens = 96
[init]
kind = "warm_start"
vision_steps = 20
sft_samples = 60
sft_steps = 120
batch_size = 4
lr = 2e-3
[train]
num_envs = {ALF_ENVS}
num_steps = {ALF_STEPS}
num_updates = {ALF_UPDATES}
minibatch_size = 8
ppo_epochs = 1
[corrector]
wait = "update"
wait_timeout_s = 60
[metrics]
probe_states = 2
"""


@pytest.fixture(scope="module")
def alfworld_run(request: pytest.FixtureRequest) -> dict:
    """The completed run and the stack it ran on (checked for ALFWorld before starting it)."""
    need(
        importlib.util.find_spec("alfworld") is not None,
        "the alfworld extra is not installed (pip install 'gtr-lab[alfworld]')",
    )
    need(SAMPLE.is_dir(), f"the ALFWorld sample is missing at {SAMPLE}")
    stack = request.getfixturevalue("full_stack")
    api, headers = stack["urls"]["api"], stack["headers"]
    with process(["worker", "corrector"], stack["logs"] / "corrector-alfworld.log", stack["env"]):
        r = httpx.post(f"{api}/api/runs", json=tomllib.loads(ALFWORLD), headers=headers, timeout=10)
        assert r.status_code == 201, r.text
        run = wait_status(api, headers, int(r.json()["id"]), ("completed", "failed"), 600)
    assert run["status"] == "completed", run["error"]
    return {**stack, "run_id": int(run["id"])}


def _trace(api: str, headers: dict, run_id: int) -> list[dict]:
    """Every step of the run with its corrections, read as the web UI reads it."""
    episodes = httpx.get(
        f"{api}/api/runs/{run_id}/episodes", params={"limit": 200}, headers=headers, timeout=10
    ).json()["items"]
    return [
        step
        for e in episodes
        for step in httpx.get(f"{api}/api/episodes/{e['id']}/steps", headers=headers).json()[
            "items"
        ]
    ]


def test_alfworld_run_completes_with_images_and_corrected_thoughts(alfworld_run: dict) -> None:
    api, headers = alfworld_run["urls"]["api"], alfworld_run["headers"]
    run_id = alfworld_run["run_id"]
    c = counts(run_id)
    assert c["steps"] == c["env_steps"] == ALF_ENVS * ALF_STEPS * ALF_UPDATES
    assert c["dup_steps"] == 0 and c["dup_corrections"] == 0
    assert c["updates"] == ALF_UPDATES and c["checkpoints"] == ALF_UPDATES
    assert c["pending"] == 0  # wait = "update": every correction recorded before its update

    steps = _trace(api, headers, run_id)
    assert len(steps) == ALF_ENVS * ALF_STEPS * ALF_UPDATES
    assert all(s["state"]["task"] and s["state"]["admissible"] for s in steps)
    for sha in {s["image_sha"] for s in steps}:
        assert sha, "every ALFWorld step stores its rendered image"
        r = httpx.get(f"{api}/api/blobs/{sha}", headers=headers, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        image = Image.open(io.BytesIO(r.content))
        assert image.format == "PNG" and image.size == (64, 64)
    for s in steps:  # the frame people see (320 px, drawn from the state): labels readable
        r = httpx.get(f"{api}{s['display_url']}", headers=headers, timeout=10)
        assert Image.open(io.BytesIO(r.content)).size == (320, 320)
    updates = httpx.get(f"{api}/api/runs/{run_id}/updates", headers=headers, timeout=10).json()
    for u in updates["items"]:  # the sample's goal swaps are not benchmark games: counted
        assert 0.0 <= u["metrics"]["benchmark_share"] <= 1.0
        assert u["metrics"]["episodes_started"] >= ALF_ENVS
        assert u["metrics"]["time/stream_wait_s"] > 0  # the policy service's loop stepped them

    formed = [s for s in steps if s["format_valid"]]
    assert formed, "the warm start makes the tiny model write JSON"
    for s in formed:  # each well-formed step went to the oracle, which finished it
        assert [(x["corrector"], x["status"]) for x in s["corrections"]] == [("oracle", "done")]
    corrected = [(s, x) for s in formed for x in s["corrections"] if x["verdict"] == "incorrect"]
    assert corrected, "the tiny model's thoughts are wrong often enough to be corrected"
    for s, x in corrected:
        assert x["corrected_thought"] and x["corrected_thought"] != s["thought"]
        thought = json.loads(x["corrected_thought"])["thoughts"]
        assert "Next sub-goal" in thought and s["state"]["targets"]["object"] in thought
