"""The update loop: PPO on the λ-weighted thought+action log-prob plus thought SFT (GTR).

``Trainer`` is a plain object holding the policy, one optimiser over the trainable parameters
(LoRA or the full model, plus the value head), the LR schedule and the RNGs. ``update`` runs one
PPO update on a ``Rollout``; ``algorithm`` picks the loss terms of the same loop:
gtr = PPO + SFT, rl4vlm = PPO only, sft_only = SFT only; grpo / gtr_grpo take group-relative
advantages and drop the value loss (gtr_grpo adds SFT); gtr_turbo_kl subtracts a KL penalty to
the merged self-teacher (``self.teacher``, set by the worker): a loss on the thought tokens, or
(``teacher.kl_into = "return"``) subtracted from the returns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from services.trainer import algos
from services.trainer.buffer import DaggerBuffer, SftExample
from shared.rollout import Rollout
from shared.schemas import GROUP_ALGORITHMS, GenerationConfig, TeacherConfig, TrainConfig

if TYPE_CHECKING:
    from services.policy.service import Policy

ImageLoader = Callable[[str], Any]

ALGORITHMS = ("gtr", "rl4vlm", "sft_only", "grpo", "gtr_grpo", "gtr_turbo_kl")
PPO_ALGORITHMS = ("gtr", "rl4vlm", "grpo", "gtr_grpo", "gtr_turbo_kl")  # a policy-gradient term
SFT_ALGORITHMS = ("gtr", "sft_only", "gtr_grpo")  # a thought-SFT term on the DAgger buffer


@dataclass
class Batch:
    """One minibatch of rollout samples, as tensors (B = minibatch size, L = response length)."""

    idx: np.ndarray  # (B,) positions in the rollout
    response_ids: list[list[int]]  # B token lists, unpadded
    old_logprobs: Tensor  # (B,) sequence log π_old(a|o)
    thought_mask: Tensor  # (B, L)
    action_mask: Tensor  # (B, L)
    eos_mask: Tensor  # (B, L) 1 on EOS tokens: kept out of the PG term
    advantages: Tensor  # (B,) normalised Â
    returns: Tensor  # (B,) R = GAE return + format bonus
    old_values: Tensor  # (B,) V_old


def blob_image_loader() -> ImageLoader:
    """Images by sha from the blob store, decoded to RGB PIL images."""
    import io

    from PIL import Image

    from shared.storage import blob_store

    store = blob_store()
    return lambda sha: Image.open(io.BytesIO(store.get(sha))).convert("RGB")


def cached_images(load: ImageLoader, capacity: int = 4096) -> Callable[[str | None], Any]:
    """The observation image of a blob sha (None for none), cached up to ``capacity`` images."""
    cache: dict[str, Any] = {}

    def image(sha: str | None) -> Any:
        if not sha:
            return None
        if sha not in cache:
            if len(cache) > capacity:
                cache.clear()
            cache[sha] = load(sha)
        return cache[sha]

    return image


def make_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainConfig
) -> torch.optim.lr_scheduler.LRScheduler:
    """Cosine from lr to lr_min over lr_schedule_updates (else num_updates), or constant;
    stepped once per update. The reference fixes T_max at 25 whatever the run's length."""
    if cfg.lr_schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    period = cfg.lr_schedule_updates or cfg.num_updates
    return torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=max(1, period), eta_min=cfg.lr_min
    )


class Trainer:
    """PPO + thought SFT on one policy; state = weights, optimiser, scheduler, RNGs, update_idx."""

    def __init__(
        self,
        policy: Policy,
        train: TrainConfig,
        algorithm: str = "gtr",
        generation: GenerationConfig | None = None,
        seed: int = 0,
        image_loader: ImageLoader | None = None,
        accelerator: Any = None,
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
        self.policy, self.cfg, self.algorithm = policy, train, algorithm
        gen = generation or GenerationConfig()
        self.temperature, self.max_new_tokens = gen.temperature, gen.max_new_tokens
        self.params = unique_trainable(policy.trainable_parameters())
        head = {id(p) for p in getattr(policy, "value_head", torch.nn.Module()).parameters()}
        groups: list[dict[str, Any]] = [
            {"params": [p for p in self.params if id(p) not in head]},
            # The value head starts at zero and must catch up with the returns quickly; the
            # policy must not move fast: separate learning rates (tiny-numberline.md: 1e-3 / 1e-4).
            {"params": [p for p in self.params if id(p) in head], "lr": train.value_lr or train.lr},
        ]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=train.lr, eps=train.adam_eps, weight_decay=0.0
        )
        # The guidance term's gradients (thought SFT, or the KL to the teacher), kept apart until
        # the optimiser step: its norm and share of the step are recorded (guidance_term).
        self._apart: list[Tensor | None] | None = None
        self.scheduler = make_scheduler(self.optimizer, train)
        self.update_idx = -1  # index of the last finished update; -1 = none yet
        self.accelerator = accelerator
        # The minibatch permutation must be the same on every rank (each takes its share of it);
        # the DAgger draws must not be, or every rank trains on the same SFT examples.
        rank = self._rank_world()[0]
        self.rng = np.random.default_rng(seed if rank == 0 else [seed, rank])
        self.torch_gen = torch.Generator().manual_seed(seed)
        self.device = torch.device(getattr(policy, "device", "cpu"))
        self.image_loader = image_loader or blob_image_loader()
        self.image = cached_images(self.image_loader)  # images repeat across epochs
        self._targets: dict[int, tuple[list[int], list[int]]] = {}
        self.reward_terms: dict[str, float] = {}  # the extra reward terms of the last update
        self.grouped = algorithm in GROUP_ALGORITHMS
        self.teacher: Policy | None = (
            None  # gtr_turbo_kl: the merged self-teacher (runs.py sets it)
        )
        self.turbo = TeacherConfig()  # gtr_turbo_kl: kl_coef, kl_clip (runs.py sets the run's)
        self._extra: dict[str, float] = {}  # advantage statistics of the current update
        self.trained: np.ndarray | None = None  # grpo: the steps the update trains (N,) bool
        self._teacher_lp = np.zeros((0, 0), dtype=np.float32)  # gtr_turbo_kl: per token
        self._teacher_valid = np.zeros((0, 0), dtype=np.float32)

    # ---- stages ------------------------------------------------------------------------------

    def compute_advantages(
        self, rollout: Rollout, judged_correct: np.ndarray | None = None
    ) -> tuple[Tensor, Tensor]:
        """GAE over (T, E), the format bonus on the returns, normalised advantages; both (N,).

        judged_correct (N,) 0/1: the corrector's verdicts, for the VLM-as-judge reward term."""
        t, e = rollout.num_steps, rollout.num_envs
        as_te = lambda x: torch.as_tensor(np.asarray(x, dtype=np.float32)).reshape(t, e)  # noqa: E731
        if self.grouped:
            return self.group_advantages(rollout)
        values = as_te(rollout.values)
        rewards = as_te(rollout.rewards)
        self.reward_terms = {}
        if self.cfg.length_reward:
            n_thought = rollout.thought_mask.sum(axis=1)
            term = algos.length_bonus(as_te(n_thought), self.max_new_tokens, self.cfg.length_reward)
            rewards, self.reward_terms["reward/length"] = rewards + term, float(term.mean())
        if self.cfg.judge_reward and judged_correct is not None:
            term = algos.judge_bonus(as_te(judged_correct), self.cfg.judge_reward)
            rewards, self.reward_terms["reward/judge"] = rewards + term, float(term.mean())
        _, returns = algos.compute_gae(
            rewards,
            values,
            as_te(rollout.dones),
            torch.as_tensor(rollout.last_values, dtype=torch.float32),
            self.cfg.gamma,
            self.cfg.gae_lambda,
        )
        bonus = self.cfg.format_reward
        returns = algos.add_format_reward(returns, as_te(rollout.format_valid), bonus)
        if self.algorithm == "gtr_turbo_kl":
            # A malformed output has no thought to score: the authors charge it KL 100 and a
            # format reward of -2 (teacher.malformed_kl, malformed_reward; 0 and 0 = ours before).
            # teacher.kl_into = "thought_loss": the KL is a loss on the thought tokens instead
            # (ppo_loss), so neither it nor malformed_kl enters the return.
            bad = 1.0 - as_te(rollout.format_valid)
            kl = as_te(self.kl_penalty(rollout)) * (1.0 - bad) + self.turbo.malformed_kl * bad
            if self.turbo.kl_into == "return":
                returns = returns - self.turbo.kl_coef * kl
            returns = returns + self.turbo.malformed_reward * bad
        advantages = returns - values  # A = (GAE return + bonus) − V, as the reference
        adv = algos.normalize_advantages(advantages.reshape(-1))
        return adv.to(self.device), returns.reshape(-1).to(self.device)

    def group_advantages(self, rollout: Rollout) -> tuple[Tensor, Tensor]:
        """grpo: episode returns (+ format bonus per step) normalised within start-state groups;
        only the steps of the episodes that formed groups are trained (``self.trained``)."""
        adv, ret, self.trained, self._extra = group_advantages(rollout, self.cfg)
        return adv.to(self.device), ret.to(self.device)

    def kl_penalty(self, rollout: Rollout) -> np.ndarray:
        """gtr_turbo_kl: each step's thought-token KL penalty against the teacher, (N,); the
        teacher's token log-probs are kept for the thought-token KL loss."""
        if self.teacher is None:
            raise RuntimeError("gtr_turbo_kl needs a teacher: set Trainer.teacher first")
        out, self._teacher_lp, self._teacher_valid = teacher_scores(
            self.teacher, rollout, self.image, self.cfg.minibatch_size, self.temperature, self.turbo
        )
        # The teacher's distance from the agent, on the steps it can score (well-formed ones).
        formed = np.asarray(rollout.format_valid, dtype=bool).reshape(-1)
        scored = out[formed] if formed.any() else np.zeros(1, dtype=np.float32)
        self._extra = {
            "turbo/kl_mean": float(scored.mean()),
            "turbo/kl_max": float(scored.max()),
            "turbo/malformed_frac": float(1.0 - formed.mean()),
        }
        return out

    def minibatches(self, rollout: Rollout, adv: Tensor, ret: Tensor) -> Iterator[Batch]:
        """Shuffled minibatches of one epoch; with several processes each takes its share. grpo:
        only the trained steps (a step left over after its env's grouped episode, Â = 0, would
        dilute the policy-gradient mean)."""
        kept = np.arange(rollout.size) if self.trained is None else np.flatnonzero(self.trained)
        n, mb = len(kept), self.cfg.minibatch_size
        perm = kept[torch.randperm(n, generator=self.torch_gen).numpy()]
        rank, world = self._rank_world()
        for start in range(0, n, mb):
            chunk = perm[start : start + mb]
            # Every rank must take part in each gradient all-reduce: skip a chunk too small to
            # give each of them a sample (the same decision on every rank).
            if len(chunk) >= world:
                yield self.make_batch(rollout, chunk[rank::world], adv, ret)

    def make_batch(self, rollout: Rollout, idx: np.ndarray, adv: Tensor, ret: Tensor) -> Batch:
        """Slice the rollout at idx; old sequence log-probs use the same masks as the new ones."""
        ids = [rollout.response_ids[i, : rollout.response_lengths[i]].tolist() for i in idx]
        length = max(1, max(len(x) for x in ids))
        cut = np.ix_(idx, np.arange(length))
        dev = self.device
        th = torch.as_tensor(rollout.thought_mask[cut]).float().to(dev)  # (B, L)
        ac = torch.as_tensor(rollout.action_mask[cut]).float().to(dev)  # (B, L)
        eos = torch.as_tensor(rollout.response_ids[cut] == self.policy.eos_id).float().to(dev)
        old_tok = torch.as_tensor(rollout.old_logprobs[cut]).float().to(dev)  # (B, L)
        return Batch(
            idx=idx,
            response_ids=ids,
            old_logprobs=algos.sequence_logprob(old_tok, th, ac, self.cfg.thought_coef, eos),
            thought_mask=th,
            action_mask=ac,
            eos_mask=eos,
            advantages=adv[idx],
            returns=ret[idx],
            old_values=torch.as_tensor(rollout.values[idx], dtype=torch.float32).to(dev),
        )

    def ppo_loss(self, rollout: Rollout, b: Batch) -> tuple[Tensor, dict[str, float]]:
        """PPO clipped surrogate + value_coef × clipped value loss on one minibatch."""
        images = [self.image(rollout.image_shas[i]) for i in b.idx]
        prompts = [str(rollout.prompts[i]) for i in b.idx]
        out = self.policy.score(
            images, prompts, b.response_ids, with_grad=True, temperature=self.temperature
        )
        length = b.thought_mask.shape[1]
        lp = out.logprobs[:, :length]
        valid = out.mask[:, :length].float()
        logp = algos.sequence_logprob(
            lp, b.thought_mask * valid, b.action_mask * valid, self.cfg.thought_coef, b.eos_mask
        )
        clip_loss = (
            algos.ppo_clip_loss_reference
            if self.cfg.ratio_guard == "reference"
            else algos.ppo_clip_loss
        )
        pg, ratio = clip_loss(logp, b.old_logprobs, b.advantages, self.cfg.clip)
        vloss = algos.value_loss(out.values.float(), b.old_values, b.returns, self.cfg.value_clip)
        value_coef = 0.0 if self.grouped else self.cfg.value_coef  # grpo: no critic to train
        with torch.no_grad():
            stats = {
                "losses/policy": pg.item(),
                "losses/value": vloss.item(),
                "approx_kl": algos.approx_kl(logp, b.old_logprobs).item(),
                "clipfrac": algos.clip_fraction(ratio, self.cfg.clip).item(),
                "entropy": algos.masked_mean(out.entropy[:, :length], valid).item(),
            }
        loss = pg + value_coef * vloss if value_coef else pg
        if self.algorithm == "gtr_turbo_kl" and self.turbo.kl_into == "thought_loss":
            cut = np.ix_(b.idx, np.arange(length))
            t_lp = torch.as_tensor(self._teacher_lp[cut]).to(self.device)
            scored = torch.as_tensor(self._teacher_valid[cut]).to(self.device)
            mask, clip = b.thought_mask * valid * scored, self.turbo.kl_clip
            kl_loss = self.turbo.kl_coef * algos.thought_kl_loss(lp, t_lp, mask, clip)
            # Its own gradient (the graph kept for PPO's backward): its norm and share recorded.
            self._accumulate_apart(kl_loss / self.cfg.grad_accum, retain=True)
            kl = algos.thought_kl_penalty(lp.detach(), t_lp, mask, clip).mean()  # its value
            stats["losses/kl"] = kl.item()
        return loss, stats

    def sft_loss(self, examples: list[SftExample]) -> tuple[Tensor, dict[str, float]]:
        """Thought-SFT CE toward corrected outputs (the action value masked out)."""
        encoded = [self.encode_target(ex) for ex in examples]
        ids = [e[0] for e in encoded]
        images = [self.image(ex.image_sha) for ex in examples]
        out = self.policy.score(images, [ex.prompt for ex in examples], ids, with_grad=True)
        length = out.logprobs.shape[1]
        sft_mask = torch.zeros(len(ids), length, device=self.device)
        for row, (_, m) in enumerate(encoded):
            sft_mask[row, : len(m)] = torch.as_tensor(m[:length], dtype=torch.float32)
        loss = algos.thought_sft_loss(out.logprobs, sft_mask * out.mask.float())
        return loss, {"losses/sft": loss.item()}

    def optimizer_step(self) -> dict[str, float]:
        """Average gradients across processes, clip, step; returns the pre-clip grad norms."""
        apart, self._apart = self._apart, None
        if self.accelerator is not None and self.accelerator.num_processes > 1:
            for p in self.params:
                if p.grad is not None:
                    p.grad = self.accelerator.reduce(p.grad, reduction="mean")
            if apart is not None:
                apart = [
                    None if g is None else self.accelerator.reduce(g, reduction="mean")
                    for g in apart
                ]
        term = guidance_term(self.algorithm, self.turbo) or "sft"
        per_loss = self.cfg.clip_per_loss and term == "sft"  # clip_per_loss splits SFT only
        norms = step_gradients(self.params, apart, self.cfg.max_grad_norm, per_loss, term)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norms

    # ---- the loop ----------------------------------------------------------------------------

    def update(
        self,
        rollout: Rollout,
        buffer: DaggerBuffer | None = None,
        judged_correct: np.ndarray | None = None,
    ) -> dict[str, float]:
        """One PPO update (ppo_epochs × minibatches, grad accumulation); returns its metrics."""
        use_ppo = self.algorithm in PPO_ALGORITHMS
        use_sft = self.algorithm in SFT_ALGORITHMS and buffer is not None and len(buffer) > 0
        self._extra = {}
        adv, ret = self.compute_advantages(rollout, judged_correct)
        sft_coef = self.sft_weight()
        # SFT draws per update: num_envs × num_steps an epoch whatever the rollout's length (gtr
        # pairs one with each PPO sample; gtr_grpo's whole episodes are shorter or longer).
        trained = rollout.size if self.trained is None else int(self.trained.sum())
        draws_per_sample, drawn = self.cfg.num_envs * self.cfg.num_steps / max(trained, 1), 0
        lr = self.optimizer.param_groups[0]["lr"]
        stats: dict[str, list[float]] = {}
        micro = 0
        for _ in range(self.cfg.ppo_epochs):
            for batch in self.minibatches(rollout, adv, ret):
                loss = torch.zeros((), device=self.device)
                if use_ppo:
                    ppo, s = self.ppo_loss(rollout, batch)
                    loss, stats = loss + ppo, _append(stats, s)
                n_draws = round(len(batch.idx) * draws_per_sample)
                examples, scale = self.draw_sft(buffer, n_draws) if use_sft else ([], 0.0)
                drawn += n_draws if use_sft else 0
                if examples:
                    sft, s = self.sft_loss(examples)
                    stats = _append(stats, s)
                    weight = sft_coef * scale
                    if use_ppo:  # its own gradient: its norm and share of the step recorded
                        self._accumulate_apart(weight * sft / self.cfg.grad_accum)
                    else:
                        loss = loss + weight * sft
                if loss.requires_grad:
                    self._backward(loss / self.cfg.grad_accum)
                micro += 1
                if micro % self.cfg.grad_accum == 0:
                    stats = _append(stats, self.optimizer_step())
        if micro % self.cfg.grad_accum:
            stats = _append(stats, self.optimizer_step())
        self.scheduler.step()
        self.update_idx += 1
        metrics = {k: float(np.mean(v)) for k, v in stats.items()}
        term = guidance_term(self.algorithm, self.turbo)
        if use_sft and not use_ppo and "grad_norm" in metrics:  # sft_only: the step is all SFT
            metrics |= {SFT_NORM: metrics["grad_norm"], SFT_SHARE: 1.0}
        elif term and f"{term}/grad_share" not in metrics:  # nothing to imitate yet: no guidance
            metrics |= {f"{term}/grad_norm": 0.0, f"{term}/grad_share": 0.0}
        returns_t, values_t = ret.cpu(), torch.as_tensor(rollout.values, dtype=torch.float32)
        metrics |= {
            "lr": lr,
            "sft_coef": sft_coef if use_sft else 0.0,
            **self.reward_terms,
            "explained_variance": _finite(algos.explained_variance(values_t, returns_t).item()),
            "sft_samples": float(len(buffer) if use_sft and buffer is not None else 0),
            "sft_draws": float(drawn),
            "returns_mean": float(returns_t.mean()),
            **self._extra,
        }
        return metrics

    def sft_weight(self) -> float:
        """The SFT weight of the coming update: sft_coef, or its cosine annealing (ablation)."""
        if self.cfg.sft_schedule == "cosine":
            return algos.cosine_weight(self.cfg.sft_coef, self.update_idx + 1, self.cfg.num_updates)
        return self.cfg.sft_coef

    def draw_sft(self, buffer: Any, n: int) -> tuple[list[SftExample], float]:
        """SFT examples for a minibatch of n PPO samples, and the SFT term's scale.

        labelled: n corrections, scale 1. reference: n draws over every recorded step, only the
        labelled ones kept, scale k/n (the SFT gradient of GTR's per-sample loop)."""
        if self.cfg.dagger == "reference":
            examples = buffer.sample_reference(n, self.rng)
            return examples, algos.dagger_sft_scale(len(examples), n)
        return buffer.sample(n, self.rng), 1.0

    # ---- helpers -----------------------------------------------------------------------------

    def encode_target(self, ex: SftExample) -> tuple[list[int], list[int]]:
        """Token ids of an SFT target and its 0/1 supervision mask (0 = overlaps the action)."""
        if ex.correction_id not in self._targets:
            self._targets[ex.correction_id] = encode_target(self.policy, ex.target, ex.masked_span)
        return self._targets[ex.correction_id]

    def _accumulate_apart(self, loss: Tensor, retain: bool = False) -> None:
        """Backward of the guidance term (SFT or KL) into its own buffer, added to the step at
        the optimiser step (clipped apart there under clip_per_loss)."""
        grads = torch.autograd.grad(loss, self.params, allow_unused=True, retain_graph=retain)
        if self._apart is None:
            self._apart = list(grads)
        else:
            self._apart = [
                g if a is None else a if g is None else a + g
                for a, g in zip(self._apart, grads, strict=True)
            ]

    def _backward(self, loss: Tensor) -> None:
        if self.accelerator is not None:
            self.accelerator.backward(loss)
        else:
            loss.backward()

    def _rank_world(self) -> tuple[int, int]:
        if self.accelerator is None:
            return 0, 1
        return self.accelerator.process_index, self.accelerator.num_processes


def group_advantages(
    rollout: Rollout, cfg: TrainConfig
) -> tuple[Tensor, Tensor, np.ndarray, dict[str, float]]:
    """grpo: (Â, episode returns) per step (N,), the steps in grouped episodes (N,) bool, and
    the group statistics."""
    t, e = rollout.num_steps, rollout.num_envs
    as_te = lambda x: torch.as_tensor(np.asarray(x, dtype=np.float32)).reshape(t, e)  # noqa: E731
    # The bonus joins the reward of its step, so it counts once in the trajectory return.
    rewards = as_te(rollout.rewards) + cfg.format_reward * as_te(rollout.format_valid)
    dones = as_te(rollout.dones)
    first_only = cfg.grpo_rollout == "episodes"
    adv, stats = algos.grpo_advantages(
        rewards, dones, cfg.group_size, cfg.group_eps, cfg.group_std, first_only=first_only
    )
    ret, ordinal, complete = algos.episode_returns(rewards, dones)
    grouped = (complete & (ordinal == 0)) if first_only else complete
    keep = grouped.reshape(-1).numpy() if bool(grouped.any()) else np.ones(rollout.size, bool)
    stats["grpo/trained_steps"] = float(keep.sum())
    return adv.reshape(-1), ret.reshape(-1), keep, stats


def teacher_scores(
    teacher: Policy,
    rollout: Rollout,
    image: Callable[[str], Any],
    mb: int,
    temperature: float,
    turbo: TeacherConfig,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The teacher's reading of the agent's outputs: each step's thought-token KL penalty (N,),
    the teacher's token log-probs and where it scored (both (N, L), 0 where it did not)."""
    out = np.zeros(rollout.size, dtype=np.float32)
    t_all = np.zeros(rollout.response_ids.shape, dtype=np.float32)
    v_all = np.zeros(rollout.response_ids.shape, dtype=np.float32)
    for start in range(0, rollout.size, mb):
        idx = np.arange(start, min(start + mb, rollout.size))
        ids = [rollout.response_ids[i, : rollout.response_lengths[i]].tolist() for i in idx]
        length = max(1, max(len(x) for x in ids))
        cut = np.ix_(idx, np.arange(length))
        images = [image(rollout.image_shas[i]) for i in idx]
        prompts = [str(rollout.prompts[i]) for i in idx]
        scores = teacher.score(images, prompts, ids, temperature=temperature)
        t_lp = scores.logprobs[:, :length].float().cpu()
        valid = scores.mask[:, :length].cpu()
        mask = torch.as_tensor(rollout.thought_mask[cut]).float() * valid
        a_lp = torch.as_tensor(rollout.old_logprobs[cut]).float()
        out[idx] = algos.thought_kl_penalty(a_lp, t_lp, mask, turbo.kl_clip).numpy()
        t_all[cut], v_all[cut] = (t_lp * valid).numpy(), valid.float().numpy()
    return out, t_all, v_all


def encode_target(
    policy: Policy, text: str, masked_span: tuple[int, int] | None
) -> tuple[list[int], list[int]]:
    """Tokenise a target (+EOS); mask (0) every token whose characters overlap masked_span."""
    from services.policy.spans import first_token_past

    ids = policy.encode_response(text)
    if masked_span is None:
        return ids, [1] * len(ids)
    lo, hi = masked_span
    # Tokens a..b overlap [lo, hi): a is the first to end after lo, b the first to reach hi.
    # EOS adds no characters, so it is never one of them and stays supervised.
    a = first_token_past(policy.tokenizer, ids, lo)
    b = first_token_past(policy.tokenizer, ids, hi - 1)
    return ids, [0 if a <= k <= b else 1 for k in range(len(ids))]


def clip_tensors(grads: list[Tensor | None], max_norm: float) -> Tensor:
    """Scale a list of gradient tensors in place to a total L2 norm; returns the norm before."""
    present = [g for g in grads if g is not None]
    if not present:
        return torch.zeros(())
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in present]))
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in present:
        g.mul_(scale)
    return norm


SFT_NORM = "sft/grad_norm"  # the thought-SFT term's gradient norm, before any clipping
SFT_SHARE = "sft/grad_share"  # its part of the applied step (docs/training.md)
KL_NORM = "kl/grad_norm"  # gtr_turbo_kl: the KL-to-teacher term's, the same way
KL_SHARE = "kl/grad_share"


def guidance_term(algorithm: str, turbo: TeacherConfig) -> str | None:
    """The arm's guidance term whose gradient is kept apart and measured: "sft" (a thought-SFT
    term), "kl" (gtr_turbo_kl's KL to the teacher as a loss on the thought tokens), or None
    (none; under teacher.kl_into = "return" the KL only moves the returns, so has no gradient)."""
    if algorithm in SFT_ALGORITHMS:
        return "sft"
    thought_kl = turbo.kl_into == "thought_loss" and turbo.kl_coef > 0
    return "kl" if algorithm == "gtr_turbo_kl" and thought_kl else None


def step_gradients(
    params: list[torch.nn.Parameter],
    sft_grads: list[Tensor | None] | None,
    max_norm: float,
    per_loss: bool,
    term: str = "sft",
) -> dict[str, float]:
    """Clip the accumulated gradients (``p.grad``: PPO and value) and the guidance term's (kept
    apart: the thought SFT's, or the KL to the teacher's with ``term = "kl"``) into the step the
    optimiser applies; returns the norms before clipping and the guidance term's share of the
    step (``{term}/grad_share``): its norm in the step over the sum of both parts' norms.
    per_loss: each part clipped to ``max_norm`` on its own, then summed (the SFT term keeps its
    size however large the PPO gradient is); else the sum is clipped as one, the reference's
    single clip, under which a PPO gradient of norm 10 leaves an SFT one of 0.5 a 5 % share."""
    if sft_grads is None:
        return {"grad_norm": float(torch.nn.utils.clip_grad_norm_(params, max_norm))}
    if per_loss:
        rest = float(torch.nn.utils.clip_grad_norm_(params, max_norm))  # PPO part, on its own
        sft = float(clip_tensors(sft_grads, max_norm))
        part, other = min(sft, max_norm), min(rest, max_norm)
    else:
        rest = float(_norm([p.grad for p in params]))
        sft = part = float(_norm(sft_grads))
        other = rest
    for p, g in zip(params, sft_grads, strict=True):
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g
    norms = {f"{term}/grad_norm": sft, f"{term}/grad_share": part / max(part + other, 1e-12)}
    if per_loss:
        return norms | {"grad_norm": rest, f"grad_norm/{term}": sft}
    return norms | {"grad_norm": float(torch.nn.utils.clip_grad_norm_(params, max_norm))}


def _norm(grads: list[Tensor | None]) -> Tensor:
    present = [g for g in grads if g is not None]
    if not present:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in present]))


def unique_trainable(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Each parameter once, only those that require grad: what an optimiser gets."""
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            out.append(p)
    return out


def _append(stats: dict[str, list[float]], new: dict[str, float]) -> dict[str, list[float]]:
    for k, v in new.items():
        stats.setdefault(k, []).append(v)
    return stats


def _finite(x: float) -> float:
    return x if math.isfinite(x) else 0.0
