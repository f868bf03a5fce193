"""The study report on a study the platform really ran (tiny_study.py): every figure is
recomputed here from the stored rows through the statistics module, and the rendering keeps
hostile arm names as text."""

from __future__ import annotations

import html

import pytest
from sqlalchemy import select

from services.study import statistics as st
from services.study.console import render_report, undecided_why
from services.study.report import DEAL_SPACE, build_report, dead_seeds, deal_key
from services.study.schemas import MetricSpec
from services.study.service import StudyNotFound
from shared.db.models import EvalOutcome, Run, Update
from shared.db.session import session_scope
from tests.services.study.tiny_study import HOSTILE_ARM, QUOTED_ARM, TinyStudy


@pytest.fixture(scope="module")
def tiny(real_study: TinyStudy) -> TinyStudy:
    return real_study


@pytest.fixture(scope="module")
def report(tiny: TinyStudy):  # type: ignore[no-untyped-def]
    with session_scope() as s:
        return build_report(s, tiny.study_id)


def _stored(study_id: int, metric: str) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """arm -> seed -> the metric's curve, read straight from the update rows."""
    out: dict[str, dict[int, list[tuple[int, float]]]] = {}
    with session_scope() as s:
        for run in s.scalars(select(Run).where(Run.study_id == study_id)):
            rows = s.execute(
                select(Update.idx, Update.metrics).where(Update.run_id == run.id)
            ).all()
            curve = [(i, float(m[metric])) for i, m in rows if metric in m]
            out.setdefault(run.study_arm or "", {})[run.study_seed or 0] = sorted(curve)
    return out


def test_progress_counts_every_finished_cell(report, tiny: TinyStudy) -> None:  # type: ignore[no-untyped-def]
    p = report.progress
    assert (p.cells, p.done, p.waiting, p.queued, p.running, p.failed) == (4, 4, 0, 0, 0, 0)
    assert p.eta_s == 0.0
    assert report.status == "done"
    assert len(report.runs) == 4 and all(r.url == f"/runs/{r.run_id}" for r in report.runs)


def test_primary_intervals_are_the_statistics_of_the_stored_scores(report, tiny: TinyStudy) -> None:  # type: ignore[no-untyped-def]
    (group,) = report.groups
    block = group.primary
    assert (block.role, block.metric) == ("primary", "eval/success_rate")
    spec = MetricSpec(metric="eval/success_rate")
    curves = _stored(tiny.study_id, "eval/success_rate")
    for arm in block.arms:
        scores = {seed: spec.score(c) for seed, c in curves[arm.arm].items()}
        assert arm.scores == scores
        expected = st.seed_interval([scores[s] for s in sorted(scores)])
        assert (arm.mean.point, arm.mean.low, arm.mean.high) == (
            expected.point,
            expected.low,
            expected.high,
        )
        assert sorted(arm.runs) == list(tiny.seeds)
    (c,) = block.comparisons
    a, b = (next(x for x in block.arms if x.arm == name).scores for name in (c.a, c.b))
    assert c.seeds == list(tiny.seeds)
    assert c.diffs == pytest.approx([a[s] - b[s] for s in tiny.seeds])
    assert c.p_value == st.sign_flip_p(c.diffs)[0]
    assert c.verdict == "not decided at 2 seeds"  # two seeds can never decide (p >= 0.5)
    assert len(c.runs) == 4


def test_each_seeds_start_is_its_stored_evaluation_before_update_0(report, tiny: TinyStudy) -> None:  # type: ignore[no-untyped-def]
    """The start per seed is the start evaluation the runs stored (one per seed: its arms share
    their weights); dead seeds are those where it and every arm's score are 0."""
    block = report.groups[0].primary
    stored = _stored(tiny.study_id, "eval_start/success_rate")
    for seed in tiny.seeds:
        at_seed = {curves[seed][0][1] for curves in stored.values()}
        assert at_seed == {block.start_scores[seed]}
    expected = [
        seed
        for seed, start in block.start_scores.items()
        if start == 0 and all(a.scores[seed] == 0 for a in block.arms)
    ]
    assert block.dead_seeds == expected
    assert dead_seeds(
        ["a", "b"],
        {"a": {0: 0.0, 1: 0.0, 2: 0.0}, "b": {0: 0.0, 1: 0.5}},
        {
            0: 0.0,
            1: 0.0,
            2: 0.0,
            3: 0.0,
        },
    ) == [0]  # 1: b learnt; 2: b has no run there; 3: no arm finished


def test_change_curves_band_each_seeds_curve_less_its_own_start(report, tiny: TinyStudy) -> None:  # type: ignore[no-untyped-def]
    (group,) = report.groups
    values = _stored(tiny.study_id, "eval/success_rate")
    starts = _stored(tiny.study_id, "eval_start/success_rate")
    assert [c.arm for c in group.change_curves] == group.arms
    for c in group.change_curves:
        per_seed = {
            seed: [(u, v - starts[c.arm][seed][0][1]) for u, v in curve]
            for seed, curve in values[c.arm].items()
        }
        expected = [(p.update, p.mean, p.low, p.high, p.n) for p in st.curve_band(per_seed)]
        assert [(p.update, p.mean, p.low, p.high, p.n) for p in c.points] == expected
        assert c.metric == "eval/success_rate" and c.points


def test_deal_level_interval_reads_the_stored_outcomes(report, tiny: TinyStudy) -> None:  # type: ignore[no-untyped-def]
    (group,) = report.groups
    with session_scope() as s:
        for arm in group.primary.arms:
            per_seed = []
            for seed in sorted(arm.runs):
                rows = s.execute(
                    select(EvalOutcome.update_idx, EvalOutcome.deal, EvalOutcome.success).where(
                        EvalOutcome.run_id == arm.runs[seed]
                    )
                ).all()
                last = max(u for u, _, _ in rows)
                per_seed.append([float(ok) for u, _, ok in sorted(rows) if u == last])
            assert all(len(d) == 4 for d in per_seed)  # eval_episodes = 4 deals
            # The final evaluation's deals average to the run's stored success rate.
            assert [sum(d) / 4 for d in per_seed] == pytest.approx(
                [arm.scores[seed] for seed in sorted(arm.runs)]
            )
            expected = st.deal_seed_interval(per_seed)
            assert arm.deals is not None
            assert (arm.deals.low, arm.deals.high) == (expected.low, expected.high)


def test_secondary_and_collapse_metrics_are_labelled(report) -> None:  # type: ignore[no-untyped-def]
    (group,) = report.groups
    roles = {b.metric: b.role for b in group.secondary}
    assert roles["eval/episode_return"] == "secondary"
    assert roles["probe_relevance"] == "collapse"
    assert roles["probe_top_thought_share"] == "collapse"
    share = next(b for b in group.secondary if b.metric == "probe_top_thought_share")
    assert share.higher_is_better is False
    assert all(b.comparisons for b in group.secondary)


def test_curves_band_each_arm_over_its_seeds(report, tiny: TinyStudy) -> None:  # type: ignore[no-untyped-def]
    (group,) = report.groups
    curves = _stored(tiny.study_id, "eval/success_rate")
    for arm in tiny.arms:
        curve = next(c for c in group.curves if c.arm == arm and c.metric == "eval/success_rate")
        expected = st.curve_band(curves[arm])
        assert [(p.update, p.mean, p.low, p.high) for p in curve.points] == [
            (p.update, p.mean, p.low, p.high) for p in expected
        ]
        assert curve.points and all(p.n == 2 for p in curve.points)


def test_deal_space_counts_evaluation_deals_seen_in_training(report) -> None:  # type: ignore[no-untyped-def]
    (group,) = report.groups
    ds = group.deal_space
    assert ds.size == DEAL_SPACE["numberline"] == 30
    assert ds.eval_deals == 4
    # NumberLine has 30 deals: the 2 envs x 4 steps of each run start a few episodes, and the
    # count of evaluation deals among their starts is what the report states, 0..4.
    assert ds.in_training is not None and 0 <= ds.in_training <= 4


def test_cost_is_the_mean_of_each_runs_stored_update_seconds(report, tiny: TinyStudy) -> None:  # type: ignore[no-untyped-def]
    (group,) = report.groups
    curves = _stored(tiny.study_id, "update_s")
    cpu = _stored(tiny.study_id, "update_cpu_s")
    assert [c.arm for c in group.cost] == group.arms
    for c in group.cost:
        totals = [sum(v for _, v in curve) for curve in curves[c.arm].values()]
        assert c.runs == len(tiny.seeds) == len(totals)
        assert c.minutes == pytest.approx(sum(totals) / len(totals) / 60) and c.minutes > 0
        # Every update recorded the CPU seconds its run's process spent on it.
        assert all(len(cpu[c.arm][s]) == len(curves[c.arm][s]) for s in tiny.seeds)
        cpu_totals = [sum(v for _, v in curve) for curve in cpu[c.arm].values()]
        assert c.cpu_minutes == pytest.approx(sum(cpu_totals) / len(cpu_totals) / 60)
        assert c.cpu_minutes > 0


def test_each_arm_states_the_coverage_its_runs_trained_with(report, tiny: TinyStudy) -> None:  # type: ignore[no-untyped-def]
    """The GTR arm's runs recorded their corrections (requested, done, coverage) when they
    ended; the arm's coverage is their mean (an untrained tiny model may write no well-formed
    step: nothing requested, no coverage); the RL4VLM arm asks for none."""
    (group,) = report.groups
    cost = {c.arm: c for c in group.cost}
    with session_scope() as s:
        runs = s.scalars(select(Run).where(Run.study_id == tiny.study_id)).all()
        recorded = [r.info["corrections"] for r in runs if r.algorithm == "gtr"]
    assert recorded and all("corrections_done" in c for c in recorded)
    covs = [c["corrections_coverage"] for c in recorded if "corrections_coverage" in c]
    expected = sum(covs) / len(covs) if covs else None
    assert cost[QUOTED_ARM].coverage == (pytest.approx(expected) if covs else None)
    assert cost[HOSTILE_ARM].coverage is None
    assert ("% corrected" in render_report(report)) == bool(covs)


def test_cpu_cost_is_left_out_where_some_runs_predate_it() -> None:
    """Runs recorded before update_cpu_s existed (an imported bundle) have wall time only: a
    CPU mean over the rest would pass for the arm's, so there is none."""
    from services.study.report import _cost

    def run(i: int) -> Run:
        return Run(id=i, status="completed")

    new = {"update_s": [(0, 60.0), (1, 60.0)], "update_cpu_s": [(0, 30.0), (1, 30.0)]}
    old = {"update_s": [(0, 120.0), (1, 120.0)]}
    both = _cost("gtr", {("gtr", 0): run(1), ("gtr", 1): run(2)}, {1: new, 2: old})
    assert (both.runs, both.minutes, both.cpu_minutes) == (2, 3.0, None)
    one = _cost("gtr", {("gtr", 0): run(1)}, {1: new})
    assert (one.runs, one.minutes, one.cpu_minutes) == (1, 2.0, 1.0)


def test_deal_keys_match_the_tasks_deal_space() -> None:
    from services.env import make_env

    keys = set()
    for seed in range(400):  # 30 deals, each at least 1/36 likely: all seen (miss < 1e-3)
        _, info = make_env("numberline", seed=seed).reset()
        keys.add(deal_key("numberline", info["state"]))
    assert len(keys) == DEAL_SPACE["numberline"]
    assert deal_key("alfworld", {"task": "alfworld"}) is None


def test_team_scoping_and_missing_studies(tiny: TinyStudy) -> None:
    with session_scope() as s:
        assert build_report(s, tiny.study_id, team=tiny.team).id == tiny.study_id
        with pytest.raises(StudyNotFound):
            build_report(s, tiny.study_id, team="someone-else")
        with pytest.raises(StudyNotFound):
            build_report(s, 2**31 - 1)


def test_terminal_table_keeps_hostile_names_as_text(report) -> None:  # type: ignore[no-untyped-def]
    text = render_report(report, width=200)
    assert HOSTILE_ARM in text and QUOTED_ARM in text
    assert "not decided at 2 seeds" in text
    assert "primary: eval/success_rate (final)" in text
    assert "secondary metrics" in text
    assert text.index("primary:") < text.index("secondary metrics")


def test_markdown_section_keeps_hostile_names_as_text_in_their_cells(
    report, tiny: TinyStudy
) -> None:  # type: ignore[no-untyped-def]
    """`gtr study report --markdown`, rendered as a Markdown viewer would (CommonMark and GFM
    tables): each name is one cell's text, never markup, and every row has its table's width."""
    import re

    from markdown_it import MarkdownIt

    from services.study.markdown import render_markdown

    md = render_markdown(report)
    assert md == render_markdown(report) and md.startswith("## Study: ")
    assert "/runs/" not in md and "ETA" not in md  # nothing that moves while the rows do not
    page = MarkdownIt("commonmark").enable("table").render(md)
    assert "<script" not in page and "<b>" not in page and "<img" not in page
    tables = re.findall(r"<table>.*?</table>", page, re.S)
    # the answers (the confirmatory verdicts first), then the arms, each seed's start and
    # scores, the paired comparisons
    assert len(tables) == 4
    for table in tables:
        widths = {
            len(re.findall(r"<t[hd][ >]", row)) for row in re.findall(r"<tr>.*?</tr>", table, re.S)
        }
        assert len(widths) == 1, table
    answers, arms, seeds, comparisons = tables
    block = report.groups[0].primary
    assert page.index("<h3>The answers</h3>") < page.index(answers) < page.index(arms)
    shown = [
        [html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        for row in re.findall(r"<tr>(.*?)</tr>", answers, re.S)[1:]
    ]
    confirmatory = [c for c in block.comparisons if c.confirmatory]
    assert confirmatory and len(shown) == len(confirmatory)
    for row, c in zip(shown, confirmatory, strict=True):
        assert row[1:3] == [f"{c.a} vs {c.b}", c.verdict] and row[4] == str(len(c.seeds))
        assert row[6].startswith(undecided_why(c, report.alpha)), row  # why it is undecided
    heads = [html.unescape(c) for c in re.findall(r"<th[^>]*>(.*?)</th>", seeds)]
    assert heads == ["seed", "start", *(a.arm for a in block.arms)]
    rows = [
        [html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)]
        for row in re.findall(r"<tr>(.*?)</tr>", seeds, re.S)[1:]
    ]
    assert rows == [
        [
            str(seed),
            f"{block.start_scores[seed]:.3f}",
            *(f"{a.scores[seed]:.3f}" for a in block.arms),
        ]
        for seed in tiny.seeds
    ]
    cells = [html.unescape(c) for c in re.findall(r"<td>(.*?)</td>", arms)]  # the text shown
    assert QUOTED_ARM in cells and HOSTILE_ARM in cells
    pairs = [html.unescape(c) for c in re.findall(r"<tr>\s*<td>(.*?)</td>", comparisons)]
    assert pairs == [f"{c.a} vs {c.b}" for c in report.groups[0].primary.comparisons]
    assert "not decided at 2 seeds" in comparisons
    (title,) = re.findall(r"<h2>(.*?)</h2>", page)
    assert html.unescape(title) == f"Study: {report.name}"

    # The summary (--brief): the same answers and arms tables, the hostile names still text,
    # and neither the seeds nor the comparisons' statistics.
    brief = MarkdownIt("commonmark").enable("table").render(render_markdown(report, brief=True))
    assert "<script" not in brief and "<b>" not in brief and "<img" not in brief
    assert re.findall(r"<table>.*?</table>", brief, re.S) == [answers, arms]
    (title,) = re.findall(r"<h2>(.*?)</h2>", brief)
    assert html.unescape(title) == f"Study: {report.name}"


def test_a_study_without_runs_yet_reports_waiting_cells(db) -> None:  # type: ignore[no-untyped-def]
    from services.study import service
    from services.study.schemas import StudyConfig

    cfg = StudyConfig.model_validate(
        {
            "name": "not started",
            "tasks": {"numberline": {"base": {"task": "numberline", "init": {"kind": "none"}}}},
            "arms": {"a": {}, "b": {"algorithm": "rl4vlm"}},
            "seeds": [1, 2, 3],
        }
    )
    study = service.create_study(db, cfg, "empty-team")
    report = build_report(db, study.id)
    assert (report.progress.cells, report.progress.waiting, report.progress.done) == (6, 6, 0)
    assert report.progress.eta_s is None
    (group,) = report.groups
    assert [a.mean.n for a in group.primary.arms] == [0, 0]
    assert group.primary.comparisons[0].verdict == "not decided at 0 seeds"
    assert group.deal_space.eval_deals == 0
    assert "not decided at 0 seeds" in render_report(report)
