"""Trainer test helpers: a tiny model built once per session, images in the blob store."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shared.rollout import Rollout
from shared.storage import blob_store


@pytest.fixture(scope="session")
def tiny_dir(default_model_dir: Path) -> Path:
    """The session's default tiny model: ``build_tiny(dir, "llava", "1m", 64)`` on the envs'
    own corpus (``services.env.expert.corpus(2000, 0)``), built once for every suite."""
    return default_model_dir


def put_image(color: tuple[int, int, int], seed: int = 0) -> str:
    """A 64-px image (a colour plus a little noise) stored as a PNG blob; returns its sha."""
    rng = np.random.default_rng(seed)
    arr = np.clip(np.array(color)[None, None] + rng.integers(0, 8, (64, 64, 3)), 0, 255)
    buf = io.BytesIO()
    Image.fromarray(arr.astype(np.uint8)).save(buf, format="PNG")
    return blob_store().put(buf.getvalue())


def rollout_of(
    policy,
    shas: list[str],
    prompts: list[str],
    texts: list[str],
    rewards: list[float],
    num_envs: int,
    temperature: float = 1.0,
) -> Rollout:
    """A rollout whose responses are given texts, scored by the policy as the controller would."""
    from services.trainer.service import blob_image_loader

    load = blob_image_loader()
    ids = [policy.encode_response(t) for t in texts]
    out = policy.score([load(s) for s in shas], prompts, ids, temperature=temperature)
    spans = [policy.spans(x) for x in ids]
    padded, lengths = Rollout.pad_responses(ids, pad_id=policy.pad_id)
    shape = padded.shape
    mask = lambda k: Rollout.pad_responses([s[k] for s in spans], 0, bool)[0]  # noqa: E731
    n = len(texts)
    return Rollout(
        num_envs=num_envs,
        num_steps=n // num_envs,
        step_ids=np.arange(n, dtype=np.int64),
        prompts=np.array(prompts),
        image_shas=np.array(shas),
        response_ids=padded,
        response_lengths=lengths,
        old_logprobs=out.logprobs.detach().numpy()[:, : shape[1]].astype(np.float32),
        thought_mask=mask(0),
        action_mask=mask(1),
        values=out.values.detach().numpy().astype(np.float32),
        rewards=np.array(rewards, np.float32),
        dones=np.ones(n, bool),
        format_valid=np.ones(n, bool),
        actions=np.array(["+"] * n),
        last_values=np.zeros(num_envs, np.float32),
        pad_id=policy.pad_id,
    )
