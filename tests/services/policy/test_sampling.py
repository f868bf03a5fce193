"""Inverse-CDF sampling: draws follow softmax(scores), masked tokens never come out, and the
policy's temperature, top-p and seed mean what they meant under HF's multinomial."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from services.policy import sampling
from services.policy.sampling import CdfDraw
from services.policy.service import Policy

from .conftest import PROMPTS


def test_draws_follow_the_softmax_and_never_pick_a_masked_token() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 0.5, float("-inf"), -1.0, 1.0, float("-inf")])
    rows = 200_000
    out = CdfDraw()(torch.zeros(rows, 0, dtype=torch.long), logits.expand(rows, -1).clone())
    assert torch.isfinite(out).sum(-1).eq(1).all()  # one token left per row...
    picked = out.argmax(-1)
    assert torch.equal(out.gather(1, picked[:, None]), torch.zeros(rows, 1))  # ...at score 0
    freq = torch.bincount(picked, minlength=6).double() / rows
    want = torch.softmax(logits.double(), -1)
    assert freq[2] == freq[5] == 0
    # 5 standard errors of a frequency near 0.5 at 200k draws: 0.0056
    assert torch.allclose(freq, want, atol=0.0056), (freq, want)


def test_a_draw_at_the_very_top_of_the_range_takes_the_last_token_with_mass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """u * total can round up to total: the draw must not fall on the masked tail."""
    monkeypatch.setattr(sampling.torch, "rand", lambda shape, **kw: torch.ones(shape, **kw))
    scores = torch.tensor([[0.0, 1.0, 3.0, float("-inf"), float("-inf")]])
    assert CdfDraw()(torch.zeros(1, 0, dtype=torch.long), scores).argmax(-1).item() == 2


@pytest.fixture(scope="module")
def policy(tiny_path: Callable[[str], Path]) -> Policy:
    return Policy.load(tiny_path("llava"), lora_r=4)


def _tokens(policy: Policy, images: list[np.ndarray], **kw: object) -> list[list[int]]:
    gens = policy.generate(images, PROMPTS, max_new_tokens=16, **kw)  # type: ignore[arg-type]
    return [g.token_ids for g in gens]


def test_seed_temperature_and_top_p_keep_their_meaning(
    policy: Policy, images: list[np.ndarray]
) -> None:
    assert policy.cdf_sampling
    greedy = _tokens(policy, images, greedy=True)
    assert _tokens(policy, images, seed=3) == _tokens(policy, images, seed=3)
    draws = {str(_tokens(policy, images, seed=s)) for s in range(4)}
    assert len(draws) > 1 and str(greedy) not in draws  # a random model samples far from greedy
    # A near-zero temperature, or a top-p that keeps only the top token, is the greedy decode.
    assert _tokens(policy, images, temperature=1e-4, seed=0) == greedy
    assert _tokens(policy, images, top_p=1e-6, seed=0) == greedy


def test_the_sampled_tokens_log_probs_are_scores_at_the_temperature(
    policy: Policy, images: list[np.ndarray]
) -> None:
    gens = policy.generate(images, PROMPTS, max_new_tokens=16, temperature=0.7, seed=1)
    out = policy.score(images, PROMPTS, [g.token_ids for g in gens], temperature=0.7)
    for i, g in enumerate(gens):
        n = len(g.token_ids)
        assert np.all(np.isfinite(g.logprobs))  # no suppressed or zero-probability draw
        assert np.allclose(out.logprobs[i, :n].numpy(), g.logprobs, atol=1e-4)
