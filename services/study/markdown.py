"""`gtr study report ID --markdown`: the study's verdicts as a Markdown section, for a results page
kept in git (docs/results.md embeds v3's, and a test regenerates it from the committed bundle).

It holds what the stored rows decide and nothing that moves while they do not: the primary
metric's table and paired comparisons per task and variant, the declared axis and trends, and
how many cells have finished. No run ids (an imported study numbers its runs anew), no ETA, no
timestamps. Names are escaped, so an arm called ``<b>|x`` stays text in its table cell.
"""

from __future__ import annotations

import html
import re

from services.study.console import cost_items, interval, need_text, num, p_text
from services.study.outputs import ComparisonOut
from services.study.questions import AxisReport, TrendReport
from services.study.report import GroupReport, MetricBlock, StudyReport

# Markdown's inline markup characters; `_` only where it could open or close emphasis (GFM
# leaves an underscore between two word characters alone, so `sft_only` stays readable).
_MARKUP = re.compile(r"([\\`*\[\]|~])|(?<!\w)_|_(?!\w)")


def text(s: str) -> str:
    """A name or a sentence as plain text in Markdown (and in a table cell)."""
    escaped = html.escape(s, quote=False)
    return _MARKUP.sub(lambda m: "\\" + m.group(0), escaped).replace("\n", " ")


def render_markdown(report: StudyReport) -> str:
    """The report's verdict section: a level-2 heading and what follows it, ending in a newline."""
    pr = report.progress
    lines = [
        f"## Study: {text(report.name)}",
        "",
        f"Primary metric, declared before the first run: **{text(report.primary)}**. A verdict "
        f"needs an exact sign-flip p < {report.alpha:g} and a {report.confidence * 100:g} % "
        "percentile-bootstrap interval of the mean paired difference that excludes 0. "
        f"Finished: {pr.done} of {pr.cells} runs"
        + (f" ({pr.failed} failed)" if pr.failed else "")
        + ".",
    ]
    for g in report.groups:
        lines += ["", *_group(g)]
    for ax in report.axes:
        lines += ["", *_axis(ax)]
    for tr in report.trends:
        lines += ["", *_trend(tr)]
    return "\n".join(lines) + "\n"


def _group(g: GroupReport) -> list[str]:
    title = f"### {text(g.task)}" + (f" · {text(g.variant)}" if g.variant else "")
    out = [title, ""]
    if not any(a.mean.n for a in g.primary.arms):
        return [*out, "No finished run yet."]
    notes = []
    if g.shared_arms:
        notes.append(
            f"{', '.join(map(text, g.shared_arms))}: one run per seed, shared by every variant"
        )
    ds = g.deal_space
    seen = "not known" if ds.in_training is None else str(ds.in_training)
    notes.append(f"{ds.eval_deals} evaluation deals, {seen} of them also dealt in training")
    if g.split_starts:
        seeds = ", ".join(map(str, g.split_starts))
        notes.append(f"**seeds {seeds}: the arms started from different weights**")
    out += ["; ".join(notes) + ".", "", *_arms(g.primary)]
    if cost := cost_items(g):
        each = ", ".join(f"{text(arm)} {minutes}" for arm, minutes in cost)
        out += ["", f"Wall-minutes per run (mean over its finished runs): {each}."]
    if g.primary.comparisons:
        out += ["", *_comparisons(g.primary.comparisons)]
    return out


def _arms(block: MetricBlock) -> list[str]:
    deals = any(a.deals is not None for a in block.arms)
    head = ["arm", "mean [95 % CI over seeds]", "IQM", "seeds"]
    head += ["mean [95 % CI, seeds and deals]"] if deals else []
    rows = [_row(head), _row(["---"] + ["---:"] * (len(head) - 1))]
    for a in block.arms:
        cells = [text(a.arm), interval(a.mean), num(a.iqm), str(a.mean.n)]
        rows.append(_row(cells + ([interval(a.deals)] if deals else [])))
    return rows


def _comparisons(comparisons: list[ComparisonOut]) -> list[str]:
    head = ["A vs B", "A − B [95 % CI]", "p (sign flip)", "verdict", "seeds for 80 % power"]
    rows = [_row(head), _row(["---", "---:", "---:", "---", "---:"])]
    for c in comparisons:
        verdict = f"**{text(c.verdict)}**" if c.winner else text(c.verdict)
        pair = f"{text(c.a)} vs {text(c.b)}"
        rows.append(_row([pair, interval(c.mean_diff), p_text(c), verdict, need_text(c)]))
    return rows


def _axis(ax: AxisReport) -> list[str]:
    out = [f"### {text(ax.task)}: {text(ax.a)} − {text(ax.b)} by measured {text(ax.level_metric)}"]
    if not any(p.level.n for p in ax.points):
        return [*out, "", text(ax.statement)]
    head = ["variant", "level [95 % CI]", f"{text(ax.a)} − {text(ax.b)} [95 % CI]", "verdict"]
    out += ["", _row(head), _row(["---", "---:", "---:", "---"])]
    for p in ax.points:
        out.append(_row([text(p.variant), interval(p.level), interval(p.diff), text(p.verdict)]))
    return [*out, "", text(ax.statement)]


def _trend(tr: TrendReport) -> list[str]:
    line = f"**{text(tr.task)}: {text(tr.arm)}'s {text(tr.metric)} {text(tr.statement)}**"
    runs = [
        f"seed {r.seed}{' ' + text(r.variant) if r.variant else ''} {r.first:.3f} → {r.score:.3f}"
        for r in tr.runs
    ]
    return [line + (f" (first → last: {'; '.join(runs)})" if runs else "")]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"
