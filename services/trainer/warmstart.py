"""The ``init`` stage: a short warm start so RL begins from a policy that speaks the format.

Measured in tiny-numberline.md: a random tiny vision tower never learns to read the digits through
the language loss alone. So (a) a vision warm-up first trains the vision tower + projector with
small auxiliary linear heads that predict the privileged state (NumberLine current/target, the
cards and formula slots of the points games) from the projector output; then (b) a short SFT on
oracle outputs (everything supervised: thought, action and EOS).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from services.trainer import algos
from services.trainer.service import unique_trainable
from shared.phase import warm_progress
from shared.schemas import EnvConfig, EvalProtocol, InitConfig, ModelConfig, RunConfig

if TYPE_CHECKING:
    from services.policy.service import Policy

log = logging.getLogger(__name__)

EPSILON = 0.2  # share of random actions in the oracle episodes, so off-path states appear too
MAX_FORMULA_SLOTS = 12


@dataclass
class OracleSample:
    image: np.ndarray  # (S, S, 3) uint8 observation
    prompt: str  # the agent-visible text
    state: dict[str, Any]  # privileged state
    text: str  # the expert's canonical output


def oracle_samples(task: str, env_cfg: EnvConfig, n: int, seed: int) -> list[OracleSample]:
    """n states from expert episodes with EPSILON random actions, with the expert's outputs."""
    from services.env.expert import expert_output, format_output
    from services.env.registry import make_env

    env = make_env(task, env_cfg, seed=seed)
    u: Any = env.unwrapped
    rng = np.random.default_rng(seed)
    obs, _ = env.reset()
    out: list[OracleSample] = []
    while len(out) < n:
        state = u.state()
        expert = expert_output(task, state)
        out.append(OracleSample(obs, u.prompt(), state, format_output(expert)))
        action = u.action_names.index(expert["action"])
        if rng.random() < EPSILON:
            action = int(rng.integers(len(u.action_names)))
        obs, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            obs, _ = env.reset()
    return out


def aux_slots(task: str, state: dict[str, Any]) -> list[Hashable]:
    """The visible state as a fixed list of categorical slots for the auxiliary heads."""
    if task == "numberline":
        return [state["current"], state["target"]]
    if task in ("ezpoints", "points24"):
        formula = [t for t in state["formula"] if t.strip()][:MAX_FORMULA_SLOTS]
        return [*state["numbers"], *formula, *[""] * (MAX_FORMULA_SLOTS - len(formula))]
    if task == "blackjack":
        return [state["player_total"], state["dealer_showing"], bool(state["usable_ace"])]
    if task == "alfworld":
        # What the schematic image shows: the receptacle in front and the object held.
        return [state.get("front") or "", state.get("holding") or ""]
    raise ValueError(f"no vision warm-up targets for task {task!r}")


class AuxHeads(nn.Module):
    """One linear classifier per slot on the flattened projector output (B, N·d)."""

    def __init__(self, in_dim: int, vocab_sizes: Sequence[int]) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(in_dim, k) for k in vocab_sizes)

    def loss(self, feats: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean over slots of the cross-entropy; feats (B, N, d), targets (B, slots)."""
        flat = feats.reshape(feats.shape[0], -1).float()
        losses = [
            nn.functional.cross_entropy(head(flat), targets[:, k])
            for k, head in enumerate(self.heads)
        ]
        return torch.stack(losses).mean()


def encode_slots(samples: Sequence[OracleSample], task: str) -> tuple[torch.Tensor, list[int]]:
    """Class ids (n, slots) and per-slot vocabulary sizes; constant slots are dropped."""
    rows = [aux_slots(task, s.state) for s in samples]
    cols = [sorted({r[k] for r in rows}, key=str) for k in range(len(rows[0]))]
    keep = [k for k, c in enumerate(cols) if len(c) > 1]
    index = [{v: i for i, v in enumerate(cols[k])} for k in keep]
    ids = [[index[j][r[k]] for j, k in enumerate(keep)] for r in rows]
    return torch.tensor(ids, dtype=torch.long), [len(cols[k]) for k in keep]


WARM_CHUNK = 10  # steps between progress reports (and cancel checks) of a warm start


def _tick(step: int, steps: int, stage: int) -> None:
    """Every WARM_CHUNK steps: report to the run's hook (shared/phase.py), which may cancel.
    Stage 0 is the vision warm-up, 1 the SFT; k of n counts both, as planned."""
    hook = warm_progress.get()
    if hook is not None and (step % WARM_CHUNK == 0 or step == steps):
        plan = _warm_plan.get()
        hook(step + (plan[0] if stage else 0), sum(plan) or steps)


_warm_plan: ContextVar[tuple[int, int]] = ContextVar("warm_plan", default=(0, 0))


def vision_warmup(
    policy: Policy,
    samples: Sequence[OracleSample],
    task: str,
    steps: int,
    seed: int,
    batch_size: int = 32,
    lr: float = 1e-3,
    target_loss: float = 0.05,
) -> dict[str, float]:
    """Train vision tower + projector with aux heads until the loss is ≈0 or `steps` ran out."""
    if steps <= 0:
        return {"vision/steps": 0.0}
    targets, vocab = encode_slots(samples, task)
    if not vocab:
        return {"vision/steps": 0.0}
    vision = policy.vision_parameters()
    for p in vision:
        p.requires_grad_(True)
    with torch.no_grad():
        probe = policy.image_features([samples[0].image])
    heads = AuxHeads(probe[0].numel(), vocab).to(probe.device)
    opt = torch.optim.AdamW([*vision, *heads.parameters()], lr=lr)
    rng = np.random.default_rng(seed)
    loss_ema, step = math.inf, 0
    for step in range(1, steps + 1):
        idx = rng.choice(len(samples), size=min(batch_size, len(samples)), replace=False)
        feats = policy.image_features([samples[i].image for i in idx])
        loss = heads.loss(feats, targets[idx].to(feats.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_ema = loss.item() if step == 1 else 0.9 * loss_ema + 0.1 * loss.item()
        if loss_ema < target_loss:
            break
        _tick(step, steps, 0)
    return {"vision/steps": float(step), "vision/loss": float(loss_ema)}


def sft_warmup(
    policy: Policy,
    samples: Sequence[OracleSample],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    warmup_steps: int = 20,
    max_grad_norm: float = 1.0,
) -> dict[str, float]:
    """Supervised fine-tuning on the expert outputs, every output token (and EOS) supervised."""
    if steps <= 0:
        return {"sft/steps": 0.0}
    params = unique_trainable([*policy.trainable_parameters(), *policy.vision_parameters()])
    opt = torch.optim.AdamW(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup_steps))
    rng = np.random.default_rng(seed + 1)
    ids = [policy.encode_response(s.text) for s in samples]
    loss_ema = math.inf
    for step in range(steps):
        idx = rng.choice(len(samples), size=min(batch_size, len(samples)), replace=False)
        out = policy.score(
            [samples[i].image for i in idx],
            [samples[i].prompt for i in idx],
            [ids[i] for i in idx],
            with_grad=True,
        )
        loss = algos.thought_sft_loss(out.logprobs, out.mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        sched.step()
        loss_ema = loss.item() if step == 0 else 0.95 * loss_ema + 0.05 * loss.item()
        _tick(step + 1, steps, 1)
    return {"sft/steps": float(steps), "sft/loss": float(loss_ema)}


def greedy_eval(
    policy: Policy,
    task: str,
    env_cfg: EnvConfig,
    episodes: int,
    seed: int,
    max_new_tokens: int = 64,
) -> dict[str, float]:
    """Greedy play of `episodes` episodes in parallel: success rate, reading and JSON validity.
    The deals are a run's evaluation deals (``shared/seeds.py``), which no training env and no
    warm-start data reaches; ``seed`` is the run's, kept for callers (the deals do not vary
    with it, as a run's evaluation deals do not)."""
    from services.env.expert import thought_matches_state
    from services.env.registry import make_env
    from shared.seeds import eval_seed

    envs: list[Any] = [make_env(task, env_cfg, seed=eval_seed(i)) for i in range(episodes)]
    obs = [env.reset()[0] for env in envs]
    returns, active = [0.0] * episodes, list(range(episodes))
    reads, valid = [], []
    while active:
        u = [envs[i].unwrapped for i in active]
        gens = policy.generate(
            [obs[i] for i in active],
            [x.prompt() for x in u],
            greedy=True,
            max_new_tokens=max_new_tokens,
        )
        still = []
        for i, x, gen in zip(active, u, gens, strict=True):
            parsed = x.parse(gen.text)
            reads.append(parsed.format_valid and thought_matches_state(task, gen.text, x.state()))
            valid.append(parsed.format_valid)
            step = envs[i].step(parsed.action) if parsed.action is not None else x.noop()
            obs[i], returns[i] = step[0], returns[i] + float(step[1])
            if not (step[2] or step[3]):
                still.append(i)
        active = still
    return {
        "eval/success": float(np.mean([r > 0 for r in returns])),
        "eval/read": float(np.mean(reads)),
        "eval/json": float(np.mean(valid)),
    }


def warm_start(
    policy: Policy,
    task: str,
    env_cfg: EnvConfig,
    init: InitConfig,
    seed: int,
    eval_episodes: int = 0,
    rules: EvalProtocol | None = None,
) -> dict[str, float]:
    """Vision warm-up, then SFT on oracle outputs; returns the stage metrics. ``eval_episodes``
    greedy episodes after it, under ``rules`` (the run's evaluation protocol, else env_cfg)."""
    samples = oracle_samples(task, env_cfg, init.sft_samples, seed)
    _warm_plan.set((init.vision_steps, init.sft_steps))
    summary = vision_warmup(policy, samples, task, init.vision_steps, seed)
    summary |= sft_warmup(policy, samples, init.sft_steps, init.batch_size, init.lr, seed)
    if eval_episodes:
        rules = rules or EvalProtocol(env=env_cfg, max_new_tokens=64)
        summary |= greedy_eval(
            policy, task, rules.env, eval_episodes, seed, max_new_tokens=rules.max_new_tokens
        )
    log.info("warm start %s: %s", task, summary)
    return summary


def base_model_path(model: ModelConfig, task: str | None = None) -> Path:
    """The run's base checkpoint: model.path, or the tiny model of its preset (built once)."""
    if model.path:
        return Path(model.path)
    from shared.settings import get_settings

    # The default tokenizer knows only the card games' words: ALFWorld text would cost a token
    # a character (900-token prompts), so ALFWorld's tiny model gets a tokenizer of its own.
    own = task == "alfworld"
    name = f"tiny-{model.tiny_arch}-{model.tiny_size}-{model.image_size}{'-alfworld' * own}"
    path = get_settings().models_path / name
    if not (path / "config.json").exists():
        from services.policy.tiny import build_tiny

        corpus = None
        if own:
            from services.env.alfworld.corpus import corpus as alfworld_corpus

            corpus = list(alfworld_corpus())
        build_tiny(
            path,
            arch=model.tiny_arch,
            size=model.tiny_size,
            image_size=model.image_size,
            corpus=corpus,
        )
    return path


def init_policy(
    cfg: RunConfig, base_dir: Path, eval_episodes: int = 0
) -> tuple[Any, dict[str, float]]:
    """The run's starting policy per ``cfg.init``: warm start, a given checkpoint, or none.

    Under LoRA the warm start fine-tunes the *whole* model (as the paper's SFT initialisation;
    LoRA alone barely moves a random tiny model) and saves it to ``base_dir`` as an HF folder:
    the LoRA policy for RL is built on top of it. With ``init.finetune = "lora"`` (a pretrained
    LM, whose prior a full fine-tuning at the warm start's rate would overwrite) it trains the
    run's LoRA and the vision tower + projector instead, and RL goes on from that policy.
    """
    from services.policy.checkpoint import read_checkpoint_meta
    from services.policy.service import Policy

    init, model = cfg.init, cfg.model
    given = Path(init.checkpoint) if init.kind == "checkpoint" and init.checkpoint else None
    if given is not None and not (given / "config.json").exists():
        # A policy checkpoint: its weights go onto the base model it was trained from.
        meta = read_checkpoint_meta(given)
        policy = Policy.from_config(model, Path(meta["base_model"]), seed=cfg.seed)
        # Another value-head kind than the checkpoint's: the run's head starts fresh (at 0).
        policy.load_weights(given, value_head=meta.get("value_head", "linear") == model.value_head)
        return policy, {}
    base = given or base_model_path(model, cfg.task)
    if init.kind != "warm_start":
        return Policy.from_config(model, base, seed=cfg.seed), {}
    from shared.evalrules import eval_rules
    from shared.warmenv import warm_env

    # It plays in the warm env; its evaluation follows the run's rules, as the run's own do.
    env, rules = warm_env(cfg.env), eval_rules(cfg)
    if lora_warm_start(cfg):
        # The run's own LoRA with the vision tower and projector; the base stays as it is.
        policy = Policy.from_config(model, base, seed=cfg.seed)
        summary = warm_start(policy, cfg.task, env, init, cfg.seed, eval_episodes, rules)
        for p in policy.vision_parameters():  # RL trains what the checkpoints reload: LoRA
            p.requires_grad_(False)
        return policy, summary
    full = model.model_copy(update={"finetune": "full"})
    policy = Policy.from_config(full, base, seed=cfg.seed)
    summary = warm_start(policy, cfg.task, env, init, cfg.seed, eval_episodes, rules)
    if model.finetune == "full":
        return policy, summary
    save_hf_model(policy, base_dir)
    return Policy.from_config(model, base_dir, seed=cfg.seed), summary


def lora_warm_start(cfg: RunConfig) -> bool:
    """The warm start trains the run's LoRA (+ vision tower and projector) on a base it leaves
    untouched (``init.finetune = "lora"`` under ``model.finetune = "lora"``)."""
    return cfg.model.finetune == "lora" and cfg.init.finetune == "lora"


def save_hf_model(policy: Policy, directory: Path) -> Path:
    """Write a fully fine-tuned policy's model as a plain HF folder (a new base model)."""
    directory.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(directory)
    policy.processor.save_pretrained(directory)
    policy.tokenizer.save_pretrained(directory)
    return directory
