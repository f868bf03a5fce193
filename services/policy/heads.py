"""Value heads and the generated-tokens repetition penalty (docs/fidelity.md).

Value heads read the LM's last-layer hidden state of the last prompt token (d):
- ``linear``: one Linear d → 1 (this platform's default);
- ``mlp``: the reference's MLP d → 1024 → ReLU → 512 → ReLU → 1;
- ``mlp+image``: the same MLP on [h_last ; mean of the image tokens' hidden states] (2d), so the
  value can read the observation directly (on the tiny model the last token alone carries little
  of the state: explained variance ≈ 0 measured, docs/fidelity.md).
The last layer starts at zero, so every head predicts V = 0 before training.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

VALUE_HEADS = ("linear", "mlp", "mlp+image")


def make_value_head(kind: str, hidden: int) -> nn.Module:
    """A value head of `kind` over a d = `hidden` LM; outputs (B, 1)."""
    if kind == "linear":
        head: nn.Module = nn.Linear(hidden, 1)
        last = head
    elif kind in ("mlp", "mlp+image"):
        width = 2 * hidden if kind == "mlp+image" else hidden
        last = nn.Linear(512, 1)
        head = nn.Sequential(
            nn.Linear(width, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), last
        )
    else:
        raise ValueError(f"value_head must be one of {', '.join(VALUE_HEADS)}, got {kind!r}")
    assert isinstance(last, nn.Linear)
    nn.init.zeros_(last.weight)
    nn.init.zeros_(last.bias)
    return head


def image_token_id(config: Any) -> int:
    """The id of the image placeholder tokens in the prompt (-1 when the model has none)."""
    for key in ("image_token_id", "image_token_index"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return -1


class GeneratedRepetitionPenalty:
    """HF logits processor: the CTRL repetition penalty over the response's own tokens only.

    For every token already generated in a row: logit / p if logit > 0, else logit · p (p > 1
    makes it less likely). HF's built-in counts the prompt too, which pushes down the action
    tokens the prompt lists ('1'…'10', '+'); the reference generated from input embeddings, so
    its penalty saw only generated tokens.
    """

    def __init__(self, penalty: float, prompt_len: int) -> None:
        if penalty <= 0:
            raise ValueError("repetition penalty must be > 0")
        self.penalty, self.prompt_len = penalty, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_len :]  # (B, t)
        if generated.shape[1] == 0:
            return scores
        return penalise(scores, generated, self.penalty)


def penalise(scores: torch.Tensor, tokens: torch.Tensor, penalty: float) -> torch.Tensor:
    """scores (B, V) with every id in tokens (B, t) penalised once (repeats count once)."""
    picked = scores.gather(1, tokens)
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    return scores.scatter(1, tokens, picked)
