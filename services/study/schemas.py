"""The study file: a grid of runs (tasks x arms x variants x seeds) and the metric that judges it.

A study file is TOML, validated field by field like a run config (a clear message naming the
field). Each task names a base run config; an arm or a variant is an overlay of it (a partial
run config merged key by key). A shared arm (`shared_arms`) is one no variant changes: it runs
once per task and seed, and that run stands in every variant's comparisons. The primary
metric, and how a run's curve is reduced to one score, is declared here before any run starts
and frozen with the study.
"""

from __future__ import annotations

import copy
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from services.env.stalling import refuse_stalling
from shared.config_paths import resolve_config_paths
from shared.payload import check_free_form, check_storable
from shared.schemas import RunConfig

NAME_MAX = 100  # a task, arm or variant name (runs.study_task / study_arm / study_variant)
METRIC_PATTERN = r"^[A-Za-z0-9_./:-]{1,100}$"  # keys of an update's metrics, e.g. eval/success_rate
MAX_CELLS = 2000  # runs in one study: a typo in seeds should not queue a million runs


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_seeds(value: list[int]) -> list[int]:
    for s in value:
        if not 0 <= s <= 2**31 - 1:
            raise ValueError(f"seed {s} is outside 0..2147483647")
    if len(set(value)) != len(value):
        raise ValueError("seeds repeat: each seed is one independent run per cell")
    return value


def _check_name(value: str, what: str) -> str:
    if not value.strip():
        raise ValueError(f"{what} name must not be blank")
    if len(value) > NAME_MAX:
        raise ValueError(f"{what} name {value[:40]!r}... is longer than {NAME_MAX} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ValueError(f"{what} name {value!r} contains a control character")
    return value


class MetricSpec(_Strict):
    """A metric of the updates' rows and how one run's curve of it becomes that run's score."""

    metric: str = Field(
        pattern=METRIC_PATTERN,
        description="Key in an update's metrics, e.g. eval/success_rate or probe/relevance",
    )
    reduce: Literal["final", "last_k_mean", "mean"] = Field(
        "final",
        description="final: the value at the run's last recorded point; last_k_mean: the mean "
        "of its last k recorded points; mean: the mean of all its recorded points (the area "
        "under its curve: resists an oscillating policy, counts early learning too)",
    )
    k: int = Field(3, ge=1, le=1000, description="Points averaged by last_k_mean")
    higher_is_better: bool = Field(
        True, description="Direction of improvement (False for e.g. probe/top_thought_share)"
    )

    def score(self, curve: list[tuple[int, float]]) -> float | None:
        """The run's score from its (update, value) points; None when the curve is too short
        (no point, or fewer than k for last_k_mean) or holds a non-finite value."""
        points = [v for _, v in sorted(curve, key=lambda p: p[0])]
        if not points:
            return None
        if self.reduce == "mean":
            taken = points
        else:
            taken = points[-1:] if self.reduce == "final" else points[-self.k :]
            if len(taken) < (1 if self.reduce == "final" else self.k):
                return None
        value = sum(taken) / len(taken)
        return float(value) if math.isfinite(value) else None

    def label(self) -> str:
        """e.g. 'eval/success_rate (final)' or 'eval/success_rate (mean of last 3)'."""
        how = {"final": "final", "mean": "mean over all points"}.get(
            self.reduce, f"mean of last {self.k}"
        )
        return f"{self.metric} ({how})"


class AxisSpec(_Strict):
    """The study's question along its variants: arm `a` against arm `b` on the primary metric
    at each variant, the variants ordered by the level their runs measured (e.g. the corrector's
    accuracy), and where the difference changes sign."""

    a: str = Field(description="Arm A of the difference A - B")
    b: str = Field(description="Arm B")
    level: MetricSpec = Field(
        description="Each variant's measured level: this metric of its runs of A and B, reduced "
        "as given, averaged per seed (e.g. corrector/accuracy, last_k_mean)"
    )


class TrendSpec(_Strict):
    """Whether an arm's metric falls (or rises) in every run: the run's score against the first
    point it recorded, run by run (e.g. RL4VLM's probe relevance: thought collapse)."""

    arm: str = Field(description="The arm whose runs are checked")
    metric: MetricSpec = Field(description="The metric, and how a run's score is reduced")
    direction: Literal["falls", "rises"] = Field(description="What the run's score should do")


class TaskSpec(_Strict):
    """One task of the study: its base run config, from a file or inline."""

    config: str | None = Field(
        None,
        max_length=1000,
        description="Base run config file, relative to the study file (read by the CLI only; "
        "the API takes `base` inline)",
    )
    base: dict[str, Any] = Field(
        default_factory=dict,
        description="Base run config fields inline (merged over `config` when both are given)",
    )
    seeds: list[int] | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="This task's run seeds, when they differ from the study's `seeds` "
        "(e.g. fewer on a costlier task); None = the study's",
    )

    evaluation: dict[str, Any] = Field(
        default_factory=dict,
        description="The task's evaluation protocol, over the one taken from the task: `env` "
        "(env settings, merged over the base config's, a variant's applied) and "
        "`max_new_tokens` (default the base's generation cap). Every arm's greedy evaluation, "
        "start and probe play under it, whatever the arm trains under",
    )

    @field_validator("base")
    @classmethod
    def _storable(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_free_form(value, "base")

    @field_validator("evaluation")
    @classmethod
    def _evaluation(cls, value: dict[str, Any]) -> dict[str, Any]:
        extra = set(value) - {"env", "max_new_tokens"}
        if extra:
            raise ValueError(f"evaluation: unknown key {sorted(extra)[0]!r} (env, max_new_tokens)")
        return check_free_form(value, "evaluation")

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, value: list[int] | None) -> list[int] | None:
        return None if value is None else _check_seeds(value)


class BudgetSpec(_Strict):
    updates: int | None = Field(
        None, ge=1, le=100_000, description="train.num_updates of every run; None = the configs'"
    )
    max_env_steps: int = Field(
        50_000_000,
        ge=1,
        le=10_000_000_000,
        description="Refuse a study whose runs together would take more env steps than this",
    )


# --- the tuning stage's declaration (services/study/tuning.py runs it) ----------------------

PPO = ("gtr", "rl4vlm", "grpo", "gtr_grpo", "gtr_turbo_kl")
# knob -> (run-config field, the algorithms it changes anything for)
KNOBS: dict[str, tuple[str, tuple[str, ...]]] = {
    "lr": ("train.lr", (*PPO, "sft_only")),
    "clip": ("train.clip", PPO),
    "sft_coef": ("train.sft_coef", ("gtr", "gtr_grpo")),
    "clip_per_loss": ("train.clip_per_loss", ("gtr", "gtr_grpo")),
    # SFT-only and BC: passes over each update's corrections (the SFT steps per update)
    "sft_epochs": ("train.ppo_epochs", ("sft_only",)),
}


class KnobSpec(_Strict):
    """One knob's search space: a list of choices, or a range [low, high]."""

    choices: list[float | int | bool] | None = Field(
        None, max_length=100, description="The values to try (a bool knob: [false, true])"
    )
    low: float | None = Field(None, description="Range start (with high), instead of choices")
    high: float | None = Field(None, description="Range end (inclusive)")
    log: bool = Field(False, description="Sample the range on a log scale (e.g. a learning rate)")

    @model_validator(mode="after")
    def _space(self) -> KnobSpec:
        if self.choices is not None:
            if not self.choices:
                raise ValueError("empty search space: choices is empty")
            if self.low is not None or self.high is not None:
                raise ValueError("give choices or low/high, not both")
            return self
        if self.low is None or self.high is None:
            raise ValueError("empty search space: give choices, or low and high")
        if not (math.isfinite(self.low) and math.isfinite(self.high)) or self.low >= self.high:
            raise ValueError(f"empty search space: low {self.low} is not below high {self.high}")
        if self.log and self.low <= 0:
            raise ValueError("a log range needs low > 0")
        return self

    def values(self) -> list[Any]:
        """Every value the search can give (choices, or the range's ends)."""
        return list(self.choices) if self.choices is not None else [self.low, self.high]


class TuningSpec(_Strict):
    """The tuning stage: declared with the study, run before its grid on tuning seeds."""

    arms: dict[str, dict[str, KnobSpec]] = Field(
        min_length=1,
        max_length=50,
        description="Arm -> knob -> its search space; knobs: " + ", ".join(KNOBS),
    )
    trials: int = Field(ge=1, le=200, description="Trials per arm (the budget)")
    seeds: list[int] = Field(
        min_length=1,
        max_length=20,
        description="Tuning run seeds: each trial trains one run per seed; none may be an "
        "evaluation seed",
    )
    task: str | None = Field(None, description="The task tuned on; None = the study's only task")
    updates: int | None = Field(
        None, ge=1, le=100_000, description="A trial run's train.num_updates; None = the grid's"
    )
    metric: MetricSpec | None = Field(
        None,
        description="Selection metric and its reduction (default: the primary metric's key, "
        "reduce = mean: the area under the evaluation curve)",
    )
    rule: Literal["best"] = Field(
        "best",
        description="best: the completed trial with the best score (ties: the earlier trial)",
    )
    sampler: Literal["tpe", "grid"] = Field(
        "tpe",
        description="tpe: Optuna's TPE, seeded; grid: every combination of the choices in turn "
        "(every knob needs choices)",
    )
    pruner: Literal["median", "halving", "none"] = Field(
        "median",
        description="Early stopping on the evaluation curve: median (MedianPruner), halving "
        "(SuccessiveHalvingPruner) or none",
    )
    startup_trials: int = Field(
        1, ge=0, le=100, description="median: completed trials before any is pruned"
    )
    warmup: int = Field(
        0, ge=0, le=100_000, description="median: the updates before a trial can be pruned"
    )
    sampler_seed: int = Field(0, ge=0, le=2**31 - 1, description="The sampler's seed")

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, value: list[int]) -> list[int]:
        return _check_seeds(value)

    @model_validator(mode="after")
    def _knobs(self) -> TuningSpec:
        for arm, knobs in self.arms.items():
            if not knobs:
                raise ValueError(f"arms.{arm}: empty search space (no knob)")
            for knob, space in knobs.items():
                if knob not in KNOBS:
                    raise ValueError(
                        f"arms.{arm}: unknown knob {knob!r} (knobs: {', '.join(KNOBS)})"
                    )
                if self.sampler == "grid" and space.choices is None:
                    raise ValueError(f"arms.{arm}.{knob}: sampler = 'grid' needs choices")
        return self

    def selection(self, primary: MetricSpec) -> MetricSpec:
        return self.metric or MetricSpec(
            metric=primary.metric, reduce="mean", higher_is_better=primary.higher_is_better
        )


def check_tuning(cfg: StudyConfig) -> None:
    """The tuning section against its study: arms, task, knobs per algorithm, disjoint seeds,
    and each knob's extreme values valid in a trial's run config. A ValueError names what."""
    t = cfg.tuning
    assert t is not None
    if t.task is None and len(cfg.tasks) > 1:
        raise ValueError(f"tuning.task: the study has {len(cfg.tasks)} tasks; name one")
    if t.task is not None and t.task not in cfg.tasks:
        raise ValueError(f"tuning.task: {t.task!r} is not a task of the study")
    evaluation = set(cfg.seeds).union(*(cfg.seeds_of(task) for task in cfg.tasks))
    shared = sorted(evaluation & set(t.seeds))
    if shared:
        raise ValueError(
            f"tuning.seeds: {', '.join(map(str, shared))} also evaluation seed(s): a setting "
            "chosen on a seed would be judged on it again"
        )
    for arm, knobs in t.arms.items():
        if arm not in cfg.arms:
            raise ValueError(f"tuning.arms: {arm!r} is not an arm of the study")
        algorithm = trial_config(cfg, arm, t.seeds[0], {}, 0).algorithm
        for knob, space in knobs.items():
            field, algorithms = KNOBS[knob]
            if algorithm not in algorithms:
                raise ValueError(
                    f"tuning.arms.{arm}.{knob}: {field} changes nothing for algorithm "
                    f"{algorithm!r} (it does for {', '.join(algorithms)})"
                )
            for value in space.values():
                trial_config(cfg, arm, t.seeds[0], {knob: value}, 0)  # raises naming the knob


def tuned_task(cfg: StudyConfig) -> str:
    assert cfg.tuning is not None
    return cfg.tuning.task or next(iter(cfg.tasks))


def _nested(params: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for knob, value in params.items():
        section, key = KNOBS[knob][0].split(".")
        out.setdefault(section, {})[key] = value
    return out


def trial_config(
    cfg: StudyConfig, arm: str, seed: int, params: dict[str, Any], trial: int
) -> RunConfig:
    """A trial's run: the arm on the tuned task with no variant, at a tuning seed, the knobs
    set. A ValueError names the arm and the knob's value when the config is not valid."""
    assert cfg.tuning is not None
    raw = cfg.run_config(Cell(tuned_task(cfg), arm, seed)).model_dump(mode="json")
    raw = merge(raw, _nested(params))
    if cfg.tuning.updates is not None:
        raw["train"]["num_updates"] = cfg.tuning.updates
    raw["name"] = f"{cfg.name[:80]} · tuning {arm} trial {trial} seed {seed}"[:200]
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"tuning.arms.{arm} {params}: {where}: {first['msg']}") from None


class StudyConfig(_Strict):
    name: str = Field(min_length=1, max_length=200, description="Human name of the study")
    tasks: dict[str, TaskSpec] = Field(
        min_length=1, max_length=20, description="Task name -> its base run config"
    )
    arms: dict[str, dict[str, Any]] = Field(
        min_length=1,
        max_length=50,
        description="Arm name -> overlay of the base config (partial run config, e.g. "
        "{algorithm = 'rl4vlm'}); every arm runs on every task",
    )
    seeds: list[int] = Field(
        min_length=1, max_length=200, description="Run seeds; every cell runs each of them"
    )
    variants: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        max_length=50,
        description="Variant name -> overlay applied after the arm's (e.g. a corrector noise); "
        "none = one unnamed variant",
    )
    shared_arms: list[str] = Field(
        default_factory=list,
        max_length=50,
        description="Arms no variant changes (e.g. rl4vlm, which calls no corrector, beside "
        "corrector variants): each runs once per task and seed with no variant's overlay, and "
        "that run stands in every variant's comparisons. Refused where a variant would change "
        "such an arm's run",
    )
    budget: BudgetSpec = Field(default_factory=BudgetSpec)
    primary: MetricSpec = Field(
        default_factory=lambda: MetricSpec(metric="eval/success_rate"),
        description="The metric that judges the arms, declared before any run starts",
    )
    secondary: list[MetricSpec] = Field(
        default_factory=list, max_length=20, description="Further metrics, labelled secondary"
    )
    axis: AxisSpec | None = Field(
        None, description="A - B along the variants' measured level (services/study/questions.py)"
    )
    trends: list[TrendSpec] = Field(
        default_factory=list, max_length=20, description="Per-run checks of a metric's direction"
    )
    eval_episodes: int = Field(
        64, ge=1, le=1000, description="Greedy deals per evaluation (metrics.eval_episodes)"
    )
    confirmatory: list[list[str]] = Field(
        default_factory=list,
        max_length=200,
        description="The confirmatory comparisons, pairs [A, B] of arms: each task's family "
        "whose p-values Holm adjusts and whose verdicts count; empty = every pair of arms "
        "within a variant. Other pairs are reported as exploratory",
    )
    concurrency: int = Field(
        2, ge=1, le=256, description="Full stack: runs of the study queued or running at once"
    )
    tuning: TuningSpec | None = Field(
        None,
        description="The tuning stage (services/study/tuning.py): per arm, knobs searched on "
        "tuning seeds before the grid; `gtr study run` runs it first",
    )

    @model_validator(mode="before")
    @classmethod
    def _storable_spec(cls, data: Any) -> Any:
        check_storable(data, "study")
        return data

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, value: list[int]) -> list[int]:
        return _check_seeds(value)

    @field_validator("tasks", "arms", "variants")
    @classmethod
    def _names(cls, value: dict[str, Any], info: Any) -> dict[str, Any]:
        what = info.field_name.rstrip("s")
        for name in value:
            _check_name(name, what)
        for name, overlay in value.items():
            if isinstance(overlay, dict):
                check_free_form(overlay, f"{info.field_name}.{name}")
        return value

    @model_validator(mode="after")
    def _grid(self, info: ValidationInfo) -> StudyConfig:
        for name, task in self.tasks.items():
            if task.config is not None:
                raise ValueError(
                    f"tasks.{name}.config: a file is read only by the CLI (gtr study run/create "
                    f"inline it); give the run config as tasks.{name}.base"
                )
        self._check_shared_names()
        self._check_questions()
        per_seed = len(self.shared_arms) + (len(self.arms) - len(self.shared_arms)) * max(
            len(self.variants), 1
        )
        cells = sum(len(self.seeds_of(task)) for task in self.tasks) * per_seed
        if cells > MAX_CELLS:
            raise ValueError(f"the study has {cells} runs; the limit is {MAX_CELLS}")
        names = [m.metric for m in [self.primary, *self.secondary]]
        if len(set(names)) != len(names):
            raise ValueError("a metric is declared twice (primary and secondary must differ)")
        steps = 0
        for cell in self.cells():
            steps += self.run_config(cell).total_env_steps  # raises ValueError naming the cell
        if steps > self.budget.max_env_steps:
            raise ValueError(
                f"the study's runs take {steps:,} env steps; budget.max_env_steps is "
                f"{self.budget.max_env_steps:,}"
            )
        self._check_shared_runs()
        if self.tuning is not None:
            check_tuning(self)
        if not (info.context or {}).get("stored"):  # a stored study was checked when filed
            self._check_stalling()
        return self

    def _check_stalling(self) -> None:
        """No cell may score never answering above a wrong answer (services/env/stalling.py)."""
        seen: set[tuple[str, str]] = set()
        for cell in self.cells():
            cfg = self.run_config(cell)
            key = (cfg.task, cfg.env.model_dump_json())
            if key not in seen:
                seen.add(key)
                refuse_stalling(cfg.task, cfg.env, cell.describe())

    def _check_shared_names(self) -> None:
        for name in self.shared_arms:
            if name not in self.arms:
                raise ValueError(
                    f"shared_arms: {name!r} is not an arm of the study (its arms: "
                    f"{', '.join(repr(a) for a in self.arms)})"
                )
        if len(set(self.shared_arms)) != len(self.shared_arms):
            raise ValueError("shared_arms: an arm is listed twice")

    def _check_questions(self) -> None:
        named = [("trends", t.arm) for t in self.trends]
        for pair in self.confirmatory:
            if len(pair) != 2 or pair[0] == pair[1]:
                raise ValueError(f"confirmatory: {pair!r} is not a pair of two different arms")
            named += [("confirmatory", arm) for arm in pair]
        if self.axis is not None:
            named += [("axis.a", self.axis.a), ("axis.b", self.axis.b)]
            if self.axis.a == self.axis.b:
                raise ValueError("axis: a and b are the same arm")
            if len(self.variants) < 2:
                raise ValueError("axis: the study needs at least two variants to order")
        for where, arm in named:
            if arm not in self.arms:
                raise ValueError(
                    f"{where}: {arm!r} is not an arm of the study (its arms: "
                    f"{', '.join(repr(a) for a in self.arms)})"
                )

    def _check_shared_runs(self) -> None:
        """A shared arm's one run stands in for its run under every variant: each variant
        must leave that run as it is (a setting the run does not use, such as the corrector
        of an arm that calls none, may differ)."""
        for task in self.tasks:
            seed = self.seeds_of(task)[0]
            for arm in self.shared_arms:
                alone = _what_runs(self.run_config(Cell(task, arm, seed)))
                for variant in self.variants:
                    varied = _what_runs(self.run_config(Cell(task, arm, seed, variant)))
                    where = _first_difference(alone, varied)
                    if where is not None:
                        raise ValueError(
                            f"shared_arms: variant {variant!r} changes the run of arm {arm!r} "
                            f"on task {task!r} ({where}), so one run cannot stand in for both; "
                            f"take {arm!r} out of shared_arms to run it under every variant"
                        )

    def seeds_of(self, task: str) -> list[int]:
        """The task's run seeds: its own `seeds`, else the study's."""
        return self.tasks[task].seeds or self.seeds

    def cells(self) -> list[Cell]:
        """Every run of the study, task by task, seed by seed, arm by arm: the arms of one
        seed are adjacent, so a warm start built for the first is reused by the others. A
        shared arm has one cell per task and seed, with no variant, among the first variant's."""
        variants = list(self.variants) or [""]
        shared = set(self.shared_arms)
        return [
            Cell(task, arm, seed, "" if arm in shared else variant)
            for task in self.tasks
            for seed in self.seeds_of(task)
            for i, variant in enumerate(variants)
            for arm in self.arms
            if arm not in shared or i == 0
        ]

    def run_config(self, cell: Cell) -> RunConfig:
        """The cell's run config: base <- arm <- variant, then the study's seed, budget and
        evaluation deal count. A ValueError names the cell when the result is not valid."""
        task = self.tasks[cell.task]
        raw = merge(task.base, self.arms[cell.arm])
        # The protocol comes from the task (and variant), never the arm: every arm of a group
        # is scored under the same rules.
        judged = merge(task.base, self.variants[cell.variant]) if cell.variant else task.base
        if cell.variant:
            raw = merge(raw, self.variants[cell.variant])
        raw.setdefault("metrics", {})["eval_protocol"] = {
            "env": merge(judged.get("env") or {}, task.evaluation.get("env") or {}),
            "max_new_tokens": task.evaluation.get("max_new_tokens")
            or (judged.get("generation") or {}).get("max_new_tokens", 64),
        }
        raw["seed"] = cell.seed
        raw["name"] = run_name(self.name, cell)
        raw.setdefault("metrics", {})["eval_episodes"] = self.eval_episodes
        if self.budget.updates is not None:
            raw.setdefault("train", {})["num_updates"] = self.budget.updates
        try:
            return RunConfig.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "config"
            raise ValueError(f"{cell.describe()}: {where}: {first['msg']}") from None

    @classmethod
    def from_toml(cls, path: str | Path) -> StudyConfig:
        """Read a study file; each task's `config` file is read (relative to the study file)
        and inlined into `base`, so the stored study needs no file."""
        path = Path(path)
        with open(path, "rb") as f:
            raw = tomllib.load(f)
        return cls.model_validate(inline_task_configs(raw, path.resolve().parent))


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""

    task: str
    arm: str
    seed: int
    variant: str = ""

    def describe(self) -> str:
        v = f", variant {self.variant!r}" if self.variant else ""
        return f"task {self.task!r}, arm {self.arm!r}{v}, seed {self.seed}"


def _what_runs(cfg: RunConfig) -> dict[str, Any]:
    """The settings that decide what a run does: its config less its name, and less the
    corrector's settings when it calls no corrector."""
    out = cfg.model_dump(mode="json", exclude={"name"})
    if not cfg.uses_corrector:
        del out["corrector"]
    return out


def _first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """The dotted path of the first value that differs between a and b, or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            where = _first_difference(a.get(key), b.get(key), f"{path}.{key}" if path else key)
            if where is not None:
                return where
        return None
    return None if a == b else (path or "config")


def merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """``overlay`` merged into a copy of ``base``: tables key by key, anything else replaced."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def run_name(study: str, cell: Cell) -> str:
    parts = [cell.task, cell.arm, *([cell.variant] if cell.variant else []), f"seed {cell.seed}"]
    return f"{study[:80]} · {' / '.join(parts)}"[:200]


def inline_task_configs(raw: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """The raw study with each task's `config` file read into its `base` (the file's paths
    resolved against the file's own folder); a missing or unreadable file is a ValueError."""
    tasks = raw.get("tasks")
    if not isinstance(tasks, dict):
        return raw
    for name, spec in tasks.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("config"), str):
            continue
        file = Path(spec["config"]).expanduser()
        file = file if file.is_absolute() else base_dir / file
        try:
            with open(file, "rb") as f:
                loaded = tomllib.load(f)
        except OSError as e:
            raise ValueError(f"tasks.{name}.config: cannot read {file}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"tasks.{name}.config: {file} is not valid TOML: {e}") from None
        loaded = resolve_config_paths(loaded, file.resolve().parent)
        spec["base"] = merge(loaded, spec.get("base") or {})
        del spec["config"]
    return raw
