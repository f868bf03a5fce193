"""The study's declared questions beyond its verdict table, answered from the same stored rows.

- **The axis** (`axis` in the study file): arm A against arm B on the primary metric at each
  variant, the variants ordered by the level their runs measured (study v3: GTR - SFT-only at
  each corrector level, ordered by the corrector accuracy each level's runs actually got), and
  between which measured levels the difference changes sign, or that it keeps its sign over the
  whole tested range. Each level's difference is the group's own paired comparison, with its
  interval and verdict: a sign change between two undecided levels is a lead, not a finding.
- **Trends** (`trends`): whether an arm's metric falls (or rises) in every run, the run's score
  against the first point it recorded (v3: RL4VLM's probe relevance, thought collapse).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, Field

from services.study import statistics as st
from services.study.outputs import ComparisonOut, IntervalOut
from services.study.schemas import StudyConfig
from shared.db.models import Run

Curves = dict[int, dict[str, list[tuple[int, float]]]]
# Per group: task, variant, its finished runs by (arm, seed), and its primary comparison of the
# axis's arms oriented A - B (None where they have no comparison).
Grouped = list[tuple[str, str, dict[tuple[str, int], Run], ComparisonOut | None]]


class AxisPoint(BaseModel):
    variant: str
    level: IntervalOut = Field(description="The level its runs of A and B measured, over seeds")
    diff: IntervalOut | None = Field(description="Mean paired A - B on the primary metric")
    verdict: str = Field(description="That comparison's verdict")


class AxisReport(BaseModel):
    task: str
    a: str
    b: str
    level_metric: str = Field(description="The level's metric and reduction")
    points: list[AxisPoint] = Field(description="One per variant, by measured level")
    statement: str = Field(description="Where A - B changes sign, in one sentence")


class TrendRun(BaseModel):
    run_id: int
    seed: int
    variant: str
    first: float = Field(description="The first point the run recorded")
    score: float = Field(description="The run's score (the metric reduced as declared)")
    holds: bool


class TrendReport(BaseModel):
    task: str
    arm: str
    metric: str = Field(description="The metric and its reduction")
    direction: Literal["falls", "rises"]
    runs: list[TrendRun]
    statement: str = Field(description="e.g. 'falls in 5 of 6 runs (not at seed 3)'")


def axis_reports(spec: StudyConfig | None, grouped: Grouped, curves: Curves) -> list[AxisReport]:
    """One per task: A - B at each variant, ordered by the level measured there."""
    if spec is None or spec.axis is None:
        return []
    ax = spec.axis
    out = []
    for task in spec.tasks:
        points = []
        for g_task, variant, done, comparison in grouped:
            if g_task != task or not variant:
                continue
            per_seed: dict[int, list[float]] = {}
            for (arm, seed), run in done.items():
                if arm in (ax.a, ax.b):
                    value = ax.level.score(curves.get(run.id, {}).get(ax.level.metric, []))
                    if value is not None:
                        per_seed.setdefault(seed, []).append(value)
            levels = [sum(v) / len(v) for _, v in sorted(per_seed.items())]
            points.append(
                AxisPoint(
                    variant=variant,
                    level=IntervalOut.of(st.seed_interval(levels)),
                    diff=comparison.mean_diff if comparison is not None else None,
                    verdict=comparison.verdict if comparison is not None else "no runs to compare",
                )
            )
        points.sort(key=lambda p: (p.level.point is None, p.level.point or 0.0))
        out.append(
            AxisReport(
                task=task,
                a=ax.a,
                b=ax.b,
                level_metric=ax.level.label(),
                points=points,
                statement=sign_statement(ax.a, ax.b, ax.level.metric, points),
            )
        )
    return out


def sign_statement(a: str, b: str, level: str, points: list[AxisPoint]) -> str:
    """Between which measured levels the mean of A − B changes sign, or that it does not, and
    at which levels the comparison is decided. A level where the mean difference is exactly 0
    is a tie, named as such: it neither keeps nor changes the sign."""
    known = [
        p
        for p in points
        if p.level.point is not None and p.diff is not None and p.diff.point is not None
    ]
    if len(known) < 2:
        return f"{a} − {b}: fewer than two levels measured, no sign change can be placed"
    lo, hi = known[0].level.point, known[-1].level.point
    tail = _decided_at(known)
    ties = [f"{p.level.point:.2f}" for p in known if p.diff.point == 0]  # type: ignore[union-attr]
    tied = f"; tied at {', '.join(ties)}" if ties else ""
    signed = [p for p in known if p.diff.point != 0]  # type: ignore[union-attr]
    if not signed:
        return f"The mean {a} − {b} is 0 at every measured {level}{tail}"
    changes = [
        f"{x.level.point:.2f} ({x.diff.point:+.3f}) and {y.level.point:.2f} ({y.diff.point:+.3f})"  # type: ignore[union-attr]
        for x, y in zip(signed, signed[1:], strict=False)
        if _sign(x.diff.point) != _sign(y.diff.point)  # type: ignore[union-attr, arg-type]
    ]
    if not changes:
        word = "positive" if signed[0].diff.point > 0 else "negative"  # type: ignore[union-attr, operator]
        where = " where it is not 0" if ties else ""
        return (
            f"The mean {a} − {b} is {word} at every measured {level} from {lo:.2f} to {hi:.2f}"
            f"{where}: no sign change within the tested range{tied}{tail}"
        )
    return (
        f"The mean {a} − {b} changes sign between {level} "
        + "; and between ".join(changes)
        + tied
        + tail
    )


def _decided_at(known: list[AxisPoint]) -> str:
    """' (decided at 0.69 and 1.00; not at 0.30)': which levels' comparisons have a verdict."""
    done = [f"{p.level.point:.2f}" for p in known if not p.verdict.startswith("not decided")]
    left = [f"{p.level.point:.2f}" for p in known if p.verdict.startswith("not decided")]
    if not done:
        return " (decided at no level)"
    if not left:
        return " (decided at every level)"
    return f" (decided at {_and(done)}; not at {_and(left)})"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def trend_reports(spec: StudyConfig | None, grouped: Grouped, curves: Curves) -> list[TrendReport]:
    """One per task and declared trend: the arm's runs, each checked on its own."""
    if spec is None:
        return []
    out = []
    for trend in spec.trends:
        for task in spec.tasks:
            runs = _runs_of(trend.arm, (done for t, _, done, _ in grouped if t == task))
            checked = []
            for run in runs:
                curve = sorted(curves.get(run.id, {}).get(trend.metric.metric, []))
                score = trend.metric.score(curve)
                if not curve or score is None:
                    continue
                first = curve[0][1]
                holds = score < first if trend.direction == "falls" else score > first
                checked.append(
                    TrendRun(
                        run_id=run.id,
                        seed=run.study_seed or 0,
                        variant=run.study_variant or "",
                        first=first,
                        score=score,
                        holds=holds,
                    )
                )
            out.append(
                TrendReport(
                    task=task,
                    arm=trend.arm,
                    metric=trend.metric.label(),
                    direction=trend.direction,
                    runs=checked,
                    statement=_trend_statement(trend.direction, checked),
                )
            )
    return out


def _runs_of(arm: str, groups: Iterable[dict[tuple[str, int], Run]]) -> list[Run]:
    """The arm's finished runs over a task's groups, each once (a shared arm's run is in every
    variant's group), in seed order."""
    seen: dict[int, Run] = {}
    for done in groups:
        for (a, _), run in done.items():
            if a == arm:
                seen[run.id] = run
    return sorted(seen.values(), key=lambda r: (r.study_seed or 0, r.study_variant or ""))


def _trend_statement(direction: str, runs: list[TrendRun]) -> str:
    if not runs:
        return "is not recorded by any finished run yet"
    held = sum(r.holds for r in runs)
    out = f"{direction} in {held} of {len(runs)} runs"
    if held < len(runs):
        out += " (not at " + ", ".join(_where(r) for r in runs if not r.holds) + ")"
    return out


def _where(r: TrendRun) -> str:
    return f"seed {r.seed}" + (f" {r.variant}" if r.variant else "")


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)
