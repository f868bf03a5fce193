"""Per-update metrics: success, validity, and the thought-collapse monitors.

Collapse shows best on a fixed probe set decoded greedily (tiny-ezpoints.md): the share of the
most common thought, distinct thoughts, state relevance and the most common action. Batch
statistics over sampled thoughts (distinct-n, Self-BLEU-2, thoughts per state) are kept too.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


def words(text: str) -> list[str]:
    return text.replace('"', " ").replace(",", " , ").split()


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Distinct n-grams / all n-grams over the batch (0 when there are none)."""
    grams = [tuple(w[i : i + n]) for t in texts for w in [words(t)] for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def _ngrams(tokens: list[str], n: int) -> Counter[tuple[str, ...]]:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def bleu2(hyp: list[str], refs: list[list[str]]) -> float:
    """BLEU-2 (uniform weights) with smoothing 'method1' (epsilon 0.1 on zero matches)."""
    if not hyp or not refs:
        return 0.0
    log_p = 0.0
    for n in (1, 2):
        counts = _ngrams(hyp, n)
        total = sum(counts.values())
        if total == 0:
            return 0.0
        max_ref: Counter[tuple[str, ...]] = Counter()
        for r in refs:
            max_ref |= _ngrams(r, n)
        clipped = sum(min(c, max_ref[g]) for g, c in counts.items())
        log_p += 0.5 * math.log((clipped or 0.1) / total)
    closest = min((abs(len(r) - len(hyp)), len(r)) for r in refs)[1]
    bp = 1.0 if len(hyp) > closest else math.exp(1 - closest / len(hyp))
    return bp * math.exp(log_p)


def self_bleu2(texts: Sequence[str], max_texts: int = 64) -> float:
    """Mean BLEU-2 of each thought against the others: 1 = all identical (collapse)."""
    sample = [words(t) for t in texts[:max_texts] if t]
    if len(sample) < 2:
        return 0.0
    return sum(bleu2(h, sample[:i] + sample[i + 1 :]) for i, h in enumerate(sample)) / len(sample)


@dataclass
class StepView:
    """What the metrics need of one step."""

    thought: str | None
    action: str | None
    format_valid: bool
    action_valid: bool
    state: dict
    thought_entropy: float | None = None


def batch_metrics(
    steps: Sequence[StepView], relevant: Callable[[str, dict], bool]
) -> dict[str, float]:
    """Validity, relevance and diversity over one rollout's sampled steps."""
    n = len(steps)
    if n == 0:
        return {}
    thoughts = [s.thought for s in steps if s.format_valid and s.thought]
    states = {json.dumps(s.state, sort_keys=True) for s in steps if s.format_valid and s.thought}
    ents = [s.thought_entropy for s in steps if s.thought_entropy is not None]
    out = {
        "format_valid_rate": sum(s.format_valid for s in steps) / n,
        "action_valid_rate": sum(s.action_valid for s in steps) / n,
        "state_relevance": sum(
            relevant(t, s.state) for s in steps if s.format_valid and (t := s.thought)
        )
        / n,
        "distinct_1": distinct_n(thoughts, 1),
        "distinct_2": distinct_n(thoughts, 2),
        "self_bleu_2": self_bleu2(thoughts),
        "thoughts_per_state": len(set(thoughts)) / len(states) if states else 0.0,
        "thought_length": sum(len(words(t)) for t in thoughts) / len(thoughts) if thoughts else 0.0,
    }
    if ents:
        out["thought_entropy"] = sum(ents) / len(ents)
    return out


def top_share(texts: Sequence[str]) -> float:
    """Share of the texts that equal the most common one (0 for none)."""
    return Counter(texts).most_common(1)[0][1] / len(texts) if texts else 0.0


def probe_metrics(
    steps: Sequence[StepView],
    relevant: Callable[[str, dict], bool],
    ideal_thoughts: Sequence[str] = (),
    images: Sequence[str] = (),
) -> dict[str, float]:
    """Greedy decodes of the fixed probe states: the clearest collapse signal.

    ``probe_expected_top_share`` is the top share a policy whose thoughts track the states
    perfectly would show: the larger of the oracle's thoughts' (``ideal_thoughts``) and the
    images' (``images``: one key per state; a thought that reads only the picture says the same
    on every state that looks the same, e.g. ALFWorld games of one kitchen at their start).
    """
    n = len(steps)
    if n == 0:
        return {}
    # Over well-formed outputs only: unparseable ones are a format failure, not one shared thought.
    formed = [s.thought for s in steps if s.format_valid and s.thought]
    actions = Counter(s.action or "" for s in steps)
    out = {
        "probe_top_thought_share": top_share(formed),
        "probe_distinct_thoughts": float(len(set(formed))),
        "probe_top_action_share": actions.most_common(1)[0][1] / n,
        "probe_relevance": sum(
            bool(s.thought) and relevant(s.thought or "", s.state) for s in steps
        )
        / n,
        "probe_format_valid_rate": sum(s.format_valid for s in steps) / n,
    }
    if ideal_thoughts or images:
        out["probe_expected_top_share"] = max(top_share(ideal_thoughts), top_share(images))
    return out


@dataclass(frozen=True)
class AlarmLimits:
    """MetricsConfig's alarm settings (see shared/schemas.py)."""

    min_relevance: float
    max_top_share: float
    relevance_drop: float
    warmup_updates: int


def alarm_reason(
    metrics: dict[str, Any], best_relevance: float | None, update_idx: int, limits: AlarmLimits
) -> str | None:
    """Why the collapse alarm fires, with its numbers; None when it does not.

    Relevance: a drop by more than ``relevance_drop`` of the best the run reached (once that
    best was at least ``min_relevance``), or, when ``warmup_updates`` > 0, below
    ``min_relevance`` after that many updates; an agent that has not learnt to read the state
    yet has not collapsed.
    Dominance: the top thought's share s against the share s0 the probe's own states give when
    thoughts track them perfectly (``probe_expected_top_share``); alarm when
    s > s0 + max_top_share * (1 - s0): with all-distinct states that is about s > max_top_share.
    """
    rel = metrics.get("probe_relevance", metrics.get("state_relevance"))
    if rel is not None and best_relevance is not None and best_relevance >= limits.min_relevance:
        floor = best_relevance * (1 - limits.relevance_drop)
        if rel < floor:
            return (
                f"probe relevance {rel:.2f} fell below {floor:.2f}, "
                f"{limits.relevance_drop:.0%} under the run's best {best_relevance:.2f}"
            )
    warmed = limits.warmup_updates > 0 and update_idx + 1 >= limits.warmup_updates
    if rel is not None and warmed and rel < limits.min_relevance:
        return (
            f"probe relevance {rel:.2f} is below {limits.min_relevance:.2f} "
            f"after {update_idx + 1} updates"
        )
    top = metrics.get("probe_top_thought_share")
    base = float(metrics.get("probe_expected_top_share", 0.0))
    limit = base + limits.max_top_share * (1 - base)
    if top is not None and top > limit:
        return (
            f"one thought carries {top:.2f} of the probe; its states alone give {base:.2f} "
            f"(limit {limit:.2f})"
        )
    return None


def benchmark_share(states: Sequence[dict]) -> dict[str, float]:
    """ALFWorld: the share of steps played on benchmark games (0 = only synthetic or derived
    games, whose results are never ALFWorld scores); {} for tasks without the flag."""
    flags = [bool(st["benchmark"]) for st in states if "benchmark" in st]
    return {"benchmark_share": sum(flags) / len(flags)} if flags else {}


class SuccessWindow:
    """The reference's success rate: running mean over the last N finished training episodes."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: list[tuple[bool, float, int]] = []

    def add(self, success: bool, ret: float, length: int) -> None:
        self.items = (self.items + [(success, ret, length)])[-self.size :]

    def summary(self) -> dict[str, float]:
        if not self.items:
            return {}
        n = len(self.items)
        return {
            "success_rate": sum(s for s, _, _ in self.items) / n,
            "episode_return": sum(r for _, r, _ in self.items) / n,
            "episode_length": sum(length for _, _, length in self.items) / n,
        }
