"""A policy on the real SmolLM2 weights (the ``smol_dir`` 2-layer slice) through a run's parts:
the LoRA warm start that leaves the pretrained base untouched, the policy service over HTTP,
and a real short run whose steps the trace browser shows in English."""

from __future__ import annotations

import html
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import uvicorn

from services.policy.app import create_app
from services.policy.client import PolicyClient
from services.policy.service import Policy, policy_for_checkpoint
from tests.conftest import free_port, live_server

RUN = """name = "smol-trace"
task = "ezpoints"
algorithm = "gtr"
seed = 0
[env]
image_size = 64
[model]
path = "{model}"
finetune = "lora"
lora_r = 4
lora_alpha = 8
[generation]
max_new_tokens = 12
[init]
kind = "{init}"
finetune = "lora"
vision_steps = 2
sft_samples = 4
sft_steps = 1
batch_size = 2
cache = false
[train]
num_envs = 2
num_steps = 2
num_updates = 1
ppo_epochs = 1
minibatch_size = 4
[corrector]
name = "oracle"
[metrics]
probe_states = 2
"""


def _config(tmp_path: Path, model: Path, init: str) -> Any:
    from services.controller.console import load_config

    path = tmp_path / "smol.toml"
    path.write_text(RUN.format(model=model, init=init))
    return load_config(path)


def test_a_lora_warm_start_trains_lora_and_vision_and_leaves_the_base(
    smol_dir: Path, tmp_path: Path
) -> None:
    from services.trainer.warmstart import init_policy

    before = {f.name: f.stat().st_mtime_ns for f in smol_dir.iterdir()}
    fresh = Policy.load(smol_dir, finetune="lora", lora_r=4, lora_alpha=8)
    cfg = _config(tmp_path, smol_dir, "warm_start")
    policy, summary = init_policy(cfg, tmp_path / "base")
    assert summary["sft/steps"] == 1 and summary["vision/steps"] >= 1
    assert not (tmp_path / "base").exists()  # no fine-tuned copy of the base
    assert {f.name: f.stat().st_mtime_ns for f in smol_dir.iterdir()} == before
    old, new = dict(fresh.vision_named_parameters()), dict(policy.vision_named_parameters())
    assert any(not torch.equal(old[k], new[k]) for k in old)  # projector / tower trained
    assert not any(p.requires_grad for p in new.values())  # RL trains the LoRA only
    lora = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert lora and all("lora_" in n for n in lora)
    # The checkpoint carries the vision weights, and a policy reloaded from it saves them again.
    policy.save(tmp_path / "ck")
    again = policy_for_checkpoint(None, tmp_path / "ck")
    assert again.model_path == smol_dir and again.vision_in_checkpoint
    reloaded = dict(again.vision_named_parameters())
    assert all(torch.equal(new[k], reloaded[k]) for k in new)


@pytest.fixture(scope="module")
def served(smol_dir: Path) -> Iterator[tuple[Policy, str]]:
    policy = Policy.load(smol_dir, finetune="lora", lora_r=4)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(policy), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield policy, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_the_policy_service_answers_in_the_real_vocabulary(
    served: tuple[Policy, str],
) -> None:
    policy, url = served
    image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    prompt = "You are an expert card game player. Reply in JSON."
    remote = PolicyClient(url).generate([image], [prompt], max_new_tokens=8, seed=4)[0]
    local = policy.generate([image], [prompt], max_new_tokens=8, seed=4)[0]
    assert remote.token_ids == local.token_ids and remote.text == local.text
    assert remote.text == policy.tokenizer.decode(remote.token_ids, skip_special_tokens=True)
    assert max(remote.token_ids) < 49152  # real word pieces, never an added image token
    assert np.allclose(remote.logprobs, local.logprobs, atol=1e-4)


@pytest.mark.slow
def test_the_trace_browser_shows_a_smol_run_in_english(
    pg_url: str, smol_dir: Path, tmp_path: Path
) -> None:
    """A real 1-update GTR run on the slice; its step page shows the agent's output as the real
    tokenizer decoded it (English word pieces; the untrained slice writes no JSON, so nothing is
    corrected: test_smol_tokens.py tokenizes a corrected thought) and the English prompt."""
    from sqlalchemy import select

    from services.api.app import create_app as create_api
    from services.api.auth import create_token
    from services.api.service import create_run
    from services.controller.backends import InProcessPolicy, InProcessTrainer, ThreadCorrections
    from services.controller.service import RunDriver
    from services.env import EnvPool
    from shared.db.models import Step
    from shared.db.session import session_scope
    from shared.settings import get_settings

    cfg = _config(tmp_path, smol_dir, "none")
    with session_scope() as s:
        run_id = create_run(s, cfg, "smol-team").id
        token = create_token(s, "smol-read", "read", "smol-team")[1]
    corrections = ThreadCorrections("oracle", 0.0, 0, get_settings())
    driver = RunDriver(
        run_id, EnvPool(), InProcessPolicy(cfg.model), corrections, InProcessTrainer()
    )
    assert driver.run() == "completed"
    with session_scope() as s:
        steps = s.scalars(select(Step).where(Step.run_id == run_id).order_by(Step.id)).all()
        shown_steps = [(st.id, st.output, st.prompt) for st in steps]
    assert len(shown_steps) == 4
    step_id, output, prompt = next(x for x in shown_steps if re.search(r"[A-Za-z]{3,}", x[1]))
    with live_server(create_api()) as url:
        page = httpx.get(
            f"{url}/runs/{run_id}/steps/{step_id}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=60,
        )
    assert page.status_code == 200, page.text[:300]
    shown = html.unescape(page.text)
    assert output.strip() in shown  # the decoded English word pieces, as written
    assert "You are an expert card game player." in prompt and prompt[:60] in shown
