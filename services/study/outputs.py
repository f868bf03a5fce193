"""The pieces of a study's report that more than one module builds (services/study/report.py,
services/study/questions.py): an interval, and a paired comparison of two arms, as shown."""

from __future__ import annotations

from pydantic import BaseModel, Field

from services.study import statistics as st


class IntervalOut(BaseModel):
    point: float | None = Field(description="The statistic on the data")
    low: float | None = Field(description="Lower bound of the 95 % interval (None below 2)")
    high: float | None = Field(description="Upper bound of the 95 % interval")
    n: int = Field(description="Independent values (seeds) it rests on")

    @classmethod
    def of(cls, iv: st.Interval) -> IntervalOut:
        return cls(point=iv.point, low=iv.low, high=iv.high, n=iv.n)


class ComparisonOut(BaseModel):
    a: str = Field(description="Arm A")
    b: str = Field(description="Arm B")
    seeds: list[int] = Field(description="Seeds both arms finished")
    diffs: list[float] = Field(description="A - B per shared seed")
    mean_diff: IntervalOut = Field(description="Mean paired difference A - B with its interval")
    p_value: float | None = Field(description="Two-sided sign-flip permutation p (raw)")
    p_holm: float | None = Field(
        None,
        description="Holm-adjusted p over the task's confirmatory comparisons of this metric "
        "(statsmodels multipletests); the verdict rests on it. None: not confirmatory",
    )
    confirmatory: bool = Field(True, description="In the study's declared confirmatory family")
    protocol_refused: list[int] = Field(
        default_factory=list,
        description="Seeds not paired: A's and B's runs were evaluated under different protocols",
    )
    exact: bool = Field(description="Every sign pattern enumerated (else 100,000 sampled)")
    verdict: str = Field(description="'A > B' (A better), 'B > A', or 'not decided at N seeds'")
    winner: str | None = Field(description="The better arm when decided")
    effect_size: float | None = Field(description="Mean / sd of the differences (d_z)")
    seeds_for_power: int | None = Field(
        description="Estimate: seeds at which the sign-flip test reaches 80 % power against "
        "differences like the observed ones (normal, their mean and sd). None: no difference "
        "observed (effect_size 0 or None), or more than 40 seeds (a non-zero effect_size)"
    )
    p_improvement: IntervalOut = Field(description="P(a run of A beats a run of B)")
    runs: list[int] = Field(description="Run ids of both arms on the shared seeds")
    start_rho: float | None = Field(
        None,
        description="Spearman's rho over seeds between the seed's start (before update 0) and "
        "A - B: whether the difference depends on where the seed started. None: under 3 seeds "
        "with a start, or either side constant",
    )
    start_p: float | None = Field(None, description="Two-sided permutation p of start_rho")
