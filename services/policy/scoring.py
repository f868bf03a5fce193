"""The parts of a forward pass that ``Policy.generate`` and ``Policy.score`` share: responses
padded and appended to the prompt, each token's log-prob and entropy, the final norm's hidden
state captured for the value head and the value read from it, and a sampled row turned into a
``Generation``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from services.policy.last_layer import ResponseLastLayer
from services.policy.loading import QWEN_TYPES
from services.policy.schemas import Generation
from services.policy.spans import token_spans


def pad_responses(
    response_ids: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) token ids right-padded with ``pad_id``, and their 0/1 mask."""
    t = max(1, max(len(r) for r in response_ids))
    resp = torch.full((len(response_ids), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(response_ids), t), dtype=torch.long)
    for i, r in enumerate(response_ids):
        resp[i, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = 1
    return resp.to(device), mask.to(device)


def with_response(
    inputs: dict[str, Any], resp: torch.Tensor, mask: torch.Tensor, model_type: str
) -> dict[str, Any]:
    """The model's inputs for prompt + response, in one forward."""
    full = dict(inputs)
    full["input_ids"] = torch.cat([inputs["input_ids"], resp], dim=1)
    attn = torch.cat([inputs["attention_mask"], mask], dim=1)
    full["attention_mask"] = attn
    for key in ("mm_token_type_ids", "token_type_ids"):  # zero over the response (Qwen2-VL)
        if key in inputs:
            full[key] = torch.cat([inputs[key], torch.zeros_like(resp)], dim=1)
    if model_type not in QWEN_TYPES:  # Qwen computes its 3-D rope positions itself
        full["position_ids"] = (attn.cumsum(-1) - 1).clamp(min=0)
    return full


def token_stats(
    logits: torch.Tensor, tokens: torch.Tensor, temperature: float, suppress_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of `tokens` and entropy under softmax(logits/T) over the allowed tokens."""
    logits = logits / temperature
    if suppress_ids:
        logits = logits.index_fill(
            -1, torch.tensor(suppress_ids, device=logits.device), float("-inf")
        )
    logp_all = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    p = logp_all.exp()
    ent = -(p * logp_all.masked_fill(p == 0, 0.0)).sum(-1)
    return logp, ent


@contextmanager
def last_hidden(
    final_norm: nn.Module,
    position: int,
    image: torch.Tensor | None,
    last_layer: ResponseLastLayer | None = None,
) -> Iterator[list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """Capture the LM's last-layer hidden state (final norm output) at `position`, first call,
    and, where ``image`` marks the prompt's image tokens (B, P, 1) for the image-reading value
    head, its mean over them. With ``last_layer`` (score's forward, whose logits are those of
    `position` on) that layer computes only these positions and the ones after `position`
    (services/policy/last_layer.py).

    A hook instead of `output_hidden_states`, which would keep every layer of the prompt.
    """
    captured: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def hook(_m: nn.Module, _i: Any, output: torch.Tensor) -> None:
        if not captured:
            pooled = None
            if image is not None:  # mean over image positions: Σ h·m / Σ m
                m = image.to(output.dtype)
                pooled = (output[:, : m.shape[1]] * m).sum(1) / m.sum(1).clamp(min=1.0)
            captured.append((output[:, position], pooled))

    handle = final_norm.register_forward_hook(hook)
    try:
        with last_layer.active(position, image) if last_layer is not None else nullcontext():
            yield captured
    finally:
        handle.remove()


def value_of(
    head: nn.Module, hidden: torch.Tensor, image: torch.Tensor | None = None
) -> torch.Tensor:
    """The value head on what ``last_hidden`` captured: (B, d) or, with the image mean, (B, 2d)."""
    x = hidden if image is None else torch.cat([hidden, image], dim=-1)
    return head(x.float()).squeeze(-1).float()  # (B,); fp32 under autocast too


def generation_of(
    tokenizer: Any, eos_id: int, row: list[int], logp: torch.Tensor, ent: torch.Tensor, value: float
) -> Generation:
    """One sampled row, cut after its EOS, with its per-token figures and spans."""
    n = row.index(eos_id) + 1 if eos_id in row else len(row)
    ids = row[:n]
    thought, action, has_action = token_spans(tokenizer, ids, eos_id)
    return Generation(
        text=tokenizer.decode(ids, skip_special_tokens=True),
        token_ids=ids,
        logprobs=logp[:n].tolist(),
        value=value,
        thought_mask=thought,
        action_mask=action,
        entropy=ent[:n].tolist(),
        has_action=has_action,
        finished=bool(ids) and ids[-1] == eos_id,
    )
