"""A study's report, computed from stored rows only: the study, its runs, their updates'
metrics and their per-deal evaluation outcomes (services/study/statistics.py does the maths).

Per task (and variant): each arm's primary score with a bootstrap interval over seeds (and a
two-level seeds-and-deals interval where the primary metric is a greedy-evaluation figure),
paired comparisons with verdicts, the secondary and collapse metrics treated the same way but
labelled secondary, learning curves with bands, the deal space, and the progress of the grid.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime
from functools import lru_cache
from itertools import combinations
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from services.study import statistics as st
from services.study.outputs import ComparisonOut, IntervalOut
from services.study.questions import AxisReport, TrendReport, axis_reports, trend_reports
from services.study.schemas import MetricSpec, StudyConfig
from services.study.service import MAX_ATTEMPTS, SUPERSEDED, StudyNotFound
from services.study.tuning import ArmTuning, tuning_report
from shared.db.models import EvalOutcome, Run, Step, Study, Update, utcnow

# The collapse monitors of services/controller/metrics.py (probe_metrics), always reported
# as secondary metrics when the runs recorded them.
COLLAPSE = {"probe_relevance": True, "probe_top_thought_share": False}  # key -> higher is better
# Primary metrics that are a mean over the evaluation's deals: the column of eval_outcomes.
DEAL_COLUMNS = {
    "eval/success_rate": "success",
    "eval/episode_return": "episode_return",
    "eval/episode_length": "episode_length",
}
# What makes two deals the same deal, per task: the fields of the state a deal fixes.
DEAL_FIELDS = {
    "numberline": ("current", "target"),
    "ezpoints": ("cards",),
    "points24": ("cards",),
    "blackjack": ("player_cards", "dealer_cards"),
}
# Distinct deals each task can deal (its `_new_episode`): NumberLine's start and goal differ
# (6 x 6 - 6); EZPoints' 19 ordered pairs of ranks (a ten shows as T, J, Q or K) x 4 x 4 suits;
# Points24: four cards of 52, drawn with replacement. Blackjack and ALFWorld: not counted.
# tests/services/study/test_report.py draws deals to check the small ones.
DEAL_SPACE = {"numberline": 30, "ezpoints": 304, "points24": 52**4}
RUN_DONE = "completed"


class ArmScore(BaseModel):
    arm: str = Field(description="Arm name")
    scores: dict[int, float] = Field(description="Seed -> the run's score (completed runs)")
    mean: IntervalOut = Field(description="Mean over seeds, percentile-bootstrap interval")
    iqm: float | None = Field(description="Interquartile mean over seeds")
    median: float | None = Field(description="Median over seeds")
    deals: IntervalOut | None = Field(
        None, description="Mean with a two-level (seeds, then deals) bootstrap interval"
    )
    runs: dict[int, int] = Field(description="Seed -> run id of the scored run")
    change_from_start: IntervalOut | None = Field(
        None,
        description="Mean over seeds of the run's score minus its start's (the same metric "
        "before update 0, same deals and protocol), with its bootstrap interval",
    )
    sft_share: float | None = Field(
        None,
        description="Mean over its runs and updates of sft/grad_share: the thought-SFT "
        "gradient's share of the applied step; None: no such term",
    )
    kl_share: float | None = Field(
        None,
        description="Mean over its runs and updates of kl/grad_share: the KL-to-teacher "
        "gradient's share of the applied step (gtr_turbo_kl with the KL as a loss); None: no "
        "such term",
    )


class MetricBlock(BaseModel):
    metric: str = Field(description="Key in the updates' metrics")
    label: str = Field(description="The metric and its reduction, e.g. 'x (final)'")
    role: Literal["primary", "secondary", "collapse"] = Field(
        description="primary: declared before the runs; secondary and collapse: labelled so"
    )
    higher_is_better: bool
    arms: list[ArmScore]
    comparisons: list[ComparisonOut]
    start: IntervalOut | None = Field(
        None,
        description="The start (the seed's starting weights before update 0, evaluated on the "
        "same deals under the same protocol), mean over seeds with its interval",
    )
    start_scores: dict[int, float] = Field(
        default_factory=dict, description="Seed -> the start's value (one per seed, shared)"
    )
    dead_seeds: list[int] = Field(
        default_factory=list,
        description="Seeds whose start and every arm's score are 0 (nothing learnt from that "
        "start): kept in the comparisons, named so a mean does not hide them",
    )

    def seeds(self) -> list[int]:
        """Every seed with a start or an arm's score, in order (the per-seed table's rows)."""
        return sorted(set(self.start_scores).union(*(a.scores for a in self.arms)))


class CurvePointOut(BaseModel):
    update: int
    mean: float
    low: float | None
    high: float | None
    n: int


class Curve(BaseModel):
    arm: str
    metric: str
    points: list[CurvePointOut] = Field(description="Mean over seeds with a 95 % band")


class DealSpace(BaseModel):
    size: int | None = Field(description="Distinct deals the task can deal (None: not counted)")
    eval_episodes: int = Field(0, description="Evaluation episodes per evaluation (deal seeds)")
    eval_deals: int = Field(
        description="Distinct deals (by content) among the evaluation episodes; equals "
        "eval_episodes where the content is not known"
    )
    in_training: int | None = Field(
        description="Distinct evaluation deals whose content also started a training episode "
        "of these runs (None: the task's deal content is not known)"
    )
    held_out: bool | None = Field(
        None, description="No evaluation deal was dealt in training (None: not known)"
    )


class CellRun(BaseModel):
    run_id: int
    url: str = Field(description="The run's page")
    task: str
    arm: str
    variant: str
    seed: int
    attempt: int
    status: str
    updates_done: int
    num_updates: int


class Progress(BaseModel):
    cells: int = Field(
        description="Runs the grid holds: one per task, arm, variant and seed (a shared arm: "
        "one per task and seed)"
    )
    waiting: int = Field(description="Cells without a run yet, or waiting for their retry")
    queued: int
    running: int
    done: int
    failed: int
    cancelled: int
    eta_s: float | None = Field(description="Seconds left at the observed update rate")


class ArmCost(BaseModel):
    arm: str
    runs: int = Field(description="Finished runs that recorded their updates' seconds")
    minutes: float | None = Field(
        description="Mean wall-minutes per run of its updates (rollout, training, evaluation; "
        "not the warm start), at the concurrency the runs had"
    )
    cpu_minutes: float | None = Field(
        None,
        description="Mean CPU-minutes per run of the same updates, where every one of the "
        "arm's timed runs recorded them (update_cpu_s: the driver process's CPU time, all of "
        "a run's work on the embedded default); unlike wall time, a busy or paused host does "
        "not inflate it",
    )
    coverage: float | None = Field(
        None,
        description="Mean share of the requested corrections done per finished run (the "
        "coverage each run recorded when it ended, info.corrections); None: none recorded",
    )


class GroupReport(BaseModel):
    task: str
    variant: str = Field(description="'' when the study has no variants")
    arms: list[str]
    shared_arms: list[str] = Field(
        default_factory=list,
        description="Arms whose one run per seed (no variant) stands in every variant's group",
    )
    primary: MetricBlock
    secondary: list[MetricBlock] = Field(description="Secondary and collapse metrics")
    curves: list[Curve]
    change_curves: list[Curve] = Field(
        default_factory=list,
        description="The primary metric per arm less each seed's start (a seed's curve minus its "
        "own start evaluation): the arm's change from where its seed began, a band over seeds. "
        "Empty where no run evaluated its start",
    )
    deal_space: DealSpace
    split_starts: list[int] = Field(
        default_factory=list,
        description="Seeds whose finished runs started from different weights (their "
        "init_weights_sha256 differ): the paired comparison at such a seed is not like for like",
    )
    cost: list[ArmCost] = Field(default_factory=list, description="What a run of each arm took")
    protocol: dict[str, Any] | None = Field(
        None,
        description="The evaluation protocol the group's finished runs were scored under (env "
        "settings, token cap, deals; services/controller/evaluate.py). Runs under another are "
        "never paired with them",
    )
    protocol_runs: dict[str, list[int]] = Field(
        default_factory=dict,
        description="Protocol key -> the finished runs evaluated under it, when more than one",
    )


class StudyReport(BaseModel):
    id: int
    name: str
    team: str
    status: str
    primary: str = Field(description="The primary metric's label, declared before the runs")
    alpha: float = Field(description="Significance level of the verdicts")
    confidence: float = Field(description="Level of every interval")
    created_at: datetime
    progress: Progress
    groups: list[GroupReport]
    axes: list[AxisReport] = Field(
        default_factory=list, description="The declared axis's answer, per task (questions.py)"
    )
    trends: list[TrendReport] = Field(
        default_factory=list, description="The declared trends' answers, per task"
    )
    tuning: list[ArmTuning] = Field(
        default_factory=list,
        description="The tuning stage per arm: every trial and the choice (study/tuning.py)",
    )
    runs: list[CellRun]


def build_report(session: Session, study_id: int, team: str | None = None) -> StudyReport:
    """The study's report; `team` (when given) must own it, else StudyNotFound."""
    study = session.get(Study, study_id)
    if study is None or (team is not None and study.team != team):
        raise StudyNotFound(f"study {study_id}")
    spec = _spec(study)
    primary = MetricSpec.model_validate(
        study.spec.get("primary") or {"metric": study.primary_metric}
    )
    runs = list(session.scalars(select(Run).where(Run.study_id == study.id).order_by(Run.id)).all())
    latest = _latest_attempts(runs)
    curves = _curves(session, [r.id for r in runs])
    blocks = _metric_specs(study, primary, curves)
    groups, grouped, built = [], [], []
    for (task, variant), cell_runs in _groups(spec, latest).items():
        arms = _arm_order(spec, cell_runs)
        group = _group(session, task, variant, arms, cell_runs, blocks, curves)
        if spec is not None and variant:
            group.shared_arms = [a for a in spec.shared_arms if a in arms]
        groups.append(group)
        built.append((task, variant, cell_runs))
    adjust_holm(groups, spec.confirmatory if spec is not None else [])
    for group, (task, variant, cell_runs) in zip(groups, built, strict=True):
        done = {k: r for k, r in cell_runs.items() if r.status == RUN_DONE}
        axis = spec.axis if spec is not None else None
        pair = _oriented(group.primary, axis.a, axis.b) if axis is not None else None
        grouped.append((task, variant, done, pair))

    return StudyReport(
        id=study.id,
        name=study.name,
        team=study.team,
        status=study.status,
        primary=primary.label(),
        alpha=st.ALPHA,
        confidence=st.CONFIDENCE,
        created_at=study.created_at,
        progress=_progress(study, spec, latest),
        groups=groups,
        axes=axis_reports(spec, grouped, curves),
        trends=trend_reports(spec, grouped, curves),
        tuning=tuning_report(spec, study.id),
        runs=[_cell_run(r) for r in sorted(runs, key=lambda r: r.id)],
    )


def _oriented(block: MetricBlock, a: str, b: str) -> ComparisonOut | None:
    """The block's comparison of arms a and b, as a - b (a comparison of b and a flipped)."""
    for c in block.comparisons:
        if (c.a, c.b) == (a, b):
            return c
        if (c.a, c.b) == (b, a):
            iv = c.mean_diff
            flipped = IntervalOut(
                point=None if iv.point is None else -iv.point,
                low=None if iv.high is None else -iv.high,
                high=None if iv.low is None else -iv.low,
                n=iv.n,
            )
            diffs = [-d for d in c.diffs]
            return c.model_copy(update={"a": a, "b": b, "mean_diff": flipped, "diffs": diffs})
    return None


def _spec(study: Study) -> StudyConfig | None:
    try:
        return StudyConfig.model_validate(study.spec, context={"stored": True})
    except (ValidationError, ValueError):
        return None  # a spec stored by an older version: the report reads the runs alone


def _cell(run: Run) -> tuple[str, str, str, int]:
    return (run.study_task or "", run.study_variant or "", run.study_arm or "", run.study_seed or 0)


def _latest_attempts(runs: Iterable[Run]) -> dict[tuple[str, str, str, int], Run]:
    """Per cell, the completed attempt if any, else the latest one."""
    out: dict[tuple[str, str, str, int], Run] = {}
    for run in runs:
        have = out.get(_cell(run))
        if (
            have is None
            or (run.status == RUN_DONE) > (have.status == RUN_DONE)
            or (
                (run.status == RUN_DONE) == (have.status == RUN_DONE)
                and (run.study_attempt or 0) > (have.study_attempt or 0)
            )
        ):
            out[_cell(run)] = run
    return out


def _curves(session: Session, run_ids: list[int]) -> dict[int, dict[str, list[tuple[int, float]]]]:
    """run id -> metric -> [(update, value)], numbers only."""
    out: dict[int, dict[str, list[tuple[int, float]]]] = defaultdict(lambda: defaultdict(list))
    if not run_ids:
        return out
    rows = session.execute(
        select(Update.run_id, Update.idx, Update.metrics)
        .where(Update.run_id.in_(run_ids))
        .order_by(Update.run_id, Update.idx)
    )
    for run_id, idx, metrics in rows:
        for key, value in (metrics or {}).items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[run_id][key].append((idx, float(value)))
    return out


def _metric_specs(
    study: Study, primary: MetricSpec, curves: dict[int, dict[str, list[tuple[int, float]]]]
) -> list[tuple[MetricSpec, str]]:
    """(spec, role) of every metric the report judges: primary, declared secondary, collapse."""
    out = [(primary, "primary")]
    for raw in study.spec.get("secondary") or []:
        out.append((MetricSpec.model_validate(raw), "secondary"))
    recorded = {k for per_run in curves.values() for k in per_run}
    taken = {m.metric for m, _ in out}
    for key, higher in COLLAPSE.items():
        if key in recorded and key not in taken:
            spec = MetricSpec(
                metric=key, reduce=primary.reduce, k=primary.k, higher_is_better=higher
            )
            out.append((spec, "collapse"))
    return out


def _groups(
    spec: StudyConfig | None, latest: dict[tuple[str, str, str, int], Run]
) -> dict[tuple[str, str], dict[tuple[str, int], Run]]:
    """(task, variant) -> (arm, seed) -> run, in the study file's order of tasks and variants.
    A shared arm's run (one per task and seed, no variant) is in every variant's group: the
    variants' arms are compared with it there."""
    out: dict[tuple[str, str], dict[tuple[str, int], Run]] = {}
    variants = list(spec.variants) if spec is not None else []
    shared = set(spec.shared_arms) if spec is not None and variants else set()
    if spec is not None:
        for task in spec.tasks:
            for variant in variants or [""]:
                out[(task, variant)] = {}
    stand_ins = []
    for (task, variant, arm, seed), run in latest.items():
        if arm in shared and variant == "":
            stand_ins.append((task, arm, seed, run))
        else:
            out.setdefault((task, variant), {})[(arm, seed)] = run
    # After the variants' own runs: where an edited file made an arm shared, its shared run
    # (the cell the grid holds now) wins over the runs it had under each variant before.
    for task, arm, seed, run in stand_ins:
        for variant in variants:
            out.setdefault((task, variant), {})[(arm, seed)] = run
    return out


def _arm_order(spec: StudyConfig | None, cell_runs: dict[tuple[str, int], Run]) -> list[str]:
    arms = list(spec.arms) if spec is not None else []
    return arms + sorted({a for a, _ in cell_runs} - set(arms))


def _group(
    session: Session,
    task: str,
    variant: str,
    arms: list[str],
    cell_runs: dict[tuple[str, int], Run],
    blocks: list[tuple[MetricSpec, str]],
    curves: dict[int, dict[str, list[tuple[int, float]]]],
) -> GroupReport:
    done = {k: r for k, r in cell_runs.items() if r.status == RUN_DONE}
    keys = {run.id: protocol_of(run) for run in done.values()}
    judged = [_block(session, spec, role, arms, done, curves, keys) for spec, role in blocks]
    by_key: dict[str, list[int]] = defaultdict(list)
    for run_id, record in keys.items():
        by_key[str(record.get("key"))].append(run_id)
    main = max(by_key, key=lambda k: len(by_key[k]), default=None)
    protocol = next((r for r in keys.values() if str(r.get("key")) == main), None)
    return GroupReport(
        protocol=protocol,
        protocol_runs=dict(by_key) if len(by_key) > 1 else {},
        task=task,
        variant=variant,
        arms=arms,
        primary=judged[0],
        secondary=judged[1:],
        curves=[_curve(arm, spec.metric, cell_runs, curves) for spec, _ in blocks for arm in arms],
        change_curves=_change_curves(arms, blocks[0][0].metric, cell_runs, curves),
        deal_space=_deal_space(session, task, list(cell_runs.values())),
        split_starts=split_starts(done),
        cost=[_cost(arm, done, curves) for arm in arms],
    )


def _cost(
    arm: str,
    done: dict[tuple[str, int], Run],
    curves: dict[int, dict[str, list[tuple[int, float]]]],
) -> ArmCost:
    timed = [
        curves[run.id]
        for (a, _), run in done.items()
        if a == arm and curves.get(run.id, {}).get("update_s")
    ]
    wall = [sum(v for _, v in c["update_s"]) for c in timed]
    # A run recorded before update_cpu_s existed has no CPU time: no mean over a part of them.
    cpu = [sum(v for _, v in c["update_cpu_s"]) for c in timed if c.get("update_cpu_s")]
    covered = [
        c["corrections_coverage"]
        for (a, _), run in done.items()
        if a == arm
        and isinstance(c := (run.info or {}).get("corrections"), dict)
        and isinstance(c.get("corrections_coverage"), int | float)
    ]
    return ArmCost(
        arm=arm,
        runs=len(wall),
        minutes=sum(wall) / len(wall) / 60 if wall else None,
        cpu_minutes=sum(cpu) / len(cpu) / 60 if cpu and len(cpu) == len(wall) else None,
        coverage=sum(covered) / len(covered) if covered else None,
    )


def split_starts(done: dict[tuple[str, int], Run]) -> list[int]:
    """Seeds whose runs record more than one starting-weights hash (a run recorded before the
    hash existed is left out of the check)."""
    starts: dict[int, set[str]] = defaultdict(set)
    for (_, seed), run in done.items():
        sha = (run.info or {}).get("init_weights_sha256")
        if sha:
            starts[seed].add(str(sha))
    return sorted(seed for seed, shas in starts.items() if len(shas) > 1)


def _block(
    session: Session,
    spec: MetricSpec,
    role: str,
    arms: list[str],
    done: dict[tuple[str, int], Run],
    curves: dict[int, dict[str, list[tuple[int, float]]]],
    protocols: dict[int, dict[str, Any]],
) -> MetricBlock:
    scores: dict[str, dict[int, float]] = {arm: {} for arm in arms}
    run_of: dict[str, dict[int, int]] = {arm: {} for arm in arms}
    starts: dict[str, dict[int, float]] = {arm: {} for arm in arms}
    start_metric = start_key(spec.metric)
    for (arm, seed), run in done.items():
        value = spec.score(curves.get(run.id, {}).get(spec.metric, []))
        if value is not None:
            scores[arm][seed] = value
            run_of[arm][seed] = run.id
            begun = curves.get(run.id, {}).get(start_metric or "", [])
            if begun:
                starts[arm][seed] = begun[0][1]
    start_scores: dict[int, float] = {}
    for arm in arms:  # one start per seed: the arms of a seed share their starting weights
        for seed, value in starts[arm].items():
            start_scores.setdefault(seed, value)
    arm_scores = []
    for arm in arms:
        values = [scores[arm][s] for s in sorted(scores[arm])]
        deals = None
        if role == "primary" and spec.metric in DEAL_COLUMNS and run_of[arm]:
            per_seed, labels = _deal_outcomes(session, spec, list(run_of[arm].values()))
            deals = (
                IntervalOut.of(st.deal_seed_interval(per_seed, clusters=labels))
                if per_seed
                else None
            )
        arm_scores.append(
            ArmScore(
                arm=arm,
                scores=scores[arm],
                mean=IntervalOut.of(st.seed_interval(values)),
                iqm=st.iqm(values) if values else None,
                median=float(np.median(values)) if values else None,
                deals=deals,
                runs=run_of[arm],
                change_from_start=_change(scores[arm], starts[arm]),
                sft_share=term_share(list(run_of[arm].values()), curves, SFT_SHARE),
                kl_share=term_share(list(run_of[arm].values()), curves, KL_SHARE),
            )
        )
    comparisons = []
    for a, b in combinations(arms, 2):
        key = {
            arm: {s: str(protocols[r].get("key")) for s, r in run_of[arm].items()} for arm in (a, b)
        }
        refused = sorted(s for s in set(key[a]) & set(key[b]) if key[a][s] != key[b][s])
        sa = {s: v for s, v in scores[a].items() if s not in refused}
        sb = {s: v for s, v in scores[b].items() if s not in refused}
        c = st.compare_paired(sa, sb, names=(a, b), higher_is_better=spec.higher_is_better)
        pa = [scores[a][s] for s in c.seeds]
        pb = [scores[b][s] for s in c.seeds]
        poi = (
            st.probability_of_improvement(pa, pb)
            if spec.higher_is_better
            else (st.probability_of_improvement(pb, pa))
        )
        comparisons.append(
            ComparisonOut(
                a=a,
                b=b,
                seeds=c.seeds,
                diffs=c.diffs,
                mean_diff=IntervalOut.of(c.mean_diff),
                p_value=c.p_value,
                exact=c.exact,
                verdict=c.verdict,
                winner=c.winner,
                effect_size=c.effect_size,
                seeds_for_power=c.seeds_for_power,
                p_improvement=IntervalOut.of(poi),
                runs=[run_of[a][s] for s in c.seeds] + [run_of[b][s] for s in c.seeds],
                protocol_refused=refused,
            )
        )
        if refused and not c.seeds:
            comparisons[-1].verdict = "refused: evaluated under different protocols"
        if dep := st.start_dependence(dict(zip(c.seeds, c.diffs, strict=True)), start_scores):
            comparisons[-1].start_rho, comparisons[-1].start_p = dep.rho, dep.p_value
    return MetricBlock(
        metric=spec.metric,
        label=spec.label(),
        role=role,  # type: ignore[arg-type]
        higher_is_better=spec.higher_is_better,
        arms=arm_scores,
        comparisons=comparisons,
        start=IntervalOut.of(st.seed_interval(list(start_scores.values())))
        if start_scores
        else None,
        start_scores=start_scores,
        dead_seeds=dead_seeds(arms, scores, start_scores),
    )


def dead_seeds(
    arms: list[str], scores: dict[str, dict[int, float]], starts: dict[int, float]
) -> list[int]:
    """Seeds whose start and every arm's score are 0: nothing was learnt from that start by any
    arm. They stay in the comparisons (a difference of 0 is a result) and are named beside them
    rather than averaged away."""
    return sorted(
        seed
        for seed, start in starts.items()
        if start == 0 and all(scores[arm].get(seed) == 0 for arm in arms)
    )


def start_key(metric: str) -> str | None:
    """The update-0 metric that holds ``metric``'s value at the start (before update 0)."""
    if metric.startswith("eval/"):
        return "eval_start/" + metric.removeprefix("eval/")
    return "probe_relevance_start" if metric == "probe_relevance" else None


def _change(scores: dict[int, float], starts: dict[int, float]) -> IntervalOut | None:
    seeds = sorted(set(scores) & set(starts))
    if not seeds:
        return None
    return IntervalOut.of(st.seed_interval([scores[s] - starts[s] for s in seeds]))


# services/trainer: each guidance term's share of the applied step (a metric of every update)
SFT_SHARE = "sft/grad_share"
KL_SHARE = "kl/grad_share"


def term_share(
    run_ids: list[int], curves: dict[int, dict[str, list[tuple[int, float]]]], key: str
) -> float | None:
    values = [v for r in run_ids for _, v in curves.get(r, {}).get(key, [])]
    return sum(values) / len(values) if values else None


def protocol_of(run: Run) -> dict[str, Any]:
    """The evaluation protocol a run recorded (``runs.info``), else the one its config implies
    (a run recorded before protocols were: its own env and token cap)."""
    from services.controller.evaluate import protocol_record
    from shared.schemas import RunConfig

    recorded = (run.info or {}).get("eval_protocol")
    if isinstance(recorded, dict) and recorded.get("key"):
        return recorded
    try:
        return protocol_record(RunConfig.model_validate(run.config))
    except (ValidationError, ValueError):
        return {"key": None}


def adjust_holm(groups: list[GroupReport], confirmatory: list[list[str]]) -> None:
    """Holm over each task's confirmatory comparisons of each metric (all its variants'), in
    place; a verdict then needs the adjusted p below alpha (and the interval off 0). With no
    declared family every pair of arms within a variant is confirmatory."""
    family = {frozenset(pair) for pair in confirmatory}
    tasks: dict[tuple[str, str], list[ComparisonOut]] = defaultdict(list)
    for g in groups:
        for block in [g.primary, *g.secondary]:
            for c in block.comparisons:
                c.confirmatory = not family or frozenset((c.a, c.b)) in family
                if c.confirmatory and c.p_value is not None:
                    tasks[(g.task, block.metric)].append(c)
                elif not c.confirmatory and c.winner is not None:
                    c.winner, c.verdict = None, "exploratory: outside the confirmatory family"
    for comparisons in tasks.values():
        adjusted = st.holm([float(c.p_value) for c in comparisons if c.p_value is not None])
        for c, p in zip(comparisons, adjusted, strict=True):
            c.p_holm = p
            if c.winner is not None and p >= st.ALPHA:
                c.winner = None
                n = len(c.seeds)
                c.verdict = f"not decided at {n} seed{'' if n == 1 else 's'} after Holm"


def _deal_outcomes(
    session: Session, spec: MetricSpec, run_ids: list[int]
) -> tuple[list[list[float]], list[list[str]] | None]:
    """Per run: each deal's outcome, averaged over the evaluations the score reduces; and per
    run each deal's content (the clusters of the deal-level interval; None where a task's deal
    content is not known). The start's evaluation (update -1) is no point of the curve."""
    column = getattr(EvalOutcome, DEAL_COLUMNS[spec.metric])
    rows = session.execute(
        select(
            EvalOutcome.run_id, EvalOutcome.update_idx, EvalOutcome.deal, EvalOutcome.seed, column
        ).where(EvalOutcome.run_id.in_(run_ids), EvalOutcome.update_idx >= 0)
    )
    by_run: dict[int, dict[int, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    seeds: dict[int, int] = {}
    for run_id, update, deal, seed, value in rows:
        by_run[run_id][update][deal] = float(value)
        seeds[deal] = int(seed)
    tasks = session.execute(select(Run.id, Run.task).where(Run.id.in_(run_ids))).all()
    task = next((t for _, t in tasks), "")
    out, labels = [], []
    for run_id in run_ids:
        updates = sorted(by_run.get(run_id, {}))
        if not updates:
            continue
        used = {"final": updates[-1:], "mean": updates}.get(spec.reduce, updates[-spec.k :])
        per_deal: dict[int, list[float]] = defaultdict(list)
        for u in used:
            for deal, value in by_run[run_id][u].items():
                per_deal[deal].append(value)
        out.append([sum(v) / len(v) for _, v in sorted(per_deal.items())])
        labels.append([_deal_content(task, seeds[d]) for d in sorted(per_deal)])
    known = all(k is not None for run in labels for k in run)
    return out, ([[str(k) for k in run] for run in labels] if known else None)


@lru_cache(maxsize=65_536)
def _deal_content(task: str, seed: int) -> str | None:
    """The deal evaluation seed ``seed`` deals, by content (the deal does not depend on the env
    settings); None for a task whose deal content is not known."""
    if task not in DEAL_FIELDS:
        return None
    import gymnasium as gym

    from services.env import make_env
    from services.env.points import PointsEnv
    from shared.schemas import EnvConfig

    env = make_env(task, EnvConfig(image_size=32, display_size=0), seed=seed).unwrapped
    if isinstance(env, PointsEnv):  # the cards alone: no solver, no drawing
        gym.Env.reset(env, seed=seed)
        return json.dumps([env._deal()[0]])
    _, info = env.reset()
    return deal_key(task, info["state"])


def _curve(
    arm: str,
    metric: str,
    cell_runs: dict[tuple[str, int], Run],
    curves: dict[int, dict[str, list[tuple[int, float]]]],
    less_start: str | None = None,
) -> Curve:
    """The arm's band over seeds; with ``less_start`` (the start's metric) each seed's curve
    less its own start, a seed without a start evaluation left out."""
    per_seed = {}
    for (a, seed), run in cell_runs.items():
        # a failed or cancelled run's partial curve would bend the band
        if a != arm or run.status not in (RUN_DONE, "running", "queued"):
            continue
        points = curves.get(run.id, {}).get(metric, [])
        if less_start is not None:
            begun = curves.get(run.id, {}).get(less_start, [])
            points = [(u, v - begun[0][1]) for u, v in points] if begun else []
        per_seed[seed] = points
    band = st.curve_band({s: c for s, c in per_seed.items() if c})
    return Curve(
        arm=arm,
        metric=metric,
        points=[
            CurvePointOut(update=p.update, mean=p.mean, low=p.low, high=p.high, n=p.n) for p in band
        ],
    )


def _change_curves(
    arms: list[str],
    metric: str,
    cell_runs: dict[tuple[str, int], Run],
    curves: dict[int, dict[str, list[tuple[int, float]]]],
) -> list[Curve]:
    key = start_key(metric)
    if key is None:
        return []
    out = [_curve(arm, metric, cell_runs, curves, less_start=key) for arm in arms]
    return out if any(c.points for c in out) else []


def deal_key(task: str, state: dict[str, Any]) -> str | None:
    """What identifies a deal by its content (None for a task whose deal is not known)."""
    fields = DEAL_FIELDS.get(task)
    if fields is None or any(f not in state for f in fields):
        return None
    return json.dumps([state[f] for f in fields])


def _deal_space(session: Session, task: str, runs: list[Run]) -> DealSpace:
    """The task's deal-space size, and how many evaluation deals a training episode of these
    runs also started from (compared by content, not by seed)."""

    run_ids = [r.id for r in runs]
    seeds = (
        session.execute(
            select(EvalOutcome.deal, EvalOutcome.seed)
            .where(EvalOutcome.run_id.in_(run_ids))
            .distinct()
        ).all()
        if run_ids
        else []
    )
    deals = {deal: seed for deal, seed in seeds}
    if task not in DEAL_FIELDS or not deals:
        return DealSpace(
            size=DEAL_SPACE.get(task),
            eval_episodes=len(deals),
            eval_deals=len(deals),
            in_training=None,
        )
    eval_keys = {_deal_content(task, int(seed)) for seed in set(deals.values())}
    trained = set().union(*(training_deals(session, r) for r in runs))
    seen = len(eval_keys & trained)
    return DealSpace(
        size=DEAL_SPACE.get(task),
        eval_episodes=len(deals),
        eval_deals=len(eval_keys),
        in_training=seen,
        held_out=seen == 0,
    )


def training_deals(session: Session, run: Run) -> set[str]:
    """The deals (by content) a run's training episodes started from: read from its first steps,
    or, for a run imported from a study bundle (services/study/bundle.py), which has no steps,
    from the keys the bundle carried."""
    keys = {str(k) for k in (run.info or {}).get("training_deals") or []}
    states = session.scalars(select(Step.state).where(Step.run_id == run.id, Step.idx == 0))
    keys.update(k for k in (deal_key(run.task, s or {}) for s in states) if k is not None)
    return keys


def _progress(
    study: Study, spec: StudyConfig | None, latest: dict[tuple[str, str, str, int], Run]
) -> Progress:
    """Counts over each cell's deciding run, as services/study/service.py plans them: a first
    attempt that failed is waiting for its retry, not failed."""
    counts: dict[str, int] = defaultdict(int)
    for run in latest.values():
        if run.status == "failed" and (run.study_attempt or 1) < MAX_ATTEMPTS:
            counts["waiting"] += 1
        elif run.status == SUPERSEDED:  # its cell's next attempt is due
            counts["waiting"] += 1
        else:
            counts["done" if run.status == RUN_DONE else run.status] += 1
    cells = len(spec.cells()) if spec is not None else len(latest)
    waiting = max(0, cells - len(latest)) + counts["waiting"]
    return Progress(
        cells=cells,
        waiting=waiting,
        queued=counts["queued"],
        running=counts["running"],
        done=counts["done"],
        failed=counts["failed"],
        cancelled=counts["cancelled"],
        eta_s=_eta(study, list(latest.values()), waiting),
    )


def _eta(study: Study, runs: list[Run], waiting: int) -> float | None:
    """Updates left over the observed seconds per update, runs in parallel at the concurrency."""
    now = utcnow()
    spent = updates = 0.0
    for run in runs:
        if run.started_at is None or not run.updates_done:
            continue
        end = run.finished_at or now
        start = (
            run.started_at if run.started_at.tzinfo else run.started_at.replace(tzinfo=now.tzinfo)
        )
        end = end if end.tzinfo else end.replace(tzinfo=now.tzinfo)
        spent += max(0.0, (end - start).total_seconds())
        updates += run.updates_done
    open_runs = [r for r in runs if r.status in ("queued", "running")]
    if not updates or not (open_runs or waiting):
        return 0.0 if not (open_runs or waiting) else None
    per_run = max((r.num_updates for r in runs), default=0)
    left = sum(max(0, r.num_updates - r.updates_done) for r in open_runs) + waiting * per_run
    return spent / updates * left / max(1, study.concurrency)


def _cell_run(run: Run) -> CellRun:
    return CellRun(
        run_id=run.id,
        url=f"/runs/{run.id}",
        task=run.study_task or "",
        arm=run.study_arm or "",
        variant=run.study_variant or "",
        seed=run.study_seed or 0,
        attempt=run.study_attempt or 1,
        status=run.status,
        updates_done=run.updates_done,
        num_updates=run.num_updates,
    )
