"""The thought-SFT term's gradient norm and its share of the applied step (``step_gradients``),
recorded on every update of an arm with an SFT term: the figure that shows guidance drowning."""

from __future__ import annotations

import pytest
import torch

from services.trainer.service import SFT_NORM, SFT_SHARE, step_gradients


def _params(ppo: list[float]) -> list[torch.nn.Parameter]:
    p = torch.nn.Parameter(torch.zeros(len(ppo)))
    p.grad = torch.tensor(ppo)
    return [p]


def test_under_one_clip_a_large_ppo_gradient_drowns_the_sft_term() -> None:
    """v3's situation: PPO's gradient norm 10 against the SFT term's 0.5, clipped together at
    1.0: the SFT term is 0.5 / 10.5 of the step, and the step itself is clipped to 1."""
    params = _params([6.0, 8.0])  # norm 10
    norms = step_gradients(params, [torch.tensor([0.3, 0.4])], 1.0, per_loss=False)
    assert norms[SFT_NORM] == pytest.approx(0.5)
    assert norms[SFT_SHARE] == pytest.approx(0.5 / 10.5)
    assert norms["grad_norm"] == pytest.approx(10.5)  # the sum, before the clip
    assert float(torch.linalg.vector_norm(params[0].grad)) == pytest.approx(1.0, rel=1e-4)


def test_clipped_apart_the_sft_term_keeps_its_size() -> None:
    params = _params([6.0, 8.0])
    norms = step_gradients(params, [torch.tensor([0.3, 0.4])], 1.0, per_loss=True)
    assert norms[SFT_SHARE] == pytest.approx(0.5 / 1.5)  # 0.5 beside the PPO part cut to 1.0
    assert norms["grad_norm"] == pytest.approx(10.0)
    assert norms["grad_norm/sft"] == pytest.approx(0.5)
    assert params[0].grad.tolist() == pytest.approx([0.6 + 0.3, 0.8 + 0.4], rel=1e-4)


def test_an_update_without_an_sft_term_records_no_share() -> None:
    norms = step_gradients(_params([3.0, 4.0]), None, 1.0, per_loss=False)
    assert SFT_SHARE not in norms and norms["grad_norm"] == pytest.approx(5.0)
