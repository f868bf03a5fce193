"""The RL math of GTR: pure tensor functions, one formula each (cleanrl / OpenRLHF style).

Shapes: T = rollout steps per env, E = envs, B = samples in a minibatch, L = response tokens.
Symbols follow the papers: r_t reward, V(o_t) value, d_t done, γ discount, λ_GAE GAE lambda,
ρ = π_θ/π_old the importance ratio, ε the clip range, λ the thought weight of RL4VLM.
Every loss is normalised by its own count (samples for PPO/value, tokens for SFT).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Σ x·m, where masked-out entries count as 0 even when they are ±inf or NaN."""
    # Padding positions may hold −inf log-probs (a suppressed pad token); x·0 would be NaN there.
    kept = torch.where(mask.bool(), x, torch.zeros_like(x))
    weighted = kept * mask.to(x.dtype)
    return weighted.sum() if dim is None else weighted.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of x over the positions where mask is 1; 0 where the mask is empty."""
    # mean = Σ x·m / max(Σ m, 1): an all-zero mask gives 0, never NaN.
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1.0)


def compute_gae(
    rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation; returns (advantages, returns), both (T, E)."""
    # rewards, values, dones: (T, E); d_t = 1 when the episode ended *after* step t
    # (the env auto-reset, so o_{t+1} starts a new episode). last_value: (E,) = V(o_T).
    #   δ_t = r_t + γ·V(o_{t+1})·(1 − d_t) − V(o_t)
    #   A_t = δ_t + γ·λ·(1 − d_t)·A_{t+1}          (A_T = 0)
    #   R_t = A_t + V(o_t)                          (the value target)
    num_steps = rewards.shape[0]
    not_done = 1.0 - dones.to(rewards.dtype)
    advantages = torch.zeros_like(rewards)
    next_adv = torch.zeros_like(last_value, dtype=rewards.dtype)
    next_value = last_value.to(rewards.dtype)
    for t in reversed(range(num_steps)):
        delta = rewards[t] + gamma * next_value * not_done[t] - values[t]
        next_adv = delta + gamma * lam * not_done[t] * next_adv
        advantages[t] = next_adv
        next_value = values[t]
    return advantages, advantages + values


def add_format_reward(returns: Tensor, format_valid: Tensor, bonus: float) -> Tensor:
    """R_t ← R_t + bonus·1[output_t well-formed]: a per-step bonus added *after* GAE."""
    # As the reference's storage.compute_returns: the bonus moves the value target and the
    # advantage of that step only; it is not discounted back to earlier steps. Shapes equal.
    return returns + bonus * format_valid.to(returns.dtype)


def normalize_advantages(advantages: Tensor, eps: float = 1e-8) -> Tensor:
    """Â = (A − mean A) / (std A + eps), over the whole rollout."""
    return (advantages - advantages.mean()) / (advantages.std() + eps)


def sequence_logprob(
    token_logprobs: Tensor,
    thought_mask: Tensor,
    action_mask: Tensor,
    lam: float,
    eos_mask: Tensor | None = None,
) -> Tensor:
    """log π(a|o) = λ·Σ_thought log p + Σ_action log p, per sample: (B, L) → (B,)."""
    # RL4VLM's λ-weighted sequence log-prob (λ = thought_coef; 0.5 cards, 0.2 ALFWorld).
    # eos_mask (B, L) marks end-of-sequence tokens: they are taken out of both masks, because a
    # negative advantage would otherwise push EOS down and nothing pulls it back up, so the model
    # stops ending its output (measured in tiny-numberline.md).
    thought = thought_mask.to(token_logprobs.dtype)
    action = action_mask.to(token_logprobs.dtype)
    if eos_mask is not None:
        keep = 1.0 - eos_mask.to(token_logprobs.dtype)
        thought, action = thought * keep, action * keep
    return lam * masked_sum(token_logprobs, thought, -1) + masked_sum(token_logprobs, action, -1)


def ppo_clip_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip: float
) -> tuple[Tensor, Tensor]:
    """Clipped surrogate: L = −mean min(ρ·Â, clip(ρ, 1−ε, 1+ε)·Â); returns (loss, ρ)."""
    # logprobs, old_logprobs, advantages: (B,), sequence-level log π(a|o).
    # The log-ratio is capped at 20 so one far-off sample can't overflow exp to inf; that far
    # out the clipped term is the one that counts anyway for Â > 0.
    log_ratio = (logprobs - old_logprobs).clamp(max=20.0)
    ratio = log_ratio.exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - clip, 1.0 + clip) * advantages
    return -torch.min(surr1, surr2).mean(), ratio


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float) -> Tensor:
    """Clipped value loss: ½·mean max((V − R)², (V_old + clip(V − V_old, ±ε) − R)²)."""
    # values, old_values, returns: (B,). The clip keeps V from moving more than ε per update.
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.max((values - returns) ** 2, (clipped - returns) ** 2).mean()


def thought_sft_loss(token_logprobs: Tensor, sft_mask: Tensor) -> Tensor:
    """Thought-cloning CE: −Σ log p(target token)·m / Σ m over the supervised tokens."""
    # token_logprobs: (B, L) log p of each target token; sft_mask: (B, L) 1 on supervised tokens
    # (the corrected output minus the action value). HF-style mean over all tokens of the batch.
    return -masked_mean(token_logprobs, sft_mask)


def approx_kl(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """KL(π_old‖π_θ) estimate k3 = mean((ρ − 1) − log ρ) (Schulman's low-variance estimator)."""
    log_ratio = logprobs - old_logprobs
    return ((log_ratio.exp() - 1.0) - log_ratio).mean()


def clip_fraction(ratio: Tensor, clip: float) -> Tensor:
    """Share of samples whose ratio left [1 − ε, 1 + ε]."""
    return ((ratio - 1.0).abs() > clip).to(ratio.dtype).mean()


def explained_variance(values: Tensor, returns: Tensor) -> Tensor:
    """1 − Var(R − V) / Var(R): 1 = perfect value function, 0 = no better than a constant."""
    var_returns = returns.var(unbiased=False)
    if var_returns == 0:
        return torch.tensor(float("nan"))
    return 1.0 - (returns - values).var(unbiased=False) / var_returns


# ---- switchable departures from the reference (docs/fidelity.md) ------------------------------


def ppo_clip_loss_reference(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, clip: float, max_ratio: float = 10.0
) -> tuple[Tensor, Tensor]:
    """RL4VLM/GTR's rule: if any ρ > max_ratio, L = −mean clip(ρ, 1±ε)·Â, else the usual min."""
    # Shapes (B,). The log-ratio cap at 20 only keeps exp finite (a ratio of inf would make the
    # clipped term's zero gradient 0·inf = NaN); any ratio that large triggers the rule anyway.
    ratio = (logprobs - old_logprobs).clamp(max=20.0).exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1.0 - clip, 1.0 + clip) * advantages
    if bool((ratio > max_ratio).any()):
        return -surr2.mean(), ratio
    return -torch.min(surr1, surr2).mean(), ratio


def cosine_weight(coef: float, update_idx: int, num_updates: int) -> float:
    """w_k = coef·½·(1 + cos(π·k/K)): coef at k = 0, 0 at k = K (the annealed-SFT ablation)."""
    k = min(max(update_idx, 0), num_updates)
    return coef * 0.5 * (1.0 + math.cos(math.pi * k / max(num_updates, 1)))


def judge_bonus(correct: Tensor, coef: float) -> Tensor:
    """VLM-as-judge reward term: r_t += coef·1[corrector's verdict on step t is 'correct']."""
    # correct: (T, E) 0/1; a step without a verdict (malformed output, failed call) gets 0.
    return coef * correct.to(torch.float32)


def length_bonus(thought_tokens: Tensor, max_new_tokens: int, coef: float) -> Tensor:
    """Thought-length reward term: r_t += coef·(thought tokens_t / max_new_tokens), in [0, coef]."""
    return coef * thought_tokens.to(torch.float32) / max(max_new_tokens, 1)


def dagger_sft_scale(labelled: int, drawn: int) -> float:
    """Weight of the SFT term when only `labelled` of `drawn` DAgger draws carry a correction.

    The reference pairs each PPO sample with one draw over all steps and adds CE only for a
    labelled one, so a minibatch's SFT gradient is (1/B)·Σ_labelled CE_i ≈ (k/B)·mean CE.
    """
    return labelled / drawn if drawn > 0 else 0.0


# ---- group-relative advantages (GRPO; episode groups as verl-agent's GiGPO) -------------------


def episode_returns(rewards: Tensor, dones: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per step: the undiscounted return of its episode, the episode's ordinal, completeness.

    rewards, dones: (T, E), d_t = 1 when the episode ended after step t. Returns three (T, E)
    tensors: R(t, e) = Σ r over every step of the episode holding step t (the whole episode, so
    each of its steps carries the same trajectory return); k(t, e) = number of episode ends of
    env e before step t (the episode's ordinal in the rollout); complete(t, e) = that episode
    ended inside the rollout (an episode still running at step T has no return yet).
    """
    d = dones.to(torch.long)
    # k_t = Σ_{s<t} d_s: exclusive cumulative sum along time.
    ordinal = torch.cumsum(d, 0) - d
    n_ends = d.sum(0, keepdim=True)  # (1, E)
    complete = ordinal < n_ends
    num_envs = rewards.shape[1]
    # One bucket per (env, ordinal); T buckets per env are always enough.
    bucket = ordinal + torch.arange(num_envs).unsqueeze(0) * rewards.shape[0]
    totals = torch.zeros(rewards.shape[0] * num_envs, dtype=rewards.dtype)
    totals.index_add_(0, bucket.reshape(-1), rewards.reshape(-1))
    return totals[bucket], ordinal, complete


def group_normalize(
    returns: Tensor, group_ids: Tensor, eps: float = 1e-6, use_std: bool = True
) -> tuple[Tensor, Tensor]:
    """Â_i = (R_i − mean_g R) / (std_g R + ε) within each group g; returns (Â, degenerate).

    returns, group_ids: (M,), one entry per trajectory. std is the population std (ddof 0), so
    a group of two with returns (1, 0) gets Â = ±1/(1/2 + ε)·1/2 ≈ ±1. use_std=False gives
    Dr. GRPO's R − mean. A degenerate group — all returns equal (within 1e-8) or a single
    member — has no relative signal: its Â is 0 (no policy gradient) and degenerate[i] is True.
    """
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(g, dtype=returns.dtype).index_add_(0, inv, torch.ones_like(returns))
    mean = torch.zeros(g, dtype=returns.dtype).index_add_(0, inv, returns) / count
    centred = returns - mean[inv]
    var = torch.zeros(g, dtype=returns.dtype).index_add_(0, inv, centred**2) / count
    hi = torch.full((g,), -math.inf, dtype=returns.dtype).scatter_reduce(0, inv, returns, "amax")
    lo = torch.full((g,), math.inf, dtype=returns.dtype).scatter_reduce(0, inv, returns, "amin")
    degenerate = ((hi - lo) <= 1e-8) | (count < 2)
    adv = centred / (var.sqrt()[inv] + eps) if use_std else centred
    adv = torch.where(degenerate[inv], torch.zeros_like(adv), adv)
    return adv, degenerate[inv]


def grpo_advantages(
    rewards: Tensor,
    dones: Tensor,
    group_size: int,
    eps: float = 1e-6,
    use_std: bool = True,
    first_only: bool = False,
) -> tuple[Tensor, dict[str, float]]:
    """Episode-level group advantages broadcast to steps: (T, E) → Â (T, E) and counts.

    Envs e = g·G .. g·G+G−1 form group g and their k-th episodes start from the same deal (the
    controller gives a group's sessions one seed and restarts them every rollout), so the
    trajectories of group (g, k) are the G rollouts of one start state. Every step of a complete
    episode gets that episode's Â; steps of episodes still running at the rollout's end get 0.
    first_only (``train.grpo_rollout = "episodes"``): only the first episode of each env forms
    groups (the controller rolls until every one of them ended); the steps after it get 0.
    """
    ret, ordinal, complete = episode_returns(rewards, dones)
    if first_only:
        complete = complete & (ordinal == 0)
    num_steps, num_envs = rewards.shape
    env = torch.arange(num_envs).unsqueeze(0).expand(num_steps, num_envs)
    # One row per complete episode: its first step (ordinal changes or t = 0) stands for it.
    first = torch.ones_like(complete)
    first[1:] = ordinal[1:] != ordinal[:-1]
    pick = first & complete
    group = (env // group_size) * num_steps + ordinal  # (group, ordinal) as one id
    adv_ep, degenerate_ep = group_normalize(ret[pick], group[pick], eps, use_std)
    # Broadcast each episode's Â back to all of its steps through its (env, ordinal) bucket.
    bucket = env * num_steps + ordinal
    per_bucket = torch.zeros(num_envs * num_steps, dtype=rewards.dtype)
    per_bucket[bucket[pick]] = adv_ep
    adv = torch.where(complete, per_bucket[bucket], torch.zeros_like(rewards))
    groups = group[pick]
    deg_groups = torch.unique(groups[degenerate_ep]).numel()
    n_groups = torch.unique(groups).numel()
    return adv, {
        "grpo/groups": float(n_groups),
        "grpo/degenerate_groups": float(deg_groups),
        "grpo/degenerate_frac": deg_groups / n_groups if n_groups else 0.0,
        "grpo/episodes": float(int(pick.sum())),
        "grpo/incomplete_step_frac": float((~complete).to(torch.float32).mean()),
        # Steps that carry no policy gradient: cut-off episodes and degenerate groups alike.
        "grpo/zero_adv_frac": float((adv == 0).to(torch.float32).mean()),
    }


# ---- GTR-Turbo: KL to the merged self-teacher on the agent's thought tokens -------------------


def thought_kl_penalty(
    agent_logprobs: Tensor, teacher_logprobs: Tensor, thought_mask: Tensor, clip: float = 10.0
) -> Tensor:
    """Per step: mean over thought tokens of clamp(log π_a(y) − log π_t(y), 0, clip): (B, L) → (B,).

    The tokens y are the agent's own samples (y ~ π_a), so log π_a(y) − log π_t(y) is the
    single-sample (k1) estimate of the reverse KL(π_a ‖ π_t) at that position; its mean over
    the thought tokens is the step's penalty (GTR-Turbo's KL mode subtracts it from the return,
    clamped to [0, 10] as its authors' code does). A step without thought tokens gets 0.
    """
    diff = (agent_logprobs - teacher_logprobs).clamp(0.0, clip)
    return masked_mean(diff, thought_mask, -1)


def thought_kl_loss(
    agent_logprobs: Tensor, teacher_logprobs: Tensor, thought_mask: Tensor, clip: float = 10.0
) -> Tensor:
    """The reverse KL(π_a ‖ π_t) on the agent's own thought tokens as a loss, not a reward.

    Per token y ~ π_a, ∇KL = E[(log π_a(y) − log π_t(y)) ∇ log π_a(y)]: each thought token's
    log-prob is weighted by its own (detached) log-ratio, clamped to [0, clip] as the penalty is.
    Only thought tokens carry a gradient: the action keeps its exploration (GTR-Turbo's paper:
    guiding only the thought worked better). (B, L) → a scalar, the mean over steps.
    """
    weight = (agent_logprobs.detach() - teacher_logprobs).clamp(0.0, clip)
    return masked_mean(weight * agent_logprobs, thought_mask, -1).mean()
