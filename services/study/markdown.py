"""`gtr study report ID --markdown`: the study's verdicts as a Markdown section, for a results page
kept in git (docs/results-v4.md embeds v4's two studies, docs/results-v3.md v3's; tests
regenerate each from its committed bundle); `--brief`, the summary a page that opens with
several studies' answers holds (docs/results.md).

It holds what the stored rows decide and nothing that moves while they do not: the primary
metric's table and paired comparisons per task and variant, the declared axis and trends, and
how many cells have finished. No run ids (an imported study numbers its runs anew), no ETA, no
timestamps. Names are escaped, so an arm called ``<b>|x`` stays text in its table cell.
"""

from __future__ import annotations

import html
import re

from services.study.console import (
    cost_items,
    interval,
    need_text,
    num,
    p_text,
    power_text,
    rho_text,
    undecided_why,
)
from services.study.outputs import ComparisonOut
from services.study.questions import AxisReport, TrendReport
from services.study.report import GroupReport, MetricBlock, StudyReport
from services.study.tuning import ArmTuning, choice_text, outcome_text, params_text

# Markdown's inline markup characters; `_` only where it could open or close emphasis (GFM
# leaves an underscore between two word characters alone, so `sft_only` stays readable).
_MARKUP = re.compile(r"([\\`*\[\]|~])|(?<!\w)_|_(?!\w)")


def text(s: str) -> str:
    """A name or a sentence as plain text in Markdown (and in a table cell)."""
    escaped = html.escape(s, quote=False)
    return _MARKUP.sub(lambda m: "\\" + m.group(0), escaped).replace("\n", " ")


END_MARKER = "<!-- end: gtr study report -->"


def marker_text(study_id: int, brief: bool = False) -> str:
    """The begin marker's line without its source: `<!-- begin: gtr study report ID --markdown
    -->`, with `--brief` for the summary."""
    return f"<!-- begin: gtr study report {study_id} --markdown{' --brief' if brief else ''} -->"


def begin_marker(study_id: int, brief: bool = False) -> re.Pattern[str]:
    """The line that opens a page's section for study ``study_id``: `<!-- begin: gtr study report
    ID --markdown -->` (`--markdown --brief`: the summary), optionally naming its source (`...,
    from docs/results/v4/study.json.gz`). A page may hold a study's summary and its full report."""
    kind = "--markdown --brief" if brief else "--markdown"
    opening = rf"^<!-- begin: gtr study report {study_id} {kind}(?:,[^\n]*)? -->\n"
    return re.compile(opening, re.M)


class PageError(ValueError):
    """A results page whose markers do not say where the section goes."""


def splice(page: str, study_id: int, section: str, brief: bool = False) -> str:
    """``page`` with the text between study ``study_id``'s begin marker (of the summary with
    ``brief``) and the end marker after it replaced by ``section``: how a results page kept in
    git takes a new report. The page must hold exactly one such begin marker for the study and
    an end marker after it."""
    begins = list(begin_marker(study_id, brief).finditer(page))
    if not begins:
        raise PageError(
            f"it has no line `{marker_text(study_id, brief)}`: put one "
            f"where the section goes, with `{END_MARKER}` on a line below it"
        )
    if len(begins) > 1:
        raise PageError(
            f"it opens study {study_id}'s {'summary' if brief else 'section'} {len(begins)} "
            "times (lines "
            + ", ".join(str(page.count("\n", 0, b.start()) + 1) for b in begins)
            + "): keep one"
        )
    start = begins[0].end()
    end = page.find(END_MARKER, start)
    if end < 0:
        raise PageError(f"no `{END_MARKER}` line after study {study_id}'s begin marker")
    return page[:start] + section + page[end:]


def render_markdown(report: StudyReport, brief: bool = False) -> str:
    """The report's verdict section: a level-2 heading and what follows it, ending in a newline.
    ``brief``: the summary a page that opens with several studies' answers holds (`_brief`)."""
    pr = report.progress
    lines = [
        f"## Study: {text(report.name)}",
        "",
        f"Primary metric, declared before the first run: **{text(report.primary)}**. A verdict "
        f"needs a sign-flip p < {report.alpha:g} after Holm's adjustment over the task's "
        f"confirmatory comparisons and a {report.confidence * 100:g} % percentile-bootstrap "
        "interval of the mean paired difference that excludes 0. "
        f"Finished: {pr.done} of {pr.cells} runs"
        + (f" ({pr.failed} failed)" if pr.failed else "")
        + ".",
    ]
    lines += _answers(report)
    if brief:
        return "\n".join(lines + _brief(report)) + "\n"
    for g in report.groups:
        lines += ["", *_group(g)]
    for ax in report.axes:
        lines += ["", *_axis(ax)]
    for tr in report.trends:
        lines += ["", *_trend(tr)]
    if report.tuning:  # the tuning stage: every trial and the choice per arm
        lines += ["", "### Tuning", "", *_tuning(report.tuning)]
    return "\n".join(lines) + "\n"


def _brief(report: StudyReport) -> list[str]:
    """After the answers: each task and variant's arms (score, change from the start, SFT
    share), then each arm's tuned settings. The seeds, the comparisons' statistics, the axis,
    the trends and every trial are the full section's."""
    out = []
    for g in report.groups:
        title = f"**{text(g.task)}" + (f" · {text(g.variant)}" if g.variant else "") + "**"
        if not any(a.mean.n for a in g.primary.arms):
            out += ["", f"{title}: no finished run yet."]
            continue
        out += ["", f"{title}:", "", *_arms(g.primary)]
    if report.tuning:
        done = sum(1 for a in report.tuning for t in a.trials if t.state in ("complete", "pruned"))
        total = sum(len(a.trials) for a in report.tuning)
        out += ["", f"Tuning stage: {done} of {total} trials finished.", ""]
        out += _choices(report.tuning)
    return out


def _answers(report: StudyReport) -> list[str]:
    """The study's answer before its tables: each confirmatory comparison of the primary metric,
    a row per task, variant and pair, with its verdict and, where undecided, why and the seeds
    the observed difference would need. Nothing before a comparison has a finished run."""
    head = ["task", "A vs B", "verdict", "A − B [95 % CI]", "seeds", "p (Holm)", "why not decided"]
    rows, waiting = [], 0
    for g in report.groups:
        where = text(g.task) + (f" · {text(g.variant)}" if g.variant else "")
        for c in g.primary.comparisons:
            if not c.confirmatory:
                continue
            if not c.seeds and not c.protocol_refused:  # nothing to say yet but that
                waiting += 1
                continue
            verdict = f"**{text(c.verdict)}**" if c.winner else text(c.verdict)
            why = undecided_why(c, report.alpha)
            if why and (power := power_text(c)):
                why += f"; {power}"
            holm = "–" if c.p_holm is None else f"{c.p_holm:.4f}"
            pair = f"{text(c.a)} vs {text(c.b)}"
            cells = [where, pair, verdict, interval(c.mean_diff), str(len(c.seeds)), holm]
            rows.append(_row([*cells, text(why) or "–"]))
    if not rows:
        if not waiting:
            return []
        return [
            "",
            "### The answers",
            "",
            f"None yet: no seed has finished both arms of any of the {waiting} confirmatory "
            "comparisons.",
        ]
    return [
        "",
        "### The answers",
        "",
        f"The confirmatory comparisons on {text(report.primary)}, as the tables below decide them:",
        "",
        _row(head),
        _row(["---", "---", "---", "---:", "---:", "---:", "---"]),
        *rows,
        *(["", f"{waiting} more: no seed has finished both arms yet."] if waiting else []),
    ]


def _tuning(arms: list[ArmTuning]) -> list[str]:
    """Every trial of the stage as one table, each arm's choice in bold, then the choices."""
    pairs = dict.fromkeys((a.task, a.metric) for a in arms)  # one pair unless a file says more
    stages = "; ".join(f"on {text(task)} by {text(metric)}" for task, metric in pairs)
    out = [
        f"Each arm's settings are chosen {stages}: its best completed trial (in bold). A pruned "
        "trial was stopped at the update given, its curve behind the others'.",
        "",
        _row(["arm", "trial", "settings", "result"]),
        _row(["---", "---:", "---", "---"]),
    ]
    for a in arms:
        for tr in a.trials:
            cells = [text(a.arm), str(tr.number), text(params_text(tr.params)), outcome_text(tr)]
            if tr.number == a.selected_trial:
                cells = [f"**{c}**" for c in cells]
            out.append(_row(cells))
    return [*out, "", *_choices(arms)]


def _choices(arms: list[ArmTuning]) -> list[str]:
    """Each arm's choice, and a choice at a grid's end (the arm may not be at its best)."""
    out = []
    for a in arms:
        out.append(f"- {text(a.arm)}: {text(choice_text(a))}")
        out += [f"  - at the grid's edge: {text(e)}; its best may lie beyond" for e in a.edges]
    return out


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
    space = f" of the task's {ds.size:,}" if ds.size is not None else ""
    dealt = f"{ds.eval_episodes} evaluation episodes over {ds.eval_deals} distinct deals{space}"
    if ds.in_training is None:
        notes.append(f"{dealt}, whether training dealt them is not known")
    else:
        held = "held out" if ds.held_out else "**not held out**"
        notes.append(f"{dealt}; {ds.in_training} of those deals also dealt in training: {held}")
    if g.protocol is not None:
        notes.append(f"evaluated under one protocol: {protocol_text(g.protocol)}")
    if g.protocol_runs:
        notes.append(
            f"**runs evaluated under {len(g.protocol_runs)} protocols: pairs across them are "
            "refused**"
        )
    if g.split_starts:
        seeds = ", ".join(map(str, g.split_starts))
        notes.append(f"**seeds {seeds}: the arms started from different weights**")
    out += ["; ".join(notes) + ".", "", *_arms(g.primary)]
    if g.primary.start_scores:
        out += ["", *_seeds(g.primary)]
    if cost := cost_items(g):
        each = ", ".join(f"{text(arm)} {minutes}" for arm, minutes in cost)
        out += ["", f"Wall-minutes per run (mean over its finished runs): {each}."]
    if g.primary.comparisons:
        out += ["", *_comparisons(g.primary.comparisons)]
    return out


def protocol_text(p: dict) -> str:
    """The protocol's rules in a few words: early truncation, time limit, unreadable output,
    new tokens, deals."""
    env = p.get("env") or {}
    limit = env.get("max_episode_steps") or "the task's"
    return (
        f"early truncation {env.get('early_truncation', 'off')}, time limit {limit}, "
        f"unreadable output {env.get('invalid_action', 'random')}, "
        f"{p.get('max_new_tokens')} new tokens, {p.get('episodes')} deals"
    )


def _arms(block: MetricBlock) -> list[str]:
    deals = any(a.deals is not None for a in block.arms)
    start = block.start is not None
    share = any(a.sft_share is not None for a in block.arms)
    kl = any(a.kl_share is not None for a in block.arms)
    head = ["arm", "mean [95 % CI over seeds]", "IQM", "seeds"]
    head += ["mean [95 % CI, seeds and deals]"] if deals else []
    head += ["change from start [95 % CI]"] if start else []
    head += ["SFT share of the step"] if share else []
    head += ["KL-to-teacher share of the step"] if kl else []
    rows = [_row(head), _row(["---"] + ["---:"] * (len(head) - 1))]
    if start and block.start is not None:
        cells = ["start (before update 0)", interval(block.start), "", str(block.start.n)]
        cells += [""] if deals else []
        rows.append(_row(cells + [""] + ([""] if share else []) + ([""] if kl else [])))
    for a in block.arms:
        cells = [text(a.arm), interval(a.mean), num(a.iqm), str(a.mean.n)]
        cells += [interval(a.deals)] if deals else []
        cells += [interval(a.change_from_start)] if start else []
        cells += [num(a.sft_share)] if share else []
        cells += [num(a.kl_share)] if kl else []
        rows.append(_row(cells))
    return rows


def _seeds(block: MetricBlock) -> list[str]:
    """Each seed's start beside each arm's score: a verdict read with the starts it rests on."""
    head = ["seed", "start", *(text(a.arm) for a in block.arms)]
    rows = [_row(head), _row(["---"] + ["---:"] * (len(head) - 1))]
    for seed in block.seeds():
        cells = [str(seed), num(block.start_scores.get(seed))]
        rows.append(_row(cells + [num(a.scores.get(seed)) for a in block.arms]))
    lead = f"Each seed's start and each arm's {text(block.label)}:"
    if not block.dead_seeds:
        return [lead, "", *rows]
    dead = ", ".join(map(str, block.dead_seeds))
    return [
        lead,
        "",
        *rows,
        "",
        f"**Seed{'s' if len(block.dead_seeds) > 1 else ''} {dead}: the start and every arm at "
        "0**, nothing learnt from that start; the comparisons count it as a difference of 0.",
    ]


def _comparisons(comparisons: list[ComparisonOut]) -> list[str]:
    head = [
        "A vs B",
        "A − B [95 % CI]",
        "p (sign flip)",
        "p (Holm)",
        "verdict",
        "seeds for 80 % power (estimate)",
    ]
    # Whether a difference follows the seed's start (studies whose start varies between seeds)
    by_start = any(c.start_rho is not None for c in comparisons)
    head += ["A − B against the start: Spearman ρ (p)"] if by_start else []
    rows = [_row(head), _row(["---", "---:", "---:", "---:", "---"] + ["---:"] * (len(head) - 5))]
    for c in comparisons:
        verdict = f"**{text(c.verdict)}**" if c.winner else text(c.verdict)
        pair = f"{text(c.a)} vs {text(c.b)}"
        holm = "–" if c.p_holm is None else f"{c.p_holm:.4f}"
        cells = [pair, interval(c.mean_diff), p_text(c), holm, verdict, need_text(c)]
        if by_start:
            cells.append(rho_text(c))
        rows.append(_row(cells))
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
