"""The statistics of a study: pure functions on numbers (no database, no torch).

The unit of independence is the seed: one run gives one score per arm (its declared primary
metric), and arms of a task share seeds, so two arms are compared on the per-seed differences
of the seeds both finished. Following Agarwal et al. (2021, "Deep RL at the Edge of the
Statistical Precipice"): interval estimates from a percentile bootstrap over seeds, the
interquartile mean beside the mean, and the probability of improvement. The verdict of a
comparison needs both an exact sign-flip permutation p below alpha and a bootstrap interval of
the mean difference that excludes 0; the smallest two-sided p of n seeds is 2/2^n, so no
verdict is possible below 6 seeds at alpha = 0.05.

Every random draw comes from a fixed seed, so a report reads the same on every load.
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

import numpy as np

# scipy.stats and statsmodels are imported where they are used: together they take seconds to
# import, and a CLI that prints a kept report (services/study/kept.py) computes nothing here.

CONFIDENCE = 0.95
ALPHA = 0.05
POWER = 0.8
N_RESAMPLES = 10_000
RNG_SEED = 20_211_206  # fixed: the same data gives the same interval on every page load
# Beyond this many sign patterns the permutation test samples them instead of enumerating.
MAX_EXACT_PATTERNS = 2**16

Values = Sequence[float] | np.ndarray  # per-seed numbers
Statistic = Literal["mean", "iqm", "median"]
Method = Literal["percentile", "BCa"]


@dataclass(frozen=True)
class Interval:
    """A point estimate with its confidence interval; low/high are None when n < 2."""

    point: float | None  # the statistic on the data (None without data)
    low: float | None  # lower bound of the interval
    high: float | None  # upper bound of the interval
    n: int  # how many independent values (seeds) it rests on
    confidence: float = CONFIDENCE

    @property
    def width(self) -> float | None:
        return None if self.low is None or self.high is None else self.high - self.low


@dataclass(frozen=True)
class Comparison:
    """Arm A against arm B on the seeds both have a score for (A − B per seed)."""

    a: str  # name of arm A
    b: str  # name of arm B
    seeds: list[int]  # the shared seeds, sorted
    diffs: list[float]  # A − B on each shared seed, in the order of `seeds`
    mean_diff: Interval  # mean paired difference with its bootstrap interval over seeds
    p_value: float | None  # two-sided sign-flip permutation p (None below 1 seed)
    exact: bool  # whether every sign pattern was enumerated (else sampled)
    verdict: str  # "A > B", "B > A" (with the arms' names) or "not decided at N seeds"
    winner: str | None  # the better arm's name when decided, else None
    effect_size: float | None  # mean / standard deviation of the differences (Cohen's d_z)
    seeds_for_power: int | None  # seeds the observed effect needs for the power and alpha
    alpha: float = ALPHA
    power: float = POWER
    dropped: dict[str, list[int]] = field(default_factory=dict)  # arm -> seeds without a pair


@dataclass(frozen=True)
class CurvePoint:
    """One update of a learning curve: the mean over seeds with its band."""

    update: int
    mean: float
    low: float | None  # None when only one seed reached this update
    high: float | None
    n: int  # seeds with a value at this update


def _rng(seed: int = RNG_SEED) -> np.random.Generator:
    return np.random.default_rng(seed)


def _clean(values: Values) -> np.ndarray:
    arr = np.asarray(list(values), dtype=float)
    if not np.all(np.isfinite(arr)):
        raise ValueError("statistics need finite numbers (got NaN or infinity)")
    return arr


def iqm(values: Values) -> float:
    """Interquartile mean: the mean of the middle 50 % (a quarter trimmed from each end)."""
    from scipy import stats

    arr = _clean(values)
    if arr.size == 0:
        raise ValueError("iqm of no values")
    return float(stats.trim_mean(arr, 0.25))


def _statistic(name: Statistic):  # noqa: ANN202 - a vectorised numpy reducer
    from scipy import stats

    if name == "mean":
        return np.mean
    if name == "median":
        return np.median
    if name == "iqm":
        return lambda x, axis=-1: stats.trim_mean(x, 0.25, axis=axis)
    raise ValueError(f"unknown statistic {name!r} (mean, iqm or median)")


def seed_interval(
    values: Values,
    confidence: float = CONFIDENCE,
    statistic: Statistic = "mean",
    method: Method = "percentile",
    n_resamples: int = N_RESAMPLES,
    seed: int = RNG_SEED,
) -> Interval:
    """The statistic of per-seed scores with a bootstrap interval over seeds.

    Percentile by default: BCa's acceleration is unstable with the 3-10 seeds of a study.
    All-equal values give a zero-width interval (every resample is the same).
    """
    from scipy import stats

    arr = _clean(values)
    fn = _statistic(statistic)
    if arr.size == 0:
        return Interval(None, None, None, 0, confidence)
    point = float(fn(arr))
    if arr.size < 2:
        return Interval(point, None, None, 1, confidence)
    if np.ptp(arr) == 0:
        return Interval(point, point, point, int(arr.size), confidence)
    res = stats.bootstrap(
        (arr,),
        fn,
        confidence_level=confidence,
        n_resamples=n_resamples,
        method=method,
        vectorized=True,
        rng=_rng(seed),
    )
    ci = res.confidence_interval
    return Interval(point, float(ci.low), float(ci.high), int(arr.size), confidence)


def deal_seed_interval(
    per_seed_deal_outcomes: Sequence[Sequence[float]],
    confidence: float = CONFIDENCE,
    n_resamples: int = 4_000,
    seed: int = RNG_SEED,
    clusters: Sequence[Sequence[str]] | None = None,
) -> Interval:
    """Mean over seeds of each seed's mean deal outcome, with a two-level bootstrap interval.

    Each resample draws seeds with replacement, then, for every drawn seed, its deals with
    replacement: the interval holds both the seed-to-seed spread and each evaluation's own
    finite-deal (binomial) error. Seeds may have different deal counts. ``clusters`` (per seed,
    each episode's deal by content): episodes of one deal are not independent, so the inner
    draw takes distinct deals with replacement, each with all its episodes (a clustered
    bootstrap: the mean over the drawn deals' episodes).
    """
    groups = [_clean(g) for g in per_seed_deal_outcomes]
    if any(g.size == 0 for g in groups):
        raise ValueError("a seed without deal outcomes")
    if clusters is not None:
        return _clustered(groups, clusters, confidence, n_resamples, seed)
    n = len(groups)
    if n == 0:
        return Interval(None, None, None, 0, confidence)
    point = float(np.mean([g.mean() for g in groups]))
    if n == 1 and groups[0].size < 2:
        return Interval(point, None, None, 1, confidence)
    rng = _rng(seed)
    picks = rng.integers(0, n, size=(n_resamples, n))  # (B, S): seeds drawn per resample
    inner = np.empty((n_resamples, n))
    for j in range(n):
        for s, g in enumerate(groups):
            rows = np.flatnonzero(picks[:, j] == s)
            if rows.size:
                draw = rng.integers(0, g.size, size=(rows.size, g.size))
                inner[rows, j] = g[draw].mean(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(inner.mean(axis=1), [tail, 100 - tail])
    return Interval(point, float(low), float(high), n, confidence)


def _clustered(
    groups: list[np.ndarray],
    clusters: Sequence[Sequence[str]],
    confidence: float,
    n_resamples: int,
    seed: int,
) -> Interval:
    sums, counts = [], []
    for g, labels in zip(groups, clusters, strict=True):
        if len(labels) != g.size:
            raise ValueError("a cluster label per deal outcome")
        _, inverse = np.unique(np.asarray(labels), return_inverse=True)
        sums.append(np.bincount(inverse, weights=g))
        counts.append(np.bincount(inverse).astype(float))
    n = len(groups)
    point = float(np.mean([g.mean() for g in groups]))
    if n == 1 and sums[0].size < 2:
        return Interval(point, None, None, 1, confidence)
    rng = _rng(seed)
    picks = rng.integers(0, n, size=(n_resamples, n))
    inner = np.empty((n_resamples, n))
    for j in range(n):
        for s in range(n):
            rows = np.flatnonzero(picks[:, j] == s)
            if rows.size:
                draw = rng.integers(0, sums[s].size, size=(rows.size, sums[s].size))
                inner[rows, j] = sums[s][draw].sum(axis=1) / counts[s][draw].sum(axis=1)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(inner.mean(axis=1), [tail, 100 - tail])
    return Interval(point, float(low), float(high), n, confidence)


def sign_flip_p(diffs: Values, max_exact: int = MAX_EXACT_PATTERNS) -> tuple[float, bool]:
    """Two-sided p of the mean paired difference under random sign flips, and whether exact.

    Under the null (A and B interchangeable on each seed) each difference's sign is a fair
    coin; the p is the share of the 2^n patterns whose |mean| reaches the observed one.
    """
    from scipy import stats

    arr = _clean(diffs)
    if arr.size == 0:
        raise ValueError("a sign-flip test needs at least one difference")
    if arr.size == 1:  # both patterns (d, -d) reach |d|; scipy wants two observations
        return 1.0, True
    exact = 2**arr.size <= max_exact
    res = stats.permutation_test(
        (arr,),
        np.mean,
        permutation_type="samples",
        vectorized=True,
        n_resamples=np.inf if exact else 100_000,
        batch=8_192,  # bounded memory with many seeds
        alternative="two-sided",
        rng=_rng(),
    )
    return float(res.pvalue), exact


def min_seeds_for_alpha(alpha: float = ALPHA) -> int:
    """The fewest seeds whose smallest two-sided sign-flip p (2/2^n) is below alpha."""
    n = 1
    while 2 / 2**n >= alpha:
        n += 1
    return n


def seeds_for_power(effect_size: float, alpha: float = ALPHA, power: float = POWER) -> float | None:
    """Seeds a paired t-test needs to detect `effect_size` (mean/sd of differences).

    From the noncentral t (statsmodels' TTestPower, two-sided); None for no effect. Effects
    above 5 standard deviations leave the solver's bracket (2-3 seeds reach any usual power):
    there the fewest whole seeds whose power reaches `power` are counted directly.
    """
    from statsmodels.stats.power import TTestPower
    from statsmodels.tools.sm_exceptions import ConvergenceWarning

    if not math.isfinite(effect_size) or effect_size == 0:
        return None
    es, solver = abs(effect_size), TTestPower()
    if es <= 5:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)  # a nan result is checked below
            nobs = float(np.squeeze(solver.solve_power(es, nobs=None, alpha=alpha, power=power)))
        if math.isfinite(nobs) and nobs > 0:
            return nobs
    for n in range(2, 100):
        reached = float(solver.power(es, nobs=n, alpha=alpha))
        if not math.isfinite(reached) or reached >= power:  # nan: the noncentral t overflows at ~1
            return float(n)
    return None


POWER_SIMULATIONS = 400  # simulated studies per seed count (the power is an estimate)
POWER_MAX_SEEDS = 40  # beyond this, "more than 40"
POWER_PATTERNS = 4_096  # sign patterns per simulated study above 12 seeds (sampled)


def sign_flip_power(
    mean: float, sd: float, n: int, alpha: float = ALPHA, sims: int = POWER_SIMULATIONS
) -> float:
    """Estimated power of the two-sided sign-flip test at n seeds when the paired differences
    are normal with the observed mean and sd: the share of simulated studies whose sign-flip p
    is below alpha (every pattern enumerated up to 12 seeds, POWER_PATTERNS sampled above)."""
    if n < min_seeds_for_alpha(alpha):
        return 0.0
    rng = _rng()
    diffs = rng.normal(mean, sd, size=(sims, n))
    if n <= 12:
        signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
    else:
        signs = rng.choice([-1, 1], size=(POWER_PATTERNS, n))
    observed = np.abs(diffs.mean(axis=1))  # (sims,)
    flipped = np.abs(signs @ diffs.T) / n  # (patterns, sims)
    p = (flipped >= observed[None, :] - 1e-12).mean(axis=0)
    return float((p < alpha).mean())


@lru_cache(maxsize=4096)
def sign_flip_seeds_for_power(
    mean: float, sd: float, alpha: float = ALPHA, power: float = POWER
) -> int | None:
    """The fewest seeds at which the sign-flip test, the one the verdicts use, reaches `power`
    against differences like the observed ones (normal, their mean and sd): an estimate from a
    few noisy runs. None when no effect was observed or more than POWER_MAX_SEEDS are needed."""
    if mean == 0 or not math.isfinite(mean) or not math.isfinite(sd):
        return None
    floor = min_seeds_for_alpha(alpha)
    if sd == 0:
        return floor
    # The t-test's n is a near lower bound (the permutation test is a little less powerful).
    guess = seeds_for_power(mean / sd, alpha, power)
    start = max(floor, math.ceil(guess) - 1 if guess is not None else floor)
    for n in range(min(start, POWER_MAX_SEEDS), POWER_MAX_SEEDS + 1):
        if sign_flip_power(mean, sd, n, alpha) >= power:
            return n
    return None


def holm(p_values: Sequence[float], alpha: float = ALPHA) -> list[float]:
    """Holm's step-down adjustment of a family of p-values (statsmodels' multipletests), in
    the order given: the family-wise error of verdicts on the adjusted p stays below alpha."""
    if not p_values:
        return []
    from statsmodels.stats.multitest import multipletests

    # statsmodels' Holm calls gc.collect(): with the objects alive now frozen out of the
    # collector's reach, that costs microseconds instead of a walk over the whole heap.
    gc.freeze()
    try:
        adjusted = multipletests(list(p_values), alpha=alpha, method="holm")[1]
    finally:
        gc.unfreeze()
    return [float(x) for x in adjusted]


def _seeds_needed(diffs: np.ndarray, alpha: float, power: float) -> tuple[float | None, int | None]:
    """Effect size d_z and the seeds the sign-flip test needs at 80 % power against
    differences like the observed ones (``sign_flip_seeds_for_power``: an estimate)."""
    if diffs.size < 2:
        return None, None
    mean, sd = float(diffs.mean()), float(diffs.std(ddof=1))
    if mean == 0:
        return 0.0, None
    if sd == 0:
        return None, min_seeds_for_alpha(alpha)
    return mean / sd, sign_flip_seeds_for_power(mean, sd, alpha, power)


def compare_paired(
    a: Mapping[int, float],
    b: Mapping[int, float],
    names: tuple[str, str] = ("A", "B"),
    alpha: float = ALPHA,
    confidence: float = CONFIDENCE,
    power: float = POWER,
    higher_is_better: bool = True,
) -> Comparison:
    """Compare two arms on their shared seeds (seed -> score), A − B.

    Verdict: "A > B" (or "B > A") only when the sign-flip p < alpha AND the bootstrap interval
    of the mean difference excludes 0; otherwise "not decided at N seeds". ">" reads "better
    than": for a metric where lower is better (`higher_is_better=False`) an interval below 0
    makes A the better arm.
    """
    seeds = sorted(set(a) & set(b))
    diffs = _clean([a[s] - b[s] for s in seeds])
    dropped = {
        names[0]: sorted(set(a) - set(b)),
        names[1]: sorted(set(b) - set(a)),
    }
    interval = seed_interval(diffs, confidence)
    p, exact = sign_flip_p(diffs) if diffs.size else (None, True)
    effect, needed = _seeds_needed(diffs, alpha, power)
    winner = None
    if p is not None and p < alpha and interval.low is not None and interval.high is not None:
        if interval.low > 0:
            winner = names[0] if higher_is_better else names[1]
        elif interval.high < 0:
            winner = names[1] if higher_is_better else names[0]
    if winner is None:
        verdict = f"not decided at {len(seeds)} seed{'' if len(seeds) == 1 else 's'}"
    else:
        loser = names[1] if winner == names[0] else names[0]
        verdict = f"{winner} > {loser}"
    return Comparison(
        a=names[0],
        b=names[1],
        seeds=seeds,
        diffs=[float(x) for x in diffs],
        mean_diff=interval,
        p_value=p,
        exact=exact,
        verdict=verdict,
        winner=winner,
        effect_size=effect,
        seeds_for_power=needed,
        alpha=alpha,
        power=power,
        dropped={k: v for k, v in dropped.items() if v},
    )


def _poi(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    """P(X > Y) + P(X = Y)/2 over all pairs: the Mann-Whitney U of x over (nx * ny)."""
    from scipy import stats

    u = stats.mannwhitneyu(x, y, axis=axis).statistic
    return np.asarray(u) / (x.shape[axis] * y.shape[axis])


def probability_of_improvement(
    a: Values,
    b: Values,
    confidence: float = CONFIDENCE,
    n_resamples: int = 4_000,
    seed: int = RNG_SEED,
) -> Interval:
    """P(a run of A scores above a run of B), ties counted half, with a bootstrap interval
    (each arm's seeds resampled on their own). A claim of improvement wants low > 0.5."""
    from scipy import stats

    x, y = _clean(a), _clean(b)
    if x.size == 0 or y.size == 0:
        return Interval(None, None, None, min(x.size, y.size), confidence)
    point = float(_poi(x, y))
    n = min(x.size, y.size)
    if n < 2:
        return Interval(point, None, None, n, confidence)
    if np.ptp(np.concatenate([x, y])) == 0:
        return Interval(point, point, point, n, confidence)
    res = stats.bootstrap(
        (x, y),
        _poi,
        confidence_level=confidence,
        n_resamples=n_resamples,
        method="percentile",
        vectorized=True,
        rng=_rng(seed),
    )
    ci = res.confidence_interval
    return Interval(point, float(ci.low), float(ci.high), n, confidence)


@dataclass(frozen=True)
class StartDependence:
    """Whether a paired difference moves with the seed's start: Spearman's rank correlation over
    seeds between the start's score and A − B. A study whose warm start varies between seeds
    reads a verdict as "independent of the start" only where this is weak; a strong rho says
    the difference belongs to some starts (e.g. only seeds that start above 0)."""

    rho: float  # Spearman's rho, -1..1
    p_value: float  # two-sided, scipy's (exact permutation distribution for small n)
    n: int  # seeds with both a start and a difference


def start_dependence(
    diffs: Mapping[int, float], starts: Mapping[int, float]
) -> StartDependence | None:
    """Spearman's rho of (start, A − B) over the seeds that have both; None below 3 seeds or
    when either side is constant (a rank correlation is undefined there)."""
    from scipy import stats

    seeds = sorted(set(diffs) & set(starts))
    x = np.array([starts[s] for s in seeds], dtype=float)
    y = np.array([diffs[s] for s in seeds], dtype=float)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    if x.size < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return None
    rho = float(stats.spearmanr(x, y).statistic)
    # A permutation p (exact up to 7 seeds, 10,000 fixed-seed pairings beyond): spearmanr's
    # t approximation misleads at a study's 8-10 seeds.
    ry = stats.rankdata(y)
    ry = (ry - ry.mean()) / np.linalg.norm(ry - ry.mean())

    def rho_of(xs: np.ndarray, axis: int = -1) -> np.ndarray:  # Pearson's r of the ranks
        rx = stats.rankdata(xs, axis=axis)
        rx = rx - rx.mean(axis=axis, keepdims=True)
        return np.sum(rx * ry, axis=axis) / np.linalg.norm(rx, axis=axis)

    res = stats.permutation_test(
        (x,), rho_of, permutation_type="pairings", n_resamples=10_000, vectorized=True, rng=_rng()
    )
    return StartDependence(rho, float(res.pvalue), int(x.size))


def curve_band(
    per_seed_curves: Mapping[int, Sequence[tuple[int, float]]],
    confidence: float = CONFIDENCE,
    n_resamples: int = 2_000,
    seed: int = RNG_SEED,
) -> list[CurvePoint]:
    """Mean learning curve over seeds with a percentile-bootstrap band at each update.

    per_seed_curves: seed -> [(update, value)]. An update's point uses the seeds that reached
    it (runs of a study may be at different updates); one seed gives no band.
    """
    from scipy import stats

    at: dict[int, dict[int, float]] = {}
    for s, curve in per_seed_curves.items():
        for update, value in curve:
            if math.isfinite(value):
                at.setdefault(int(update), {})[s] = float(value)
    # Updates reached by the same seeds share one vectorised bootstrap (usually all of them).
    groups: dict[tuple[int, ...], list[int]] = {}
    for update, by_seed in at.items():
        groups.setdefault(tuple(sorted(by_seed)), []).append(update)
    out: list[CurvePoint] = []
    for seeds, updates in groups.items():
        data = np.array([[at[u][s] for u in updates] for s in seeds])  # (seeds, updates)
        means = data.mean(axis=0)
        lows: list[float | None] = [None] * len(updates)
        highs: list[float | None] = [None] * len(updates)
        if len(seeds) >= 2:
            res = stats.bootstrap(
                (data,),
                np.mean,
                axis=0,
                confidence_level=confidence,
                n_resamples=n_resamples,
                method="percentile",
                vectorized=True,
                rng=_rng(seed),
            )
            flat = np.ptp(data, axis=0) == 0  # every resample equal: the band is the mean
            lo = np.where(flat, means, res.confidence_interval.low)
            hi = np.where(flat, means, res.confidence_interval.high)
            lows, highs = [float(v) for v in lo], [float(v) for v in hi]
        out += [
            CurvePoint(u, float(m), lo_, hi_, len(seeds))
            for u, m, lo_, hi_ in zip(updates, means, lows, highs, strict=True)
        ]
    return sorted(out, key=lambda p: p.update)
