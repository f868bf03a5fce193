"""Wire types shared by every service: the run config and the corrector protocol.

A run config is typed, documented field by field, loaded from TOML, validated at the API
(a clear 422 naming the field) and stored with the run.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Task = Literal["numberline", "ezpoints", "points24", "blackjack", "alfworld"]
Algorithm = Literal["gtr", "rl4vlm", "sft_only"]
TASKS: tuple[str, ...] = ("numberline", "ezpoints", "points24", "blackjack", "alfworld")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EnvConfig(_Strict):
    image_size: int = Field(300, ge=32, le=1024, description="Rendered observation side in pixels")
    max_episode_steps: int | None = Field(
        None, ge=1, le=1000, description="Truncation; None = the task's own"
    )
    invalid_action: Literal["random", "noop"] = Field(
        "random",
        description="Unparseable output: random legal action (reference) or a penalised no-op",
    )
    early_truncation: bool = Field(
        False, description="Points24/EZPoints: stop once the formula can no longer reach the target"
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Task-specific options (e.g. ALFWorld games folder)"
    )
    display_size: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="Side of the frame drawn for people beside the model's input; None = 320 on "
        "a run's recorded steps and none elsewhere; 0 or not above image_size = none",
    )


class ModelConfig(_Strict):
    path: str | None = Field(
        None,
        max_length=1000,
        description="Local HF image-text-to-text checkpoint; None = build a tiny model",
    )
    tiny_arch: Literal["llava", "qwen2_vl", "idefics3"] = Field(
        "llava", description="Architecture of the tiny model"
    )
    tiny_size: Literal["1m", "10m", "50m"] = Field(
        "1m", description="Size preset of the tiny model"
    )
    image_size: int = Field(
        64, ge=16, le=1024, description="Side of the image the vision tower sees (tiny models)"
    )
    finetune: Literal["lora", "full"] = Field(
        "lora", description="LoRA on the language model, or full fine-tuning"
    )
    lora_r: int = Field(16, ge=1, le=512, description="LoRA rank")
    lora_alpha: int = Field(32, ge=1, le=1024, description="LoRA alpha")
    lora_dropout: float = Field(0.0, ge=0, le=0.9, description="LoRA dropout")
    lora_target_modules: str = Field(
        r".*(language_model|text_model).*\.(q_proj|k_proj|v_proj|o_proj)",
        max_length=500,
        description="Regex of the LM modules LoRA adapts (never the vision tower)",
    )
    backend: Literal["hf", "vllm"] = Field("hf", description="Generation backend; vllm needs a GPU")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="auto = fp32 on CPU, bf16 on GPU"
    )


class GenerationConfig(_Strict):
    temperature: float = Field(
        1.0, gt=0, le=5, description="Sampling temperature (paper: 0.2 for a 7B model)"
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass")
    max_new_tokens: int = Field(64, ge=1, le=2048, description="Generation cap per step")
    repetition_penalty: float = Field(1.0, ge=1, le=3, description="GTR uses 1.2 on a 7B model")


class InitConfig(_Strict):
    kind: Literal["warm_start", "checkpoint", "none"] = Field(
        "warm_start", description="How the policy starts before RL"
    )
    checkpoint: str | None = Field(
        None, max_length=1000, description="Checkpoint folder when kind = checkpoint"
    )
    vision_steps: int = Field(
        400,
        ge=0,
        le=100_000,
        description="Vision warm-up steps: aux heads read the state from pixels",
    )
    sft_samples: int = Field(
        300, ge=1, le=1_000_000, description="Oracle steps in the warm-start data set"
    )
    sft_steps: int = Field(
        300,
        ge=0,
        le=1_000_000,
        description="SFT optimiser steps (short on purpose: leave room for RL)",
    )
    lr: float = Field(1e-3, gt=0, le=1, description="Warm-start learning rate")
    batch_size: int = Field(16, ge=1, le=1024, description="Warm-start batch size")


class TrainConfig(_Strict):
    num_envs: int = Field(16, ge=1, le=256, description="Parallel env sessions")
    num_steps: int = Field(
        8, ge=1, le=4096, description="Steps per env per update (rollout = num_envs x num_steps)"
    )
    num_updates: int = Field(
        20,
        ge=1,
        le=100_000,
        description="PPO updates; env-step budget = num_envs x num_steps x num_updates",
    )
    ppo_epochs: int = Field(2, ge=1, le=64, description="Passes over each rollout")
    minibatch_size: int = Field(32, ge=1, le=4096, description="Samples per optimiser micro-step")
    grad_accum: int = Field(1, ge=1, le=1024, description="Micro-steps per optimiser step")
    lr: float = Field(1e-3, gt=0, le=1, description="Peak learning rate (LoRA + value head)")
    lr_min: float = Field(1e-5, ge=0, le=1, description="Cosine schedule floor")
    lr_schedule: Literal["cosine", "constant"] = Field(
        "cosine", description="One scheduler step per update"
    )
    gamma: float = Field(0.9, ge=0, le=1, description="Discount (paper 0.9)")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda (paper 0.95)")
    clip: float = Field(0.2, gt=0, le=1, description="PPO ratio clip (paper 0.1)")
    value_clip: float = Field(0.2, gt=0, le=10, description="Value-loss clip")
    value_coef: float = Field(0.5, ge=0, le=10, description="Value-loss weight")
    max_grad_norm: float = Field(
        1.0, gt=0, le=100, description="Gradient clipping (paper 0.01 at 7B)"
    )
    thought_coef: float = Field(
        0.5, ge=0, le=1, description="lambda: log pi = lambda * sum thought logp + sum action logp"
    )
    format_reward: float = Field(
        0.0,
        ge=0,
        le=100,
        description="Bonus added to the returns of well-formed steps (reference: 5)",
    )
    sft_coef: float = Field(1.0, ge=0, le=100, description="Thought-SFT loss weight (GTR 1:1)")
    clip_per_loss: bool = Field(
        False,
        description="Clip the PPO+value and the SFT gradients each to max_grad_norm, then sum: "
        "a large PPO gradient can no longer shrink the SFT term",
    )
    value_lr: float | None = Field(
        None, gt=0, le=1, description="Learning rate of the value head; None = lr"
    )
    dagger_sampling: Literal["uniform", "recency"] = Field(
        "uniform", description="How the DAgger buffer is sampled"
    )
    adam_eps: float = Field(1e-7, gt=0, le=1, description="Adam epsilon")
    checkpoint_every: int = Field(
        1, ge=1, le=10_000, description="Save a checkpoint every N updates"
    )


class CorrectorConfig(_Strict):
    name: str = Field(
        "oracle", min_length=1, max_length=100, description="A registered corrector, or 'oracle'"
    )
    noise: float = Field(
        0.0, ge=0, le=1, description="Oracle only: rate of deliberately wrong corrections"
    )
    wait: Literal["none", "update", "step"] = Field(
        "none",
        description="none: corrections join the buffer when ready; update: wait before each "
        "update; step: wait after every step (the reference's synchronous loop, to compare)",
    )
    wait_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="Longest wait for a rollout's corrections"
    )
    max_calls: int | None = Field(
        None, ge=0, le=10_000_000, description="Per-run budget of corrector calls"
    )
    max_tokens: int | None = Field(
        None, ge=0, le=10_000_000_000, description="Per-run budget of corrector tokens"
    )


class MetricsConfig(_Strict):
    probe_states: int = Field(
        60,
        ge=0,
        le=2000,
        description="Fixed probe set decoded greedily each update (collapse monitor)",
    )
    min_relevance: float = Field(
        0.3,
        ge=0,
        le=1,
        description="Relevance a run must reach before a drop counts (and, with "
        "alarm_warmup_updates, the floor after the warm-up)",
    )
    relevance_drop: float = Field(
        0.5, ge=0, le=1, description="Alarm when probe relevance falls this share under the best"
    )
    alarm_warmup_updates: int = Field(
        0,
        ge=0,
        le=100_000,
        description="Alarm when relevance is still below min_relevance after this many updates; "
        "0 = never (an agent that has not learnt to read yet has not collapsed)",
    )
    max_top_thought_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Alarm when one thought's probe share s exceeds s0 + this x (1 - s0), "
        "s0 = the share thoughts that track the probe states perfectly would have",
    )
    success_window: int = Field(
        200, ge=1, le=100_000, description="Running success rate over the last N episodes"
    )
    eval_episodes: int = Field(
        0, ge=0, le=1000, description="Greedy held-out episodes per evaluation; 0 = no evaluation"
    )
    eval_every: int = Field(
        5, ge=1, le=100_000, description="Evaluate after every N-th update (and the last one)"
    )


class RunConfig(_Strict):
    name: str = Field("run", min_length=1, max_length=200, description="Human name of the run")
    task: Task = Field(description="numberline | ezpoints | points24 | blackjack | alfworld")
    algorithm: Algorithm = Field(
        "gtr", description="gtr = PPO + thought SFT; rl4vlm = PPO only; sft_only = thought SFT only"
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seeds envs, sampling and init")
    env: EnvConfig = Field(default_factory=EnvConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    init: InitConfig = Field(default_factory=InitConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    corrector: CorrectorConfig = Field(default_factory=CorrectorConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.init.kind == "checkpoint" and not self.init.checkpoint:
            raise ValueError("init.checkpoint is required when init.kind = 'checkpoint'")
        if self.total_env_steps > 50_000_000:
            raise ValueError(
                "train: num_envs x num_steps x num_updates exceeds 50,000,000 env steps"
            )
        return self

    @property
    def total_env_steps(self) -> int:
        return self.train.num_envs * self.train.num_steps * self.train.num_updates

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        """Read a TOML config; its paths are relative to the file (shared/config_paths.py)."""
        from shared.config_paths import resolve_config_paths

        with open(path, "rb") as f:
            raw = tomllib.load(f)
        return cls.model_validate(resolve_config_paths(raw, Path(path).resolve().parent))


# ---- corrector protocol (POST /v1/correct) -------------------------------------------------


class CorrectionRequest(BaseModel):
    task: Task
    image_png_b64: str | None = Field(
        None, max_length=20_000_000, description="Observation, PNG, base64"
    )
    prompt: str = Field(max_length=100_000, description="The prompt the agent saw")
    output: str = Field(
        max_length=100_000, description="The agent's full output (JSON with thoughts and action)"
    )
    state: dict[str, Any] | None = Field(
        None, description="Privileged env state (cards, numbers, target ...)"
    )
    history: list[str] = Field(
        default_factory=list, max_length=200, description="Previous actions, oldest first"
    )


class Correction(BaseModel):
    verdict: Literal["correct", "incorrect"]
    corrected_thought: str | None = Field(
        None,
        max_length=20_000,
        description="The corrected output JSON minus the action; None when correct",
    )
    extras: dict[str, Any] = Field(
        default_factory=dict, description="Task extras, e.g. target_formula"
    )
    reasoning: str = Field("", max_length=50_000)
    tokens: int = Field(0, ge=0)
    latency_ms: float = Field(0.0, ge=0)
