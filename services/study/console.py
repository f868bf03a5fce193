"""`gtr study report ID` in the terminal: the verdict table of each task, then the secondary
metrics under their own heading (rich tables; names are printed as text, never as markup)."""

from __future__ import annotations

import io

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from services.study.outputs import ComparisonOut, IntervalOut
from services.study.questions import AxisReport
from services.study.report import GroupReport, MetricBlock, StudyReport
from services.study.statistics import POWER_MAX_SEEDS
from services.study.tuning import report_lines as tuning_lines


def num(v: float | None, digits: int = 3) -> str:
    return "–" if v is None else f"{v:.{digits}g}" if abs(v) >= 1000 else f"{v:.{digits}f}"


def interval(iv: IntervalOut | None, digits: int = 3) -> str:
    """'0.512 [0.401, 0.630]', or the point alone below two seeds."""
    if iv is None or iv.point is None:
        return "–"
    if iv.low is None or iv.high is None:
        return f"{num(iv.point, digits)} (1 seed)"
    return f"{num(iv.point, digits)} [{num(iv.low, digits)}, {num(iv.high, digits)}]"


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    s = int(seconds)
    return f"{s // 3600}h {s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"


def p_text(c: ComparisonOut) -> str:
    """The comparison's p, '~' when sampled rather than enumerated."""
    return "–" if c.p_value is None else f"{c.p_value:.4f}" + ("" if c.exact else " ~")


def rho_text(c: ComparisonOut) -> str:
    """Spearman's rho of the seed's start against A − B, with its p: '+0.42 (0.031)'."""
    return "–" if c.start_rho is None else f"{c.start_rho:+.2f} ({c.start_p:.3f})"


def undecided_why(c: ComparisonOut, alpha: float) -> str:
    """Why a comparison reads "not decided", in words: no shared seed, tied seeds, too few
    seeds for any p under alpha, seeds that disagree, or an interval that holds 0."""
    n = len(c.seeds)
    if c.winner is not None or not c.verdict.startswith("not decided"):
        return ""  # decided, or refused with its reason in the verdict itself
    if n == 0:
        return "no seed that both arms finished"
    ties = sum(1 for d in c.diffs if d == 0)
    if ties == n:
        return f"tied at every seed ({c.a} − {c.b} = 0 at each of {n})"
    tied = f"{ties} of {n} seeds tied (difference 0); " if ties else ""
    untied = n - ties
    smallest = 2 / 2**untied
    if smallest >= alpha:
        return (
            f"{tied}with {untied} untied seed{'s' if untied != 1 else ''} the smallest possible "
            f"p is {smallest:.3g}, not under α = {alpha:g}: more seeds are needed"
        )
    better = sum(1 for d in c.diffs if d > 0)
    worse = untied - better
    if c.p_holm is not None and c.p_value is not None and c.p_value < alpha <= c.p_holm:
        return (
            f"{tied}p = {c.p_value:.3g} is under α = {alpha:g}, but not after Holm's adjustment "
            f"over the task's confirmatory comparisons (p = {c.p_holm:.3g})"
        )
    if c.p_value is not None and c.p_value >= alpha:
        return (
            f"{tied}the seeds disagree: {c.a} ahead at {better}, {c.b} at {worse} "
            f"(p = {c.p_value:.3g} ≥ α = {alpha:g})"
        )
    iv = c.mean_diff
    if iv.low is not None and iv.high is not None:
        return f"{tied}the 95 % interval of {c.a} − {c.b}, [{iv.low:.3f}, {iv.high:.3f}], holds 0"
    return f"{tied}no interval over the seeds"


def need_text(c: ComparisonOut) -> str:
    """Seeds for 80 % power in a table cell: "> 40" where the estimate ran past its cap (a
    difference this small against its spread), "–" where no difference was observed."""
    if c.seeds_for_power is not None:
        return str(c.seeds_for_power)
    return f"> {POWER_MAX_SEEDS}" if c.effect_size else "–"


def power_text(c: ComparisonOut) -> str | None:
    """The seeds an undecided comparison would need, in words (None: no difference observed)."""
    if c.seeds_for_power is not None:
        return f"about {c.seeds_for_power} seeds for 80 % power"
    return f"more than {POWER_MAX_SEEDS} seeds for 80 % power" if c.effect_size else None


def cost_items(g: GroupReport) -> list[tuple[str, str]]:
    """(arm, its mean wall-minutes per run, and CPU-minutes where recorded) of each arm with a
    timed finished run."""
    return [
        (
            c.arm,
            f"{c.minutes:.1f}"
            + ("" if c.cpu_minutes is None else f" ({c.cpu_minutes:.1f} CPU)")
            + ("" if c.coverage is None else f", {c.coverage:.0%} corrected"),
        )
        for c in g.cost
        if c.minutes is not None
    ]


def _arms_table(block: MetricBlock) -> Table:
    deals = any(a.deals is not None for a in block.arms)
    t = Table(title=Text(f"{block.role}: {block.label}"), title_justify="left")
    for col in ["arm", "mean [95 % CI over seeds]", "IQM", "seeds", "runs"]:
        t.add_column(col, justify="left" if col in ("arm", "runs") else "right")
    if deals:
        t.add_column("mean [95 % CI, seeds and deals]", justify="right")
    for a in block.arms:
        runs = " ".join(f"#{r}" for _, r in sorted(a.runs.items()))
        row: list[Text | str] = [
            Text(a.arm),
            interval(a.mean),
            num(a.iqm),
            str(a.mean.n),
            runs or "–",
        ]
        t.add_row(*row, *([interval(a.deals)] if deals else []))
    return t


def _verdict(c: ComparisonOut) -> Text:
    return Text(c.verdict, style="bold green" if c.winner else "yellow")


def _comparisons_table(block: MetricBlock) -> Table | None:
    if not block.comparisons:
        return None
    t = Table(title=Text(f"paired on shared seeds: {block.label}"), title_justify="left")
    cols = ["A vs B", "A − B [95 % CI]", "p (sign flip)", "p (Holm)", "verdict", "seeds for 80 %"]
    for col in cols:  # the verdict is read whole: it never wraps
        left = col in ("A vs B", "verdict")
        t.add_column(col, justify="left" if left else "right", no_wrap=col == "verdict")
    t.add_column("P(A better) [95 % CI]", justify="right")
    by_start = any(c.start_rho is not None for c in block.comparisons)
    if by_start:
        t.add_column("ρ(start, A − B) (p)", justify="right")
    for c in block.comparisons:
        pair = Text(c.a) + Text(" vs ") + Text(c.b)
        t.add_row(
            pair,
            interval(c.mean_diff),
            p_text(c),
            "–" if c.p_holm is None else f"{c.p_holm:.4f}",
            _verdict(c),
            need_text(c),
            interval(c.p_improvement, 2),
            *([rho_text(c)] if by_start else []),
        )
    return t


def _starts(block: MetricBlock) -> list[RenderableType]:
    """Each seed's start in one line, and the seeds where neither the start nor any arm scored."""
    if not block.start_scores:
        return []
    each = ", ".join(f"{seed}: {num(v)}" for seed, v in sorted(block.start_scores.items()))
    out: list[RenderableType] = [
        Text(f"start (before update 0) per seed: {each}; mean {interval(block.start)}", style="dim")
    ]
    if block.dead_seeds:
        dead = ", ".join(map(str, block.dead_seeds))
        out.append(Text(f"⚠ seeds {dead}: the start and every arm at 0", style="bold yellow"))
    return out


def report_renderable(report: StudyReport) -> RenderableType:
    """The whole report as rich renderables, in reading order."""
    pr = report.progress
    head = Text()
    head.append(f"Study {report.id}: ", style="bold")
    head.append(report.name, style="bold")
    head.append(f"  ({report.status}, team {report.team})\n")
    head.append(f"primary metric: {report.primary}, declared before the runs\n")
    head.append(
        f"runs: {pr.done} done, {pr.running} running, {pr.queued} queued, {pr.failed} failed, "
        f"{pr.cancelled} cancelled, {pr.waiting} waiting, of {pr.cells}"
        f"; ETA {duration(pr.eta_s) if pr.eta_s is not None else 'unknown'}\n"
    )
    head.append(
        f"verdicts: exact sign-flip p < {report.alpha} and a {report.confidence:.0%} interval "
        "of the mean paired difference that excludes 0"
    )
    parts: list[RenderableType] = [head]
    for g in report.groups:
        title = Text(f"\ntask {g.task}", style="bold underline")
        if g.variant:
            title.append(f" · variant {g.variant}")
        if g.shared_arms:  # their runs are the same in every variant's group
            title.append(f" ({', '.join(g.shared_arms)}: no variant, shared by all)", style="dim")
        ds = g.deal_space
        space = Text(
            f"deal space: {ds.size if ds.size is not None else 'not counted'}; "
            f"evaluation deals: {ds.eval_deals}, of which also dealt in training: "
            f"{ds.in_training if ds.in_training is not None else 'not known'}",
            style="dim",
        )
        parts += [title, space]
        if g.split_starts:
            seeds = ", ".join(map(str, g.split_starts))
            parts.append(
                Text(f"⚠ seeds {seeds}: the arms started from different weights", style="bold red")
            )
        parts += [_arms_table(g.primary), *_starts(g.primary)]
        if cost := cost_items(g):
            each = ", ".join(f"{arm} {minutes}" for arm, minutes in cost)
            parts.append(Text(f"wall-minutes per run: {each}", style="dim"))
        table = _comparisons_table(g.primary)
        if table is not None:
            parts.append(table)
        if g.secondary:
            parts.append(Text("secondary metrics (not the study's verdict)", style="bold dim"))
        for block in g.secondary:
            parts.append(_arms_table(block))
            table = _comparisons_table(block)
            if table is not None:
                parts.append(table)
    parts += [_axis_table(ax) for ax in report.axes]
    for tr in report.trends:
        parts.append(Text(f"\ntask {tr.task}: {tr.arm}'s {tr.metric} {tr.statement}", style="bold"))
    if report.tuning:  # the tuning stage: every trial and the choice per arm
        parts.append(Text("\n" + "\n".join(tuning_lines(report.tuning))))
    return Group(*parts)


def _axis_table(ax: AxisReport) -> Group:
    t = Table(
        title=Text(f"\ntask {ax.task}: {ax.a} - {ax.b} by measured {ax.level_metric}"),
        title_justify="left",
    )
    for col in ("variant", "level [95 % CI]", f"{ax.a} - {ax.b} [95 % CI]", "verdict"):
        t.add_column(Text(col))
    for p in ax.points:
        t.add_row(Text(p.variant), interval(p.level), interval(p.diff), Text(p.verdict))
    return Group(t, Text(ax.statement, style="bold"))


def render_report(report: StudyReport, width: int = 120) -> str:
    """The report as plain text (no colour codes), e.g. for a file or a test."""
    console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
    console.print(report_renderable(report))
    return console.export_text()


def print_report(report: StudyReport) -> None:
    Console().print(report_renderable(report))
