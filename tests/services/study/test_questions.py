"""The study's declared questions (services/study/questions.py) on a study the platform really
ran: A - B along the variants' measured level, and whether an arm's metric falls in every run.
Every figure is recomputed here from the stored update rows; the terminal table and the study
page show the answers, hostile arm names as text; a question about an arm the study lacks is
refused by name."""

from __future__ import annotations

import html
import re

import httpx
import pytest
from pydantic import ValidationError
from sqlalchemy import select

from services.study import statistics as st
from services.study.console import render_report
from services.study.outputs import IntervalOut
from services.study.questions import AxisPoint, sign_statement
from services.study.report import build_report
from services.study.schemas import MetricSpec, StudyConfig
from shared.db.models import Run, Update
from shared.db.session import session_scope
from tests.services.study.tiny_study import HOSTILE_ARM, QUOTED_ARM, TinyStudy, run_tiny_study

LEVEL = {"metric": "corrector/accuracy", "reduce": "final"}
RELEVANCE = {"metric": "probe_relevance", "reduce": "final"}


@pytest.fixture(scope="module")
def asked(pg_url: str, warm_checkpoint) -> TinyStudy:  # type: ignore[no-untyped-def]
    """GTR at two corrector levels (exact, and a wrong choice in every correction) and RL4VLM
    shared, one seed, from the warm checkpoint (its steps are well-formed, so the corrector
    answers them); the axis GTR - RL4VLM by the corrector accuracy the runs measured, and
    RL4VLM's probe relevance declared to fall."""
    return run_tiny_study(
        "questions-study",
        seeds=(4,),
        variants={
            "exact": {"corrector": {"errors": {"choice": 0.0}}},
            "fallible": {"corrector": {"errors": {"choice": 1.0}}},
        },
        shared_rl4vlm=True,
        init={"kind": "checkpoint", "checkpoint": str(warm_checkpoint)},
        extra={
            "axis": {"a": QUOTED_ARM, "b": HOSTILE_ARM, "level": LEVEL},
            "trends": [{"arm": HOSTILE_ARM, "metric": RELEVANCE, "direction": "falls"}],
        },
    )


def _curve(s, run_id: int, metric: str) -> list[tuple[int, float]]:  # type: ignore[no-untyped-def]
    rows = s.execute(select(Update.idx, Update.metrics).where(Update.run_id == run_id)).all()
    return sorted((i, float(m[metric])) for i, m in rows if metric in m)


def test_the_axis_orders_the_variants_by_measured_level(asked: TinyStudy) -> None:
    with session_scope() as s:
        report = build_report(s, asked.study_id)
        runs = {
            (r.study_arm, r.study_variant): r
            for r in s.scalars(select(Run).where(Run.study_id == asked.study_id))
        }
        level = MetricSpec.model_validate(LEVEL)
        measured = {
            v: level.score(_curve(s, runs[(QUOTED_ARM, v)].id, LEVEL["metric"]))
            for v in ("exact", "fallible")
        }
    (ax,) = report.axes
    assert (ax.task, ax.a, ax.b, ax.level_metric) == (
        "numberline",
        QUOTED_ARM,
        HOSTILE_ARM,
        "corrector/accuracy (final)",
    )
    # The exact corrector is judged right on every answer; the fallible one on fewer.
    assert measured["exact"] == 1.0 and measured["fallible"] is not None
    assert measured["fallible"] < 1.0
    assert [p.variant for p in ax.points] == ["fallible", "exact"]  # by measured level
    for p in ax.points:
        # RL4VLM has no corrector: the level is GTR's run's alone.
        assert p.level == IntervalOut.of(st.seed_interval([measured[p.variant]]))
        group = next(g for g in report.groups if g.variant == p.variant)
        (c,) = group.primary.comparisons
        assert (c.a, c.b) == (QUOTED_ARM, HOSTILE_ARM)
        assert p.diff == c.mean_diff and p.verdict == c.verdict
    assert ax.statement == sign_statement(QUOTED_ARM, HOSTILE_ARM, LEVEL["metric"], ax.points)
    assert ax.statement.endswith("(decided at no level)")  # one seed decides nothing


def test_a_trend_is_checked_run_by_run(asked: TinyStudy) -> None:
    with session_scope() as s:
        report = build_report(s, asked.study_id)
        (shared,) = s.scalars(
            select(Run).where(Run.study_id == asked.study_id, Run.study_arm == HOSTILE_ARM)
        ).all()
        curve = _curve(s, shared.id, RELEVANCE["metric"])
    (tr,) = report.trends
    assert (tr.task, tr.arm, tr.direction) == ("numberline", HOSTILE_ARM, "falls")
    (run,) = tr.runs  # the shared run once, though it stands in both variants' groups
    assert (run.run_id, run.seed, run.first, run.score) == (
        shared.id,
        4,
        curve[0][1],
        curve[-1][1],
    )
    assert run.holds == (curve[-1][1] < curve[0][1])
    assert tr.statement == (
        "falls in 1 of 1 runs" if run.holds else "falls in 0 of 1 runs (not at seed 4)"
    )


def test_the_answers_are_in_the_table_and_on_the_page(asked: TinyStudy) -> None:
    from services.api.app import create_app
    from tests.conftest import live_server

    with session_scope() as s:
        report = build_report(s, asked.study_id)
    text = render_report(report, width=240)
    assert report.axes[0].statement in text and report.trends[0].statement in text
    with (
        live_server(create_app()) as url,
        httpx.Client(base_url=url, cookies={"gtr_token": asked.read_token}) as c,
    ):
        page = c.get(f"/studies/{asked.study_id}").text
    statement = re.search(r'<p class="axis-statement"><strong>(.*?)</strong>', page)
    assert statement is not None
    assert html.unescape(statement.group(1)) == report.axes[0].statement
    assert len(re.findall(r"<tr><td>(exact|fallible)</td>", page)) == 2
    assert html.escape(report.trends[0].statement) in page
    assert "<script>alert(" not in page
    # The rules of the verdict are on the page: the protocol every arm was scored under, the
    # start before update 0 with each arm's change from it, and the Holm-adjusted p.
    group = report.groups[0]
    assert group.protocol is not None
    assert f'data-protocol="{group.protocol["key"]}"' in page
    assert "p (Holm)" in page and "after Holm" in page
    assert group.primary.start is not None  # the start, evaluated before update 0
    assert 'class="study-start"' in page and "change-from-start" in page


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        (
            {"axis": {"a": "gtr", "b": "ppo", "level": LEVEL}},
            "axis.b: 'ppo' is not an arm of the study",
        ),
        ({"axis": {"a": "gtr", "b": "gtr", "level": LEVEL}}, "axis: a and b are the same arm"),
        (
            {"axis": {"a": "gtr", "b": "rl4vlm", "level": LEVEL}, "variants": {}},
            "axis: the study needs at least two variants",
        ),
        (
            {"trends": [{"arm": "<b>x</b>", "metric": RELEVANCE, "direction": "falls"}]},
            "trends: '<b>x</b>' is not an arm",
        ),
        (
            {"trends": [{"arm": "gtr", "metric": RELEVANCE, "direction": "sinks"}]},
            "Input should be 'falls' or 'rises'",
        ),
    ],
)
def test_a_question_about_a_missing_arm_is_refused_by_name(changes: dict, says: str) -> None:
    spec = {
        "name": "q",
        "seeds": [0],
        "tasks": {"numberline": {"base": {"task": "numberline"}}},
        "arms": {"gtr": {"algorithm": "gtr"}, "rl4vlm": {"algorithm": "rl4vlm"}},
        "variants": {"a": {}, "b": {"train": {"lr": 1e-4}}},
        **changes,
    }
    with pytest.raises(ValidationError, match=re.escape(says)):
        StudyConfig.model_validate(spec)


def _point(variant: str, level: float, diff: float, verdict: str = "not decided at 3 seeds"):  # type: ignore[no-untyped-def]
    return AxisPoint(
        variant=variant,
        level=IntervalOut(point=level, low=None, high=None, n=1),
        diff=IntervalOut(point=diff, low=None, high=None, n=3),
        verdict=verdict,
    )


def test_the_sign_statement_places_each_change_between_its_levels() -> None:
    same = [_point("low", 0.32, 0.05), _point("mid", 0.71, 0.02), _point("high", 1.0, 0.1)]
    assert sign_statement("gtr", "sft", "acc", same) == (
        "The mean gtr − sft is positive at every measured acc from 0.32 to 1.00: no sign change "
        "within the tested range (decided at no level)"
    )
    # A tie is not a change of sign (the first study v3 seeds: 0 at the lowest level).
    tie = [
        _point("low", 0.29, 0.0),
        _point("mid", 0.69, 0.27, "gtr > sft"),
        _point("high", 1.0, 0.29, "gtr > sft"),
    ]
    assert sign_statement("gtr", "sft", "acc", tie) == (
        "The mean gtr − sft is positive at every measured acc from 0.29 to 1.00 where it is not "
        "0: no sign change within the tested range; tied at 0.29 (decided at 0.69 and 1.00; not "
        "at 0.29)"
    )
    zeros = [_point("low", 0.3, 0.0), _point("high", 1.0, 0.0)]
    assert sign_statement("gtr", "sft", "acc", zeros) == (
        "The mean gtr − sft is 0 at every measured acc (decided at no level)"
    )
    decided = [_point("low", 0.3, 0.2, "gtr > sft"), _point("high", 1.0, 0.3, "gtr > sft")]
    assert sign_statement("gtr", "sft", "acc", decided).endswith(
        "no sign change within the tested range (decided at every level)"
    )
    flips = [
        _point("low", 0.32, 0.05, "gtr > sft"),
        _point("mid", 0.71, -0.02),
        _point("high", 1.0, -0.1, "sft > gtr"),
    ]
    assert sign_statement("gtr", "sft", "acc", flips) == (
        "The mean gtr − sft changes sign between acc 0.32 (+0.050) and 0.71 (-0.020) (decided "
        "at 0.32 and 1.00; not at 0.71)"
    )
    assert "fewer than two levels" in sign_statement("gtr", "sft", "acc", flips[:1])
