from __future__ import annotations

import pytest

from services.controller import metrics as M

LIMITS = M.AlarmLimits(min_relevance=0.3, max_top_share=0.5, relevance_drop=0.5, warmup_updates=10)


def _relevant(thought: str, state: dict) -> bool:
    return str(state["n"]) in thought


def test_distinct_n_counts_unique_ngrams() -> None:
    assert M.distinct_n(["a b a b"], 1) == pytest.approx(2 / 4)
    assert M.distinct_n(["a b a b"], 2) == pytest.approx(2 / 3)
    assert M.distinct_n([], 1) == 0.0


def test_bleu2_by_hand() -> None:
    # hyp "a b c", ref "a b d": p1 = 2/3, p2 = 1/2, same length -> BP 1 -> sqrt(2/3 * 1/2)
    assert M.bleu2(["a", "b", "c"], [["a", "b", "d"]]) == pytest.approx((2 / 3 * 1 / 2) ** 0.5)
    # no bigram match: smoothing puts 0.1 in the numerator
    assert M.bleu2(["a", "c"], [["a", "b"]]) == pytest.approx((1 / 2 * 0.1 / 1) ** 0.5)


def test_self_bleu_is_one_for_collapsed_thoughts_and_lower_for_diverse() -> None:
    same = ["4 + 8 = 12 next I append +"] * 5
    varied = [
        "3 then 5 so +",
        "2 and 4 gives -",
        "target 1 current 0",
        "cards 9 3 times",
        "append = now",
    ]
    assert M.self_bleu2(same) == pytest.approx(1.0)
    assert M.self_bleu2(varied) < 0.3


def test_batch_and_probe_metrics_detect_collapse() -> None:
    healthy = [
        M.StepView(f"the number is {i}", "+" if i % 2 else "-", True, True, {"n": i})
        for i in range(10)
    ]
    collapsed = [M.StepView("the number is 4", "+", True, True, {"n": i}) for i in range(10)]
    good, bad = M.probe_metrics(healthy, _relevant), M.probe_metrics(collapsed, _relevant)
    assert (
        good["probe_top_thought_share"] == pytest.approx(0.1)
        and bad["probe_top_thought_share"] == 1.0
    )
    assert good["probe_relevance"] == 1.0 and bad["probe_relevance"] == pytest.approx(0.1)
    assert bad["probe_top_action_share"] == 1.0
    assert M.alarm_reason(good, 1.0, 3, LIMITS) is None
    assert "fell below 0.50" in str(M.alarm_reason(bad, 1.0, 3, LIMITS))
    batch = M.batch_metrics(collapsed + [M.StepView(None, None, False, False, {"n": 0})], _relevant)
    assert batch["format_valid_rate"] == pytest.approx(10 / 11)
    assert batch["thoughts_per_state"] == pytest.approx(1 / 10)


def test_success_window_is_a_running_mean_over_the_last_n() -> None:
    w = M.SuccessWindow(3)
    for s, r in [(True, 1.0), (False, -1.0), (False, -2.0), (True, 1.0)]:
        w.add(s, r, 2)
    summary = w.summary()
    assert summary["success_rate"] == pytest.approx(1 / 3)
    assert summary["episode_return"] == pytest.approx(-2 / 3)


def test_unparseable_probe_outputs_are_a_format_failure_not_one_thought() -> None:
    broken = [M.StepView(None, None, False, False, {"n": i}) for i in range(8)]
    m = M.probe_metrics(broken, _relevant)
    assert m["probe_top_thought_share"] == 0.0 and m["probe_distinct_thoughts"] == 0.0
    assert m["probe_format_valid_rate"] == 0.0 and m["probe_relevance"] == 0.0
    # An agent that never wrote a readable thought has not collapsed yet; after the warm-up it
    # is alarmed on, and so is one that could read before.
    assert M.alarm_reason(m, None, 0, LIMITS) is None
    assert "after 10 updates" in str(M.alarm_reason(m, None, 9, LIMITS))
    assert "the run's best 0.80" in str(M.alarm_reason(m, 0.8, 1, LIMITS))
