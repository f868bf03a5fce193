"""`gtr study figure`: a study's learning curves as one PNG, for a results page in git.

One panel per task (and variant), one line per arm: at each update the mean over the seeds that
reached it, with its 95 % bootstrap band, exactly the report's curves (services/study/report.py).
The file depends only on the stored rows: the same data draws the same bytes.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from services.study.report import Curve, GroupReport, StudyReport


class NoCurve(ValueError):
    """The study has recorded no point of the metric yet."""


def _curves_of(g: GroupReport, from_start: bool) -> list[Curve]:
    return g.change_curves if from_start else g.curves


def draw_curves(report: StudyReport, metric: str, out: Path, from_start: bool = False) -> int:
    """Write the panels of ``metric`` to ``out`` (PNG); returns how many panels were drawn.
    ``from_start``: each arm's change from its seeds' starts (the report's change curves, the
    primary metric's only), where a study's seeds start from different weights."""
    import matplotlib

    matplotlib.use("Agg")  # no display; the same rendering everywhere
    import matplotlib.pyplot as plt

    groups = [
        g
        for g in report.groups
        if any(c.metric == metric and c.points for c in _curves_of(g, from_start))
    ]
    if not groups:
        what = "change from the start" if from_start else "point"
        raise NoCurve(f"study {report.id} has no {what} of {metric} yet")
    # One colour per arm in every panel, in the study's order of arms.
    arms = list(dict.fromkeys(a for g in groups for a in g.arms))
    palette = plt.get_cmap("tab10")
    colour = {arm: palette(i % 10) for i, arm in enumerate(arms)}
    fig, axes = plt.subplots(
        1, len(groups), figsize=(4.2 * len(groups), 3.6), squeeze=False, sharey=True
    )
    for ax, g in zip(axes[0], groups, strict=True):
        for curve in _curves_of(g, from_start):
            if curve.metric != metric or not curve.points:
                continue
            x = [p.update for p in curve.points]
            seeds = max(p.n for p in curve.points)
            label = f"{curve.arm} ({seeds} seed{'' if seeds == 1 else 's'})"
            ax.plot(x, [p.mean for p in curve.points], color=colour[curve.arm], label=text(label))
            low = [p.mean if p.low is None else p.low for p in curve.points]
            high = [p.mean if p.high is None else p.high for p in curve.points]
            ax.fill_between(x, low, high, color=colour[curve.arm], alpha=0.2, linewidth=0)
        block = next((b for b in [g.primary, *g.secondary] if b.metric == metric), None)
        start = block.start if block is not None else None
        if from_start:  # every seed's own start is 0 here
            ax.axhline(0, color="black", linestyle="--", linewidth=1, label="start (each seed's)")
        elif start is not None and start.point is not None:  # the start, before update 0
            err = (
                [[start.point - start.low], [start.high - start.point]]
                if start.low is not None and start.high is not None
                else None
            )
            ax.errorbar([-1], [start.point], yerr=err, fmt="o", color="black", capsize=3)
            ax.annotate("start", (-1, start.point), textcoords="offset points", xytext=(4, 4))
        ax.set_title(text(g.task + (f" · {g.variant}" if g.variant else "")), fontsize=10)
        ax.set_xlabel("update")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel(text(f"{metric} − the seed's start" if from_start else metric))
    what = "change from each seed's start, mean" if from_start else "mean"
    title = f"{report.name}: {what} over seeds, 95 % band"
    # wrapped to the panels' width: one panel is narrower than the title
    fig.suptitle(text(textwrap.fill(title, width=48 * len(groups))), fontsize=10)
    fig.tight_layout()
    # No software version or date in the file: the same rows give the same bytes.
    fig.savefig(out, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    return len(groups)


def text(s: str) -> str:
    """A name drawn as written: matplotlib reads `$...$` as math, which a name must not be."""
    return s.replace("$", r"\$")
