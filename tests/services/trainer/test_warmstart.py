"""The warm start: aux heads make the vision tower read the state; `gtr sft` teaches the format."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.policy.service import Policy
from services.trainer import warmstart
from shared.schemas import EnvConfig


def test_oracle_samples_and_aux_slots() -> None:
    samples = warmstart.oracle_samples("numberline", EnvConfig(image_size=64), 40, seed=0)
    assert len(samples) == 40 and samples[0].image.shape == (64, 64, 3)
    out = json.loads(samples[0].text)
    assert out["current number"] == samples[0].state["current"] and out["action"] in "+-"
    ids, vocab = warmstart.encode_slots(samples, "numberline")
    assert ids.shape == (40, 2) and all(2 <= v <= 6 for v in vocab)
    ez = warmstart.oracle_samples("ezpoints", EnvConfig(image_size=64), 30, seed=0)
    assert len(warmstart.aux_slots("ezpoints", ez[0].state)) == 2 + warmstart.MAX_FORMULA_SLOTS


def test_vision_warmup_makes_the_projector_read_the_numbers(tiny_dir: Path) -> None:
    torch.manual_seed(0)
    policy = Policy.load(tiny_dir, finetune="lora")
    samples = warmstart.oracle_samples("numberline", EnvConfig(image_size=64), 100, seed=0)
    before = [p.detach().clone() for p in policy.vision_parameters()]
    stats = warmstart.vision_warmup(policy, samples, "numberline", steps=300, seed=0)
    assert stats["vision/loss"] < 0.05 and stats["vision/steps"] < 300  # stopped at ≈0
    after = policy.vision_parameters()
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))


@pytest.mark.slow
def test_gtr_sft_cli_warm_starts_a_lora_policy(tmp_path: Path, tiny_dir: Path) -> None:
    config = tmp_path / "warm.toml"
    # Batches of 8, not the default 16: half the SFT compute, and still every greedy output JSON
    # after 80 steps (40 steps of 16 leave none).
    config.write_text(f"""
task = "numberline"
[env]
image_size = 64
[model]
path = "{tiny_dir}"
finetune = "lora"
[init]
vision_steps = 300
sft_samples = 200
sft_steps = 80
batch_size = 8
""")
    out = tmp_path / "warm"
    gtr = Path(sys.executable).parent / "gtr"
    done = subprocess.run(
        [str(gtr), "sft", str(config), "--out", str(out), "--eval-episodes", "6"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["vision/loss"] < 0.05 and summary["eval/json"] >= 0.8  # random model: 0
    # The LoRA policy sits on the warm-started base saved beside it, and loads from there.
    meta = json.loads((out / "policy.json").read_text())
    assert meta["finetune"] == "lora" and Path(meta["base_model"]) == out / "base"
    policy = Policy.load(out / "base", finetune="lora")
    policy.load_weights(out)
    bad = subprocess.run(
        [str(gtr), "sft", str(config), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "not empty" in bad.stderr
