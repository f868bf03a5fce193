"""The study statistics against values computed by hand, or by scipy called another way."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import stats

from services.study.statistics import (
    compare_paired,
    curve_band,
    deal_seed_interval,
    holm,
    iqm,
    min_seeds_for_alpha,
    probability_of_improvement,
    seed_interval,
    seeds_for_power,
    sign_flip_p,
    sign_flip_power,
    sign_flip_seeds_for_power,
    start_dependence,
)


def hand_sign_flip_p(diffs: list[float]) -> float:
    """Share of all 2^n sign patterns whose |mean| reaches the observed |mean|."""
    observed = abs(sum(diffs) / len(diffs))
    patterns = list(itertools.product((1, -1), repeat=len(diffs)))
    hits = sum(
        abs(sum(s * d for s, d in zip(signs, diffs, strict=True)) / len(diffs)) >= observed - 1e-12
        for signs in patterns
    )
    return hits / len(patterns)


def exact_bootstrap_quantiles(values: list[float], probs: list[float]) -> list[float]:
    """Quantiles of the mean over all n^n equally likely resamples (the exact bootstrap)."""
    means = sorted(sum(r) / len(r) for r in itertools.product(values, repeat=len(values)))
    return [means[min(len(means) - 1, int(p * len(means)))] for p in probs]


def paired_t_power(d: float, n: int, alpha: float = 0.05) -> float:
    """Two-sided paired t-test power from the noncentral t, written out."""
    crit = stats.t.ppf(1 - alpha / 2, n - 1)
    nc = d * math.sqrt(n)
    lower = stats.nct.cdf(-crit, n - 1, nc)  # ~0 for a positive effect (nan where it underflows)
    return float(stats.nct.sf(crit, n - 1, nc) + np.nan_to_num(lower))


# ---- sign-flip p ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "diffs",
    [
        [0.1, 0.3, -0.05, 0.2, 0.15],
        [0.4, -0.2, 0.1, -0.3, 0.05, 0.25, 0.0],
        [-1.0, -2.0, 0.5],
        [0.0625, 0.125, -0.0625, 0.25, 0.1875, -0.125, 0.3125, 0.0625],
    ],
)
def test_sign_flip_p_equals_the_enumeration_of_every_sign_pattern(diffs: list[float]) -> None:
    p, exact = sign_flip_p(diffs)
    assert exact
    assert p == pytest.approx(hand_sign_flip_p(diffs), abs=1e-12)


@pytest.mark.parametrize("n, smallest", [(3, 0.25), (5, 0.0625), (8, 2 / 256)])
def test_smallest_two_sided_p_of_n_seeds_is_two_over_two_to_the_n(n: int, smallest: float) -> None:
    diffs = [0.1 * (i + 1) for i in range(n)]  # all one sign: only the two extreme patterns tie
    assert sign_flip_p(diffs)[0] == pytest.approx(smallest)
    assert sign_flip_p([-d for d in diffs])[0] == pytest.approx(smallest)


def test_fewest_seeds_that_can_reach_alpha() -> None:
    assert min_seeds_for_alpha(0.05) == 6  # 2/32 = 0.0625 >= 0.05 > 2/64
    assert min_seeds_for_alpha(0.01) == 8  # 2/128 = 0.0156 >= 0.01 > 2/256


# ---- intervals --------------------------------------------------------------------------------


def test_two_seed_percentile_interval_is_the_range() -> None:
    # Resampled means of [0, 1]: 0 (1/4), 0.5 (1/2), 1 (1/4): the 2.5 % and 97.5 % points are 0, 1.
    iv = seed_interval([0.0, 1.0])
    assert (iv.point, iv.low, iv.high, iv.n) == (0.5, 0.0, 1.0, 2)


def test_seed_interval_matches_the_exact_bootstrap_distribution() -> None:
    values = [0.2, 0.35, 0.5, 0.9, 0.4]  # 5^5 = 3125 resamples enumerated
    iv = seed_interval(values)
    # The 10,000 random resamples put each bound between nearby exact quantiles.
    lo_a, lo_b, hi_a, hi_b = exact_bootstrap_quantiles(values, [0.018, 0.032, 0.968, 0.982])
    assert iv.point == pytest.approx(np.mean(values))
    assert lo_a <= iv.low <= lo_b
    assert hi_a <= iv.high <= hi_b


def test_seed_interval_of_many_seeds_approaches_the_normal_interval() -> None:
    values = list(np.random.default_rng(7).normal(0.6, 0.1, size=400))
    iv = seed_interval(values)
    half = 1.959964 * np.std(values, ddof=1) / math.sqrt(len(values))
    assert iv.low == pytest.approx(np.mean(values) - half, abs=0.002)
    assert iv.high == pytest.approx(np.mean(values) + half, abs=0.002)


def test_seed_interval_edge_cases() -> None:
    assert seed_interval([]).point is None
    one = seed_interval([0.7])
    assert (one.point, one.low, one.high, one.n) == (0.7, None, None, 1)
    same = seed_interval([0.5, 0.5, 0.5])
    assert (same.low, same.high) == (0.5, 0.5)
    with pytest.raises(ValueError, match="finite"):
        seed_interval([0.1, float("nan")])


def test_iqm_is_the_mean_of_the_middle_half() -> None:
    assert iqm([1, 2, 3, 4, 5, 6, 7, 100]) == pytest.approx((3 + 4 + 5 + 6) / 4)
    iv = seed_interval([1, 2, 3, 4, 5, 6, 7, 100], statistic="iqm")
    assert iv.point == pytest.approx(4.5)
    mean = seed_interval([1, 2, 3, 4, 5, 6, 7, 100])
    assert iv.width < mean.width  # one outlier seed moves the IQM less than the mean


def test_deal_interval_of_one_seed_is_the_binomial_interval() -> None:
    deals = [1.0] * 26 + [0.0] * 38  # 64 deals, p = 0.406: se = sqrt(p(1-p)/64) = 0.061
    iv = deal_seed_interval([deals])
    p = 26 / 64
    half = 1.959964 * math.sqrt(p * (1 - p) / 64)
    assert iv.point == pytest.approx(p)
    assert iv.low == pytest.approx(p - half, abs=0.02)
    assert iv.high == pytest.approx(p + half, abs=0.02)


def test_deal_interval_without_deal_noise_is_the_seed_interval() -> None:
    # Each seed's deals all agree: resampling deals changes nothing, only seeds count.
    per_seed = [[1.0] * 8, [0.0] * 16, [1.0] * 4, [1.0] * 10, [0.0] * 12]
    two_level = deal_seed_interval(per_seed)
    exact_lo, exact_hi = exact_bootstrap_quantiles([1.0, 0.0, 1.0, 1.0, 0.0], [0.025, 0.975])
    assert two_level.point == pytest.approx(0.6)
    assert (two_level.low, two_level.high) == (exact_lo, exact_hi)


def test_deal_noise_widens_the_interval() -> None:
    rng = np.random.default_rng(3)
    per_seed = [list((rng.random(64) < p).astype(float)) for p in (0.3, 0.4, 0.5, 0.45, 0.35)]
    seed_only = seed_interval([float(np.mean(g)) for g in per_seed])
    two_level = deal_seed_interval(per_seed)
    assert two_level.point == pytest.approx(seed_only.point)
    assert two_level.width > seed_only.width


# ---- paired comparison and verdict -----------------------------------------------------------


def test_clear_effect_on_six_seeds_is_decided_for_the_better_arm() -> None:
    a = {s: 0.6 + 0.01 * s for s in range(6)}
    b = {s: 0.3 + 0.02 * s for s in range(6)}
    c = compare_paired(a, b, names=("gtr", "rl4vlm"))
    assert c.p_value == pytest.approx(2 / 64)
    assert c.mean_diff.low > 0
    assert (c.verdict, c.winner) == ("gtr > rl4vlm", "gtr")
    reverse = compare_paired(b, a, names=("rl4vlm", "gtr"))
    assert (reverse.verdict, reverse.winner) == ("gtr > rl4vlm", "gtr")
    assert reverse.mean_diff.high < 0


def test_five_seeds_never_decide_at_alpha_005() -> None:
    a = {s: 1.0 for s in range(5)}
    b = {s: 0.0 for s in range(5)}
    c = compare_paired(a, b, names=("A", "B"))
    assert c.p_value == pytest.approx(0.0625)
    assert c.mean_diff.low == 1.0  # the interval excludes 0, the p does not allow a verdict
    assert (c.verdict, c.winner) == ("not decided at 5 seeds", None)
    assert c.seeds_for_power == 6  # identical differences: the sign-flip floor


def test_small_p_with_an_interval_touching_zero_is_not_decided() -> None:
    # Mixed signs: the enumeration gives p and the interval; the verdict needs both.
    diffs = [0.3, 0.25, 0.4, -0.05, 0.2, 0.35, 0.3, -0.1]
    c = compare_paired(dict(enumerate(diffs)), dict.fromkeys(range(8), 0.0))
    assert c.p_value == pytest.approx(hand_sign_flip_p(diffs))
    decided = c.p_value < 0.05 and c.mean_diff.low > 0
    assert (c.winner == "A") == decided


def test_only_shared_seeds_are_compared() -> None:
    a = {1: 0.5, 2: 0.6, 3: 0.7, 9: 1.0}
    b = {1: 0.4, 2: 0.6, 3: 0.5, 7: 0.0}
    c = compare_paired(a, b, names=("x", "y"))
    assert c.seeds == [1, 2, 3]
    assert c.diffs == pytest.approx([0.1, 0.0, 0.2])
    assert c.mean_diff.point == pytest.approx(0.1)
    assert c.dropped == {"x": [9], "y": [7]}
    assert c.verdict == "not decided at 3 seeds"
    none = compare_paired({1: 0.5}, {2: 0.5})
    assert (none.p_value, none.verdict) == (None, "not decided at 0 seeds")


def test_seeds_for_power_solves_the_noncentral_t() -> None:
    n = seeds_for_power(0.5)
    assert paired_t_power(0.5, n) == pytest.approx(0.8, abs=1e-4)
    assert math.ceil(n) == 34  # the textbook paired-t figure for d_z = 0.5
    assert paired_t_power(0.5, 34) >= 0.8 > paired_t_power(0.5, 33)
    assert seeds_for_power(0.0) is None


def test_comparison_reports_the_seeds_its_effect_needs() -> None:
    diffs = [0.2, -0.1, 0.15, 0.05, 0.3, -0.05]
    c = compare_paired(dict(enumerate(diffs)), dict.fromkeys(range(6), 0.0))
    d = np.mean(diffs) / np.std(diffs, ddof=1)
    assert c.effect_size == pytest.approx(d)
    n = c.seeds_for_power
    assert n is not None
    # The sign-flip test the verdict uses, at the observed mean and sd: an estimate by simulation.
    mean, sd = float(np.mean(diffs)), float(np.std(diffs, ddof=1))
    assert sign_flip_power(mean, sd, n) >= 0.8 > sign_flip_power(mean, sd, n - 1)
    assert paired_t_power(d, n) >= 0.8  # never fewer seeds than the t-test would want


def test_sign_flip_power_counts_the_seeds_the_permutation_test_needs() -> None:
    """Below 6 seeds the sign-flip test cannot reach p < 0.05 at all, whatever the effect; at a
    large effect 6 suffice; at a moderate one it wants more seeds than the paired t-test."""
    assert sign_flip_power(1.0, 0.1, 5) == 0.0
    assert sign_flip_power(1.0, 0.1, 6) == 1.0
    assert sign_flip_seeds_for_power(1.0, 0.0) == 6
    assert sign_flip_seeds_for_power(0.0, 1.0) is None
    n = sign_flip_seeds_for_power(1.0, 1.0)
    assert n is not None and n >= math.ceil(seeds_for_power(1.0) or 0)


def test_holm_adjusts_a_family_like_statsmodels() -> None:
    """v3's one 'decided' p (0.031, the smallest six seeds give) among 9 comparisons: 0.28."""
    p = [0.03125, 0.2, 0.5, 0.04, 0.6, 0.7, 0.9, 0.1, 0.3]
    adjusted = holm(p)
    assert adjusted[0] == pytest.approx(0.28125)
    assert all(a >= r for a, r in zip(adjusted, p, strict=True))
    assert holm([]) == []


# ---- probability of improvement and curves -----------------------------------------------------


def test_probability_of_improvement_counts_pairs_ties_half() -> None:
    # 1 beats 0; 2 beats 0 and ties 2; 3 beats all three: (1 + 1.5 + 3) / 9.
    iv = probability_of_improvement([1, 2, 3], [0, 2, 2.5])
    assert iv.point == pytest.approx(5.5 / 9)
    assert 0 <= iv.low <= iv.point <= iv.high <= 1
    assert probability_of_improvement([5, 6], [1, 2]).point == 1.0


def test_curve_band_means_over_seeds_at_each_update() -> None:
    curves = {
        0: [(0, 0.0), (2, 0.2), (4, 0.4)],
        1: [(0, 1.0), (2, 0.4), (4, 0.6)],
        2: [(0, 0.5), (2, 0.3)],  # still running: not at update 4 yet
    }
    band = curve_band(curves)
    assert [p.update for p in band] == [0, 2, 4]
    assert [p.n for p in band] == [3, 3, 2]
    assert band[1].mean == pytest.approx(0.3)
    assert band[2].mean == pytest.approx(0.5)
    # Two seeds at update 4: as with [0, 1] above, the band is their range.
    assert (band[2].low, band[2].high) == pytest.approx((0.4, 0.6))
    lo, hi = exact_bootstrap_quantiles([0.0, 1.0, 0.5], [0.018, 0.982])
    assert lo <= band[0].low <= band[0].mean <= band[0].high <= hi
    single = curve_band({3: [(0, 0.25)]})
    assert (single[0].mean, single[0].low, single[0].high) == (0.25, None, None)


@pytest.mark.parametrize("d", [2.0, 4.0, 10.0, 30.0])
def test_seeds_for_power_of_large_effects(d: float) -> None:
    n = seeds_for_power(d)
    assert n is not None and n >= 2
    assert paired_t_power(d, math.ceil(n)) >= 0.8 - 1e-6
    if math.ceil(n) > 2:
        assert paired_t_power(d, math.ceil(n) - 1) < 0.8


def test_lower_is_better_turns_the_verdict() -> None:
    # A collapse metric such as the top-thought share: A's lower values make A the better arm.
    a = {s: 0.2 for s in range(6)}
    b = {s: 0.6 + 0.01 * s for s in range(6)}
    c = compare_paired(a, b, names=("gtr", "rl4vlm"), higher_is_better=False)
    assert c.mean_diff.high < 0
    assert (c.verdict, c.winner) == ("gtr > rl4vlm", "gtr")


def test_many_seeds_sample_the_sign_patterns() -> None:
    diffs = [0.05 * ((-1) ** i) + 0.02 for i in range(20)]  # 2^20 patterns: sampled
    p, exact = sign_flip_p(diffs)
    assert not exact
    t = stats.ttest_1samp(diffs, 0.0).pvalue  # the t-test approximates it at 20 seeds
    assert p == pytest.approx(t, abs=0.03)


def test_one_shared_seed_is_compared_not_decided() -> None:
    """A study in progress with one seed done in both arms: p is 1 (d and -d reach |d|)."""
    assert sign_flip_p([0.25]) == (1.0, True)
    c = compare_paired({1: 0.75, 2: 0.5}, {1: 0.5}, names=("gtr", "rl4vlm"))
    assert c.seeds == [1] and c.p_value == 1.0
    assert c.verdict == "not decided at 1 seed" and c.winner is None


def test_the_deal_interval_resamples_distinct_deals_not_episodes() -> None:
    """Eight episodes that are two deals played four times each: as eight independent episodes
    the interval is narrower than the clustered one, which knows there are only two deals."""
    outcomes = [[1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]]
    clusters = [["a", "a", "a", "a", "b", "b", "b", "b"]]
    naive = deal_seed_interval(outcomes)
    clustered = deal_seed_interval(outcomes, clusters=clusters)
    assert clustered.point == naive.point == 0.5
    assert clustered.width is not None and naive.width is not None
    assert clustered.width > naive.width
    assert (clustered.low, clustered.high) == (0.0, 1.0)  # two deals: both, either, or neither
    # Distinct deals each played once: clustering changes nothing.
    once = deal_seed_interval(outcomes, clusters=[list("abcdefgh")])
    assert once.width == pytest.approx(naive.width, abs=0.07)


@pytest.mark.parametrize(
    "starts, diffs",
    [
        ([0.0, 0.1, 0.3, 0.2, 0.5, 0.4], [0.05, 0.0, 0.2, 0.25, 0.3, 0.1]),
        ([0.0, 0.0, 0.1, 0.2, 0.2, 0.3, 0.6], [0.1, -0.1, 0.0, 0.3, 0.1, -0.2, 0.4]),  # ties
    ],
)
def test_start_dependence_p_is_the_enumeration_of_every_pairing(
    starts: list[float], diffs: list[float]
) -> None:
    """Spearman's rho of (start, A - B) with the exact permutation p: every pairing of the starts
    with the differences counted by hand (two-sided: twice the smaller tail)."""
    dep = start_dependence(dict(enumerate(diffs)), dict(enumerate(starts)))
    assert dep is not None and dep.n == len(starts)
    rho = stats.spearmanr(starts, diffs).statistic
    assert dep.rho == pytest.approx(rho)
    null = np.array([stats.spearmanr(p, diffs).statistic for p in itertools.permutations(starts)])
    eps = 1e-12
    tails = (np.mean(null >= rho - eps), np.mean(null <= rho + eps))
    assert dep.p_value == pytest.approx(min(1.0, 2 * min(tails)))


def test_start_dependence_pairs_seeds_and_needs_three_varying_ones() -> None:
    # seeds pair by key, not by order: a difference that rises with the start, given shuffled
    starts = {4: 0.4, 1: 0.1, 3: 0.3, 0: 0.0, 2: 0.2, 9: 0.9}
    diffs = {0: -0.2, 3: 0.1, 1: -0.1, 2: 0.0, 4: 0.2, 7: 5.0}  # seed 7: no start, left out
    dep = start_dependence(diffs, starts)
    assert dep is not None and dep.rho == pytest.approx(1.0) and dep.n == 5
    assert dep.p_value == pytest.approx(2 / math.factorial(5))
    assert start_dependence({0: 0.1, 1: 0.2}, {0: 0.0, 1: 0.3}) is None  # 2 seeds
    assert start_dependence({0: 0.1, 1: 0.2, 2: 0.3}, {0: 0.0, 1: 0.0, 2: 0.0}) is None  # flat
    assert start_dependence({0: 0.0, 1: 0.0, 2: 0.0}, {0: 0.1, 1: 0.2, 2: 0.3}) is None
