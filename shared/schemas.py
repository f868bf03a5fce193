"""Wire types shared by every service: the run config and the corrector protocol.

A run config is typed, documented field by field, loaded from TOML, validated at the API
(a clear 422 naming the field) and stored with the run.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shared.payload import check_free_form, check_storable

Task = Literal["numberline", "ezpoints", "points24", "blackjack", "alfworld"]
Algorithm = Literal["gtr", "rl4vlm", "sft_only", "grpo", "gtr_grpo", "gtr_turbo_kl"]
# Algorithms whose advantage is group-relative (no value loss): envs run in groups of one deal.
GROUP_ALGORITHMS: tuple[str, ...] = ("grpo", "gtr_grpo")
# Algorithms that use no corrector (the controller queues no corrections for them).
NO_CORRECTOR_ALGORITHMS: tuple[str, ...] = ("rl4vlm", "grpo", "gtr_turbo_kl")
# Tasks whose k-th episode is the same deal in every session of one seed (the deal is the only
# use of the env's random stream), so groups of same-seed sessions are exact start-state groups.
GROUP_TASKS: tuple[str, ...] = ("numberline", "ezpoints", "points24")
TASKS: tuple[str, ...] = ("numberline", "ezpoints", "points24", "blackjack", "alfworld")
SELF_TEACHER = "self_teacher"  # the built-in corrector name of the merged-checkpoint teacher


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
    early_truncation: Literal["off", "reference", "solver"] = Field(
        "off",
        description="off (RL4VLM); reference: GTR's loop, an env reward of -1 ends the episode and "
        "(points games) so does a formula off the corrector's target formula; solver: ours, end "
        "once the solver says the formula can no longer reach the target (privileged)",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Task-specific options (e.g. ALFWorld games folder); at most 64 KiB of JSON",
    )
    display_size: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="Side of the frame drawn for people beside the model's input (from the step's "
        "state, when its page is viewed); None = 320 on "
        "a run's recorded steps and none elsewhere; 0 or not above image_size = none",
    )

    @field_validator("options")
    @classmethod
    def _storable_options(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_free_form(value, "env.options")

    @field_validator("early_truncation", mode="before")
    @classmethod
    def _truncation_bool(cls, value: Any) -> Any:
        # Configs stored before the reference rule existed said true for the solver rule.
        if isinstance(value, bool):
            return "solver" if value else "off"
        return value


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
        description="Regex of the LM modules LoRA adapts under lora_targets = attention",
    )
    lora_targets: Literal["attention", "all_linear", "all_linear+vision"] = Field(
        "attention",
        description="LoRA presets: the LM's q/k/v/o (lora_target_modules); every LM Linear; "
        "every Linear incl. vision tower + projector (the reference's --train-vision all)",
    )
    value_head: Literal["linear", "mlp", "mlp+image"] = Field(
        "linear",
        description="Value head on the last prompt token: one Linear; the reference's MLP "
        "d-1024-512-1; that MLP also reading the mean of the image tokens' hidden states",
    )
    backend: Literal["hf", "vllm"] = Field(
        "hf",
        description="Rollout sampling in a run's own process; vllm needs vllm and a GPU (a policy "
        "service samples with its own `gtr policy serve --backend`)",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="auto = fp32 on CPU; on a GPU mixed precision (bf16 autocast, trained "
        "weights fp32, a LoRA's frozen base bf16); bfloat16 = every weight bf16, no autocast",
    )


class GenerationConfig(_Strict):
    temperature: float = Field(
        1.0, gt=0, le=5, description="Sampling temperature (paper: 0.2 for a 7B model)"
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass")
    max_new_tokens: int = Field(64, ge=1, le=2048, description="Generation cap per step")
    repetition_penalty: float = Field(1.0, ge=1, le=3, description="GTR uses 1.2 on a 7B model")
    repetition_scope: Literal["generated", "all"] = Field(
        "generated",
        description="Tokens the repetition penalty counts: generated only (the reference) or "
        "prompt + generated (HF/vLLM built-in; pushes down the actions the prompt lists)",
    )


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
    finetune: Literal["full", "lora"] = Field(
        "full",
        description="Under model.finetune = lora, what the warm start trains: full = the whole "
        "model, saved as the run's base (a random tiny LM learns little through LoRA); lora = the "
        "run's LoRA with the vision tower and projector, the base untouched (a pretrained LM "
        "keeps its prior). Full fine-tuning runs warm-start full either way",
    )
    cache: bool = Field(
        True, description="Reuse a cached warm start of the same model, task, recipe and seed"
    )


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
    lr_schedule_updates: int | None = Field(
        None,
        ge=1,
        le=100_000,
        description="Cosine period T_max in updates (reference: 25, fixed); None = num_updates",
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
    dagger_sampling: Literal["uniform", "recency", "latest"] = Field(
        "uniform",
        description="How the DAgger buffer is sampled; latest = only the newest update's "
        "corrections (the paper's no-DAgger ablation)",
    )
    dagger: Literal["labelled", "reference"] = Field(
        "labelled",
        description="labelled: every PPO sample is paired with a correction; reference: the "
        "draw is over every recorded step and an uncorrected one adds no SFT (GTR's code)",
    )
    sft_target: Literal["thought", "output"] = Field(
        "thought",
        description="thought: clone the corrected thought with the agent's own action, action "
        "unsupervised (GTR); output: clone thought + the corrector's action (paper ablation)",
    )
    sft_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="SFT weight over the run: constant (GTR) or cosine-annealed from sft_coef "
        "to 0 over num_updates (paper ablation)",
    )
    ratio_guard: Literal["log_cap", "reference"] = Field(
        "log_cap",
        description="Far-off importance ratios: log-ratio capped at 20; reference: any ratio "
        "> 10 in the minibatch -> the clipped surrogate only (RL4VLM/GTR code)",
    )
    judge_reward: float = Field(
        0.0,
        ge=0,
        le=100,
        description="VLM-as-judge baseline: reward + this when the corrector's verdict is "
        "'correct' (needs corrector.wait = update or step)",
    )
    length_reward: float = Field(
        0.0,
        ge=0,
        le=100,
        description="Thought-length baseline: reward + this x thought tokens / max_new_tokens",
    )
    adam_eps: float = Field(1e-7, gt=0, le=1, description="Adam epsilon")
    checkpoint_every: int = Field(
        1, ge=1, le=10_000, description="Save a checkpoint every N updates"
    )
    group_size: int = Field(
        4,
        ge=2,
        le=256,
        description="grpo/gtr_grpo: G envs per group share each deal; num_envs must be a multiple",
    )
    group_std: bool = Field(
        True,
        description="grpo: divide (R - mean) by the group's std (GRPO); False = mean only "
        "(Dr. GRPO)",
    )
    group_eps: float = Field(
        1e-6, gt=0, le=1, description="grpo: epsilon in (R - mean) / (std + eps)"
    )
    grpo_rollout: Literal["episodes", "steps"] = Field(
        "episodes",
        description="grpo: episodes = every env plays one whole episode of its group's deal, "
        "num_steps its step cap (the rollout ends when all have ended); steps = num_steps steps, "
        "episodes cut at the end and later ones in smaller groups (before issue 40)",
    )


class CorrectorErrors(_Strict):
    """A fallible oracle (`services/corrector/fallible.py`): GPT-4o-like errors, each at its own
    rate per correction (at most one error a correction, so the rates sum to at most 1)."""

    misread: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Perception: misreads one card or number, then judges and corrects for it",
    )
    arithmetic: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Wrong arithmetic: takes a formula off the target (or a wrong comparison, a "
        "miscounted total) for right, and judges and corrects toward it",
    )
    choice: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Wrong choice: reads and computes right, but names a wrong next action",
    )
    draw: Literal["per_call", "per_state"] = Field(
        "per_call",
        description="per_call: each correction's error drawn afresh (a state met again mostly "
        "gets the right answer); per_state: seeded by the state, so its error (or none) repeats "
        "on every visit, as a real corrector's mistakes do",
    )

    @model_validator(mode="after")
    def _at_most_one(self) -> CorrectorErrors:
        if self.misread + self.arithmetic + self.choice > 1 + 1e-9:
            raise ValueError("corrector.errors: misread + arithmetic + choice must be at most 1")
        return self

    def any(self) -> bool:
        """Whether the oracle errs at all."""
        return self.misread + self.arithmetic + self.choice > 0


class CorrectorConfig(_Strict):
    name: str = Field(
        "oracle", min_length=1, max_length=100, description="A registered corrector, or 'oracle'"
    )
    noise: float = Field(
        0.0, ge=0, le=1, description="Oracle only: rate of deliberately wrong corrections"
    )
    errors: CorrectorErrors = Field(
        default_factory=CorrectorErrors,
        description="Oracle only: GPT-4o-like errors per kind (misread, arithmetic, choice)",
    )
    wait: Literal["none", "update", "step"] = Field(
        "none",
        description="none: corrections join the buffer when ready; update: wait before each "
        "update; step: wait after every step (the reference's synchronous loop, to compare)",
    )
    wait_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="Longest wait for a rollout's corrections"
    )
    degraded_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="The run ends 'degraded' (and `gtr train` exits non-zero) when more than "
        "this share of its requested corrections failed (transport, malformed, refused, "
        "budget; not skipped or late); 1 = never",
    )
    min_coverage: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Least share of the run's requested corrections done before an update "
        "trains: below it the rollout waits (up to wait_timeout_s); a run ending below is degraded",
    )
    max_lag_updates: int | None = Field(
        None,
        ge=0,
        le=1000,
        description="Most updates a correction may trail its step: an update waits (up to "
        "wait_timeout_s) for older ones still missing; 0 = each update's own; None = no bound",
    )
    drain_s: float = Field(
        120.0,
        ge=0,
        le=3600,
        description="At the run's end, longest wait for corrections still queued or in flight; "
        "the rest are recorded 'late' (they could teach no update), not failed",
    )
    max_calls: int | None = Field(
        None, ge=0, le=10_000_000, description="Per-run budget of corrector calls"
    )
    max_tokens: int | None = Field(
        None, ge=0, le=10_000_000_000, description="Per-run budget of corrector tokens"
    )
    feedback: bool = Field(
        False,
        description="Points games, wait = step: a verdict 'no solution possible' ends the "
        "episode with reward -1, and the corrector's target formula is kept for the episode "
        "(GTR's loop)",
    )
    backend: Literal["named", "self_teacher"] = Field(
        "named",
        description="named: the corrector `name`; self_teacher: the run's merged checkpoints "
        "(GTR-Turbo, [teacher] settings), recorded as corrector 'self_teacher'",
    )

    @model_validator(mode="after")
    def _self_teacher(self) -> CorrectorConfig:
        # One name everywhere downstream (rows, sweeps, workers): the backend implies it.
        if self.backend == "self_teacher" or self.name == SELF_TEACHER:
            if self.name not in ("oracle", SELF_TEACHER):
                raise ValueError(
                    f"corrector.name {self.name!r} conflicts with backend 'self_teacher'"
                )
            self.name, self.backend = SELF_TEACHER, "self_teacher"
        return self

    # An inline corrector, instead of a registered name (docs/corrector-protocol.md):
    kind: Literal["openai", "http"] | None = Field(
        None, description="Inline corrector: openai = chat completions, http = POST /v1/correct"
    )
    base_url: str | None = Field(None, max_length=500, description="Inline: the endpoint URL")
    model: str | None = Field(None, max_length=200, description="Inline openai: the model name")
    api_key_env: str | None = Field(
        None,
        max_length=100,
        # The registry's rule (services/corrector/schemas.py ENV_RE), refused at launch already
        pattern=r"^GTR_CORRECTOR_KEY_[A-Z0-9_]{1,80}$",
        description="Inline: the environment variable holding the API key (GTR_CORRECTOR_KEY_*)",
    )
    params: dict[str, Any] = Field(
        default_factory=dict, description="Inline: RemoteParams (timeout_s, vision, ...)"
    )

    @model_validator(mode="after")
    def _inline_complete(self) -> CorrectorConfig:
        inline = self.base_url or self.model or self.api_key_env or self.params
        if inline and self.kind is None:
            raise ValueError("base_url, model, api_key_env and params need kind = openai or http")
        if self.kind is not None:
            if not self.base_url:
                raise ValueError(f"an inline corrector of kind {self.kind} needs base_url")
            if self.kind == "openai" and not self.model:
                raise ValueError("an inline corrector of kind openai needs model")
            if self.name == "oracle":  # the label its corrections are recorded under
                self.name = "inline"
        return self

    @model_validator(mode="after")
    def _fallible_oracle(self) -> CorrectorConfig:
        if self.errors.any():
            if self.name != "oracle" or self.kind is not None:
                raise ValueError("corrector.errors makes the oracle fallible: name it 'oracle'")
            if self.noise:
                raise ValueError(
                    "corrector.noise and corrector.errors are two imperfect oracles: set one"
                )
        return self

    def inline(self) -> dict[str, Any] | None:
        """The inline corrector's fields, or None when `name` refers to the registry."""
        if self.kind is None:
            return None
        keys = ("name", "kind", "base_url", "model", "api_key_env", "params")
        return {k: getattr(self, k) for k in keys}


class TeacherConfig(_Strict):
    """The self-teacher (GTR-Turbo): a TIES merge of the run's own checkpoints."""

    merge: Literal["running", "last_k"] = Field(
        "running",
        description="running: every checkpoint of the run so far (GTR-Turbo's authors); "
        "last_k: only the last keep_last (sits close to the agent: KL 0.01-0.13 a step)",
    )
    keep_last: int = Field(
        4, ge=1, le=64, description="k: merge = last_k merges the run's last k checkpoints"
    )
    lag: int = Field(
        1,
        ge=0,
        le=64,
        description="The newest checkpoint merged is at least lag updates older than the run's "
        "newest (the acting policy): 1 keeps the current policy out of its own teacher; 0 = "
        "GTR-Turbo's code, where it is one of the merged checkpoints",
    )
    kl_into: Literal["thought_loss", "return"] = Field(
        "thought_loss",
        description="gtr_turbo_kl: the KL penalty as a loss on the thought tokens only (the "
        "paper: guide the thought, keep the action's exploration), or subtracted from the return "
        "(GTR-Turbo's code: through the advantage it moves the action tokens too)",
    )
    density: float = Field(
        0.8, gt=0, le=1, description="TIES trim: share of each delta's largest entries kept"
    )
    sign_rule: Literal["total", "frequency"] = Field(
        "total", description="TIES sign election: by total mass (paper) or by count"
    )
    merge_every: int = Field(
        1, ge=1, le=10_000, description="m: re-merge once the newest checkpoint is m updates newer"
    )
    lora_merge: Literal["ties", "ties_svd"] = Field(
        "ties",
        description="LoRA runs: peft's TIES on the A/B factors (GTR-Turbo's code) or on the "
        "full deltas B·A, refactored by SVD",
    )
    kl_coef: float = Field(
        1.0, ge=0, le=100, description="gtr_turbo_kl: weight of the thought-token KL penalty"
    )
    kl_clip: float = Field(
        10.0, gt=0, le=1000, description="gtr_turbo_kl: per-token log-ratio clamped to [0, clip]"
    )
    malformed_kl: float = Field(
        100.0,
        ge=0,
        le=10_000,
        description="gtr_turbo_kl with kl_into = return: KL penalty of a malformed output, which "
        "has no thought to score (authors: 100; 0 = none)",
    )
    malformed_reward: float = Field(
        -2.0,
        ge=-100,
        le=0,
        description="gtr_turbo_kl: added to a malformed step's return, a negative format reward "
        "(authors: -2, beside +3 for a valid one: train.format_reward); 0 = none",
    )
    max_new_tokens: int | None = Field(
        None, ge=1, le=2048, description="Self-teacher corrector: output cap; None = generation's"
    )


class EvalProtocol(_Strict):
    """The rules every greedy evaluation and probe of a run plays under, whatever it trains under:
    a study gives all its arms of a task one (services/study/schemas.py), so RL4VLM's training
    without early truncation does not change how its policy is scored."""

    env: EnvConfig = Field(description="Env settings of the evaluation and probe episodes")
    max_new_tokens: int = Field(ge=1, le=2048, description="Generation cap per greedy step")


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
    eval_protocol: EvalProtocol | None = Field(
        None,
        description="Env settings and token cap of the greedy evaluation, the start's and the "
        "probe; None = the run's own env and generation.max_new_tokens",
    )


class TrackingConfig(_Strict):
    tensorboard: bool | None = Field(
        None, description="TensorBoard event files under the run's folder; None = GTR_TRACKING_*"
    )
    wandb: bool | None = Field(
        None, description="Weights & Biases (offline unless GTR_TRACKING_WANDB_MODE=online)"
    )
    mlflow: bool | None = Field(
        None, description="MLflow at GTR_TRACKING_MLFLOW_URI (default: data_dir/mlruns)"
    )
    wandb_project: str | None = Field(
        None, min_length=1, max_length=128, pattern=r"^[\w.-]+$", description="W&B project"
    )
    mlflow_experiment: str | None = Field(
        None, min_length=1, max_length=200, description="MLflow experiment name"
    )


class RunConfig(_Strict):
    name: str = Field("run", min_length=1, max_length=200, description="Human name of the run")
    task: Task = Field(description="numberline | ezpoints | points24 | blackjack | alfworld")
    algorithm: Algorithm = Field(
        "gtr",
        description="gtr = PPO + thought SFT; rl4vlm = PPO only; sft_only = thought SFT only; "
        "grpo = group-relative advantages, no value loss; gtr_grpo = grpo + thought SFT; "
        "gtr_turbo_kl = PPO + KL to the merged self-teacher on thought tokens",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seeds envs, sampling and init")
    env: EnvConfig = Field(default_factory=EnvConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    init: InitConfig = Field(default_factory=InitConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    corrector: CorrectorConfig = Field(default_factory=CorrectorConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        # Before any field: a value PostgreSQL cannot keep must never reach the runs table.
        check_storable(data, "config")
        return data

    @field_validator("seed", mode="before")
    @classmethod
    def _no_bool_seed(cls, value: Any) -> Any:
        if isinstance(value, bool):  # JSON false would pass as the seed 0
            raise ValueError("seed must be an integer, not true or false")
        return value

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if self.init.kind == "checkpoint" and not self.init.checkpoint:
            raise ValueError("init.checkpoint is required when init.kind = 'checkpoint'")
        if self.corrector.feedback and self.corrector.wait != "step":
            raise ValueError(
                "corrector.feedback needs corrector.wait = 'step': the verdict must be known "
                "before the episode's next step"
            )
        if self.train.judge_reward and self.corrector.wait == "none":
            raise ValueError(
                "train.judge_reward needs corrector.wait = 'update' or 'step': the verdicts "
                "must be in before the update"
            )
        if self.algorithm in GROUP_ALGORITHMS:
            if self.train.num_envs % self.train.group_size:
                raise ValueError(
                    f"train.num_envs ({self.train.num_envs}) must be a multiple of "
                    f"train.group_size ({self.train.group_size}) for {self.algorithm}"
                )
            if self.task not in GROUP_TASKS:
                raise ValueError(
                    f"{self.algorithm} needs exact start-state groups: task must be one of "
                    f"{', '.join(GROUP_TASKS)}"
                )
        if self.total_env_steps > 50_000_000:
            raise ValueError(
                "train: num_envs x num_steps x num_updates exceeds 50,000,000 env steps"
            )
        return self

    @property
    def uses_corrector(self) -> bool:
        """Whether steps go to the corrector: for the SFT term, or for the judge reward (which
        an rl4vlm or grpo run may take: the paper's VLM-as-judge baseline is PPO on it)."""
        return self.algorithm not in NO_CORRECTOR_ALGORITHMS or self.train.judge_reward > 0

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
