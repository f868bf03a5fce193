"""A GTR run on the ALFWorld sample games, launched over REST, trains through every service as a
separate process: warm start in the trainer worker, rendered images in the blob store, oracle
corrections through the Celery corrector (issue #9's acceptance check)."""

from __future__ import annotations

import importlib.util
import io
import json
import tomllib

import httpx
import pytest
from PIL import Image

from tests.conftest import need
from tests.e2e.helpers import counts, process, wait_status
from tests.services.alfworld.conftest import SAMPLE

pytestmark = pytest.mark.slow

ENVS, STEPS, UPDATES = 2, 4, 2
# configs/alfworld-tiny.toml's warm start, halved: ~2/3 of sampled outputs are still well-formed
# (docs/alfworld.md), so a 16-step run gets corrections with near certainty.
CONFIG = f"""
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
sft_steps = 100
batch_size = 4
lr = 3e-3
[train]
num_envs = {ENVS}
num_steps = {STEPS}
num_updates = {UPDATES}
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
        r = httpx.post(f"{api}/api/runs", json=tomllib.loads(CONFIG), headers=headers, timeout=10)
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
    assert c["steps"] == c["env_steps"] == ENVS * STEPS * UPDATES
    assert c["dup_steps"] == 0 and c["dup_corrections"] == 0
    assert c["updates"] == UPDATES and c["checkpoints"] == UPDATES
    assert c["pending"] == 0  # wait = "update": every correction recorded before its update

    steps = _trace(api, headers, run_id)
    assert len(steps) == ENVS * STEPS * UPDATES
    assert all(s["state"]["task"] and s["state"]["admissible"] for s in steps)
    for sha in {s["image_sha"] for s in steps}:
        assert sha, "every ALFWorld step stores its rendered image"
        r = httpx.get(f"{api}/api/blobs/{sha}", headers=headers, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"] == "image/png"
        image = Image.open(io.BytesIO(r.content))
        assert image.format == "PNG" and image.size == (64, 64)

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
