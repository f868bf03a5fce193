"""TIES merging (Yadav et al. 2023) of fine-tuned weights, as GTR-Turbo merges its checkpoints.

Task vectors τ_k = θ_k − θ_base (K of them, one tensor shape at a time):
1. trim:  τ̂_k keeps the ⌈density·n⌉ entries of τ_k largest in |·|, the rest set to 0;
2. elect: γ = sgn(Σ_k τ̂_k) ("total": by mass, the paper) or sgn(Σ_k sgn τ̂_k) ("frequency");
   a tie (0) elects +1;
3. disjoint mean: τ_m = Σ_k τ̂_k·1[sgn τ̂_k = γ] / max(Σ_k 1[sgn τ̂_k = γ], 1) — a trimmed (0)
   entry never counts, so each parameter averages only the deltas that agree with its sign;
and θ_merged = θ_base + τ_m. Pure functions on tensors and state dicts (no model, no I/O).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

SignRule = Literal["total", "frequency"]


def trim(delta: Tensor, density: float) -> Tensor:
    """τ̂: the ⌈density·n⌉ largest-magnitude entries of ``delta`` kept, the others 0."""
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density}")
    n = delta.numel()
    k = min(n, math.ceil(density * n))  # ceil: a small tensor (a bias) keeps at least one entry
    if k >= n:
        return delta.clone()
    flat = delta.reshape(-1)
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[flat.abs().topk(k).indices] = True
    return torch.where(keep, flat, torch.zeros_like(flat)).reshape(delta.shape)


def elect_sign(trimmed: Tensor, rule: SignRule = "total") -> Tensor:
    """γ (…) ∈ {−1, +1} from the stacked trimmed deltas (K, …); 0 → +1."""
    if rule == "total":
        mass = trimmed.sum(0)
    elif rule == "frequency":
        mass = trimmed.sign().sum(0)
    else:
        raise ValueError(f"sign rule must be total or frequency, got {rule!r}")
    return torch.where(mass >= 0, torch.ones_like(mass), -torch.ones_like(mass))


def disjoint_mean(trimmed: Tensor, sign: Tensor) -> Tensor:
    """Mean over k of the entries whose sign equals the elected one: (K, …), (…) → (…)."""
    agree = (trimmed.sign() == sign.unsqueeze(0)).to(trimmed.dtype)
    return (trimmed * agree).sum(0) / agree.sum(0).clamp(min=1.0)


def ties(deltas: Sequence[Tensor], density: float, rule: SignRule = "total") -> Tensor:
    """The TIES merge τ_m of K same-shaped task vectors."""
    if not deltas:
        raise ValueError("ties needs at least one delta")
    trimmed = torch.stack([trim(d.float(), density) for d in deltas])
    return disjoint_mean(trimmed, elect_sign(trimmed, rule)).to(deltas[0].dtype)


def ties_merge(
    base: Mapping[str, Tensor],
    finetuned: Sequence[Mapping[str, Tensor]],
    density: float,
    rule: SignRule = "total",
) -> dict[str, Tensor]:
    """θ_base + TIES(θ_k − θ_base) for every floating tensor of a state dict.

    Keys must match across all dicts. A non-floating tensor (an index buffer) is not a weight:
    it is taken from the last state dict unchanged. One fine-tuned state dict is returned as is
    (nothing to resolve between checkpoints; trimming a lone delta would only lose signal).
    """
    if not finetuned:
        raise ValueError("ties_merge needs at least one fine-tuned state dict")
    for i, sd in enumerate(finetuned):
        if sd.keys() != base.keys():
            missing = sorted(set(base) ^ set(sd))[:3]
            raise ValueError(f"state dict {i} has other keys than the base, e.g. {missing}")
    last = finetuned[-1]
    if len(finetuned) == 1:
        return {k: v.clone() for k, v in last.items()}
    out: dict[str, Tensor] = {}
    for key, theta0 in base.items():
        if not theta0.is_floating_point():
            out[key] = last[key].clone()
            continue
        deltas = [sd[key].float() - theta0.float() for sd in finetuned]
        out[key] = (theta0.float() + ties(deltas, density, rule)).to(theta0.dtype)
    return out
