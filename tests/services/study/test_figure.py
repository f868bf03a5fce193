"""`gtr study figure`: the learning curves of a study the platform really ran (tiny_study.py) as a
PNG, the same bytes from the same rows; an arm name with matplotlib's math markup is drawn as
written; a missing study, metric or folder is one message and exit 1."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from services.study.figure import draw_curves, text
from services.study.report import build_report
from shared.db.session import session_scope
from tests.services.study.tiny_study import TinyStudy, gtr_cli

pytestmark = pytest.mark.slow


def test_the_figure_draws_each_group_the_same_from_the_same_rows(
    real_study: TinyStudy, tmp_path: Path
) -> None:
    sid = str(real_study.study_id)
    first, again = tmp_path / "a.png", tmp_path / "b.png"
    for out in (first, again):
        got = gtr_cli("study", "figure", sid, "--out", str(out))
        assert got.returncode == 0, got.stderr
        assert f"study {sid}: 1 panel of eval/success_rate -> {out}" in got.stdout
    assert first.read_bytes() == again.read_bytes()  # no date or version inside
    with Image.open(first) as im:
        assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 200
        colours = im.convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 20  # lines and bands, not a blank canvas
    relevance = tmp_path / "r.png"
    other = gtr_cli("study", "figure", sid, "--out", str(relevance), "--metric", "probe_relevance")
    assert other.returncode == 0, other.stderr
    assert relevance.read_bytes() != first.read_bytes()
    change = tmp_path / "c.png"  # each arm's change from its seeds' starts
    got = gtr_cli("study", "figure", sid, "--out", str(change), "--from-start")
    assert got.returncode == 0, got.stderr
    assert f"1 panel of eval/success_rate from the start -> {change}" in got.stdout
    assert change.read_bytes() not in (first.read_bytes(), relevance.read_bytes())


def test_an_arm_named_with_math_markup_is_drawn_as_written(
    real_study: TinyStudy, tmp_path: Path
) -> None:
    with session_scope() as s:
        report = build_report(s, real_study.study_id)
    hostile = "gtr $\\frac{1}{0$ 100%"  # unbalanced math: matplotlib would refuse it as math
    groups = [
        g.model_copy(
            update={
                "arms": [hostile, *g.arms[1:]],
                "curves": [
                    c.model_copy(update={"arm": hostile}) if c.arm == g.arms[0] else c
                    for c in g.curves
                ],
            }
        )
        for g in report.groups
    ]
    renamed = report.model_copy(update={"groups": groups})
    assert draw_curves(renamed, "eval/success_rate", tmp_path / "h.png") == 1
    assert text(hostile) == "gtr \\$\\frac{1}{0\\$ 100%"


def test_a_missing_study_metric_or_folder_is_one_message(
    real_study: TinyStudy, tmp_path: Path
) -> None:
    sid = str(real_study.study_id)
    cases = [
        (["99999", "--out", str(tmp_path / "x.png")], "study 99999 not found"),
        (
            [sid, "--out", str(tmp_path / "x.png"), "--metric", "nope/<b>"],
            "has no point of nope/<b>",
        ),
        ([sid, "--out", str(tmp_path / "no" / "x.png")], "no folder"),
        (
            [sid, "--out", str(tmp_path / "x.png"), "--from-start", "--metric", "probe_relevance"],
            "--from-start draws the primary metric only (eval/success_rate)",
        ),
    ]
    for args, says in cases:
        got = gtr_cli("study", "figure", *args)
        assert got.returncode == 1 and says in got.stderr, got.stderr
        assert "Traceback" not in got.stderr
    assert not (tmp_path / "x.png").exists()
