"""Shared arms and per-task seeds: an arm no variant changes (rl4vlm beside corrector variants)
runs once per task and seed, the scheduler queues it once, and the report compares it with every
variant's arms; configs/studies/v3.toml declares the v3 grid; `gtr study plan` lists it."""

from __future__ import annotations

import html
import re
from collections import Counter
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from sqlalchemy import select

from services.study import service
from services.study.console import render_report
from services.study.report import build_report
from services.study.schemas import Cell, StudyConfig
from services.study.service import warm_group
from shared.db.models import Run
from shared.db.session import session_scope
from tests.e2e.helpers import ROOT
from tests.services.study.tiny_study import (
    HOSTILE_ARM,
    QUOTED_ARM,
    TinyStudy,
    gtr_cli,
    run_tiny_study,
)

V3 = ROOT / "configs" / "studies" / "v3.toml"
BASE = {"task": "numberline", "init": {"kind": "none"}}
LEVELS = {
    "exact": {"corrector": {"errors": {"misread": 0.0}}},
    "fallible": {"corrector": {"errors": {"misread": 0.1, "arithmetic": 0.1, "choice": 0.1}}},
}


def spec(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "shared",
        "tasks": {"numberline": {"base": BASE}, "ezpoints": {"base": {**BASE, "task": "ezpoints"}}},
        "arms": {
            "gtr": {"algorithm": "gtr"},
            "sft_only": {"algorithm": "sft_only"},
            "rl4vlm": {"algorithm": "rl4vlm", "env": {"early_truncation": "off"}},
        },
        "seeds": [0, 1, 2],
        "variants": LEVELS,
        "shared_arms": ["rl4vlm"],
    }
    return {**body, **changes}


def test_a_shared_arm_runs_once_per_task_and_seed_and_takes_no_variant() -> None:
    tasks = spec()["tasks"]
    tasks["ezpoints"]["seeds"] = [7, 8]
    cfg = StudyConfig.model_validate(spec(tasks=tasks))
    cells = cfg.cells()
    assert Counter((c.task, c.arm, c.variant) for c in cells) == {
        **{("numberline", a, v): 3 for a in ("gtr", "sft_only") for v in LEVELS},
        ("numberline", "rl4vlm", ""): 3,
        **{("ezpoints", a, v): 2 for a in ("gtr", "sft_only") for v in LEVELS},
        ("ezpoints", "rl4vlm", ""): 2,
    }
    assert len(cells) == len(set(cells)) == 3 * 5 + 2 * 5
    assert cfg.seeds_of("ezpoints") == [7, 8] and cfg.seeds_of("numberline") == [0, 1, 2]
    # A seed's runs are adjacent (its warm start is built once, then reused by the others).
    assert cells[:5] == [
        Cell("numberline", "gtr", 0, "exact"),
        Cell("numberline", "sft_only", 0, "exact"),
        Cell("numberline", "rl4vlm", 0, ""),
        Cell("numberline", "gtr", 0, "fallible"),
        Cell("numberline", "sft_only", 0, "fallible"),
    ]
    shared = cfg.run_config(Cell("numberline", "rl4vlm", 0))
    assert shared.corrector.errors.any() is False  # no variant's overlay
    assert shared.name == "shared · numberline / rl4vlm / seed 0"
    fallible = cfg.run_config(Cell("numberline", "gtr", 0, "fallible"))
    assert fallible.corrector.errors.choice == 0.1


def test_without_shared_arms_every_arm_runs_under_every_variant() -> None:
    cfg = StudyConfig.model_validate(spec(shared_arms=[]))
    counts = Counter((c.task, c.arm, c.variant) for c in cfg.cells())
    assert counts == {
        (t, a, v): 3 for t in ("numberline", "ezpoints") for a in cfg.arms for v in LEVELS
    }
    # The shipped studies have no shared arms: their grids are the full products.
    for name, runs in (("demo", 1 * 2 * 2), ("paper", 3 * 4 * 8)):
        assert (
            len(StudyConfig.from_toml(ROOT / "configs" / "studies" / f"{name}.toml").cells())
            == runs
        )


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        (
            {"shared_arms": ["rl4vml"]},
            "shared_arms: 'rl4vml' is not an arm of the study (its arms: 'gtr', 'sft_only', "
            "'rl4vlm')",
        ),
        ({"shared_arms": ["rl4vlm", "rl4vlm"]}, "shared_arms: an arm is listed twice"),
        (
            {"variants": {**LEVELS, "fast": {"train": {"lr": 3e-4}}}},
            "shared_arms: variant 'fast' changes the run of arm 'rl4vlm' on task 'numberline' "
            "(train.lr)",
        ),
        (
            # A judge-reward rl4vlm calls the corrector: a corrector variant changes its run.
            {
                "arms": {
                    "gtr": {"algorithm": "gtr"},
                    "rl4vlm": {
                        "algorithm": "rl4vlm",
                        "train": {"judge_reward": 1.0},
                        "corrector": {"wait": "update"},
                    },
                }
            },
            "variant 'fallible' changes the run of arm 'rl4vlm' on task 'numberline' "
            "(corrector.errors.arithmetic)",
        ),
        ({"tasks": {"t": {"base": BASE, "seeds": [1, 1]}}}, "seeds repeat"),
        ({"tasks": {"t": {"base": BASE, "seeds": []}}}, "at least 1 item"),
    ],
)
def test_a_bad_shared_arm_or_task_seed_list_is_refused_by_name(
    changes: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValidationError) as e:
        StudyConfig.model_validate(spec(**changes))
    assert says in str(e.value)


def test_a_study_file_this_version_cannot_read_does_not_stop_the_others(db) -> None:  # type: ignore[no-untyped-def]
    """A study stored by a newer version (a field this one does not know, as in a rolling
    upgrade): the controllers' `advance_all` skips it and goes on with every other study."""
    unreadable = service.create_study(db, StudyConfig.model_validate(spec()), "newer")
    unreadable.spec = {**unreadable.spec, "a_field_of_a_later_version": True}
    readable = service.create_study(db, StudyConfig.model_validate(spec()), "older")
    db.flush()
    queued = service.advance_all(db)
    mine = {r.study_id for r in db.scalars(select(Run).where(Run.status == "queued"))}
    assert readable.id in mine and unreadable.id not in mine and queued >= 1
    assert unreadable.status == "queued"  # left for a controller that can read it


def test_the_scheduler_queues_a_shared_arm_once_per_seed(db) -> None:  # type: ignore[no-untyped-def]
    cfg = StudyConfig.model_validate(spec(concurrency=100))
    study = service.create_study(db, cfg, "shared-arms")
    queued = service.advance(db, study)
    assert Counter((r.study_task, r.study_arm, r.study_variant) for r in queued) == Counter(
        (c.task, c.arm, c.variant) for c in cfg.cells()
    )
    assert len(queued) == 30  # 2 tasks x 3 seeds x (2 arms x 2 levels + 1 shared)
    assert service.advance(db, study) == []  # every cell has its run: nothing more to queue
    counts = service.plan(db, study).counts()
    assert (counts["cells"], counts["queued"], counts["waiting"]) == (30, 30, 0)
    rl4vlm = [r for r in queued if r.study_arm == "rl4vlm"]
    assert {(r.study_task, r.study_seed) for r in rl4vlm} == {
        (t, s) for t in ("numberline", "ezpoints") for s in (0, 1, 2)
    }
    report = build_report(db, study.id)
    assert [(g.task, g.variant) for g in report.groups] == [
        (t, v) for t in ("numberline", "ezpoints") for v in LEVELS
    ]
    assert all(g.shared_arms == ["rl4vlm"] for g in report.groups)


@pytest.fixture(scope="module")
def shared_study(pg_url: str, default_model_dir) -> TinyStudy:  # type: ignore[no-untyped-def]
    """The real tiny study (tiny_study.py) with two corrector levels and the RL4VLM arm shared:
    one seed, so three runs (GTR at each level, RL4VLM once), fewer than the real_study's four."""
    return run_tiny_study(
        "shared-arm-study",
        seeds=(3,),
        variants={
            "exact": {"corrector": {"errors": {"choice": 0.0}}},
            "fallible": {"corrector": {"errors": {"choice": 0.5}}},
        },
        shared_rl4vlm=True,
    )


def test_a_shared_run_stands_in_every_variant_group_of_the_report(shared_study: TinyStudy) -> None:
    with session_scope() as s:
        report = build_report(s, shared_study.study_id)
        runs = {
            (r.study_arm, r.study_variant): r for r in s.query(Run).filter_by(study_id=report.id)
        }
        configs = {key: r.config for key, r in runs.items()}
    assert sorted(runs, key=str) == sorted(
        [(QUOTED_ARM, "exact"), (QUOTED_ARM, "fallible"), (HOSTILE_ARM, "")], key=str
    )
    assert configs[(QUOTED_ARM, "fallible")]["corrector"]["errors"]["choice"] == 0.5
    p = report.progress
    assert (p.cells, p.done, p.waiting, p.failed) == (3, 3, 0, 0) and report.status == "done"
    shared_run = runs[(HOSTILE_ARM, "")].id
    assert [g.variant for g in report.groups] == ["exact", "fallible"]
    for g in report.groups:
        assert g.arms == [QUOTED_ARM, HOSTILE_ARM] and g.shared_arms == [HOSTILE_ARM]
        scores = {a.arm: a for a in g.primary.arms}
        # The shared run is scored in each group, beside that variant's own GTR run.
        assert scores[HOSTILE_ARM].runs == {3: shared_run}
        assert scores[QUOTED_ARM].runs == {3: runs[(QUOTED_ARM, g.variant)].id}
        (c,) = g.primary.comparisons
        assert (c.a, c.b, c.seeds) == (QUOTED_ARM, HOSTILE_ARM, [3])
        assert c.diffs == pytest.approx(
            [scores[QUOTED_ARM].scores[3] - scores[HOSTILE_ARM].scores[3]]
        )
        assert sorted(c.runs) == sorted([shared_run, runs[(QUOTED_ARM, g.variant)].id])
        assert c.verdict == "not decided at 1 seed"
        curve = next(
            x for x in g.curves if x.arm == HOSTILE_ARM and x.metric == "eval/success_rate"
        )
        assert curve.points and all(pt.n == 1 for pt in curve.points)
    a, b = (g.primary.arms for g in report.groups)
    assert a[1] == b[1]  # the shared arm's figures are one and the same in both groups
    text = render_report(report, width=200)
    assert text.count(f"({HOSTILE_ARM}: no variant, shared by all)") == 2


def test_v3_declares_its_grid_primary_metric_and_levels() -> None:
    cfg = StudyConfig.from_toml(V3)
    assert (cfg.primary.metric, cfg.primary.reduce) == ("eval/success_rate", "final")
    assert [m.metric for m in cfg.secondary] == ["probe_relevance", "corrector/accuracy"]
    assert cfg.shared_arms == ["rl4vlm"] and list(cfg.arms) == ["gtr", "sft_only", "rl4vlm"]
    assert cfg.axis is not None and (cfg.axis.a, cfg.axis.b) == ("gtr", "sft_only")
    assert (cfg.axis.level.metric, cfg.axis.level.k) == ("corrector/accuracy", 10)
    assert [(t.arm, t.metric.metric, t.direction) for t in cfg.trends] == [
        ("rl4vlm", "probe_relevance", "falls")
    ]
    assert cfg.seeds_of("ezpoints") == [0, 1, 2, 3, 4, 5] and cfg.seeds_of("points24") == [0, 1, 2]
    cells = cfg.cells()
    counts = Counter((c.task, c.arm, c.variant) for c in cells)
    levels = ("acc-1.0", "acc-0.7", "acc-0.3")
    assert counts == {
        **{("ezpoints", a, v): 6 for a in ("gtr", "sft_only") for v in levels},
        ("ezpoints", "rl4vlm", ""): 6,
        **{("points24", a, v): 3 for a in ("gtr", "sft_only") for v in levels},
        ("points24", "rl4vlm", ""): 3,
    }
    assert len(cells) == 6 * 7 + 3 * 7 == 63
    # One warm start per task and seed: rl4vlm's env differs only by its truncation rule,
    # which the warm start does not play by (shared/warmenv.py, warm_env).
    assert len({warm_group(cfg.run_config(c)) for c in cells} - {None}) == 6 + 3
    errors = {
        v: cfg.run_config(Cell("ezpoints", "gtr", 0, v)).corrector.errors.model_dump()
        for v in levels
    }
    # The settings whose accuracy docs/training.md measured: 1.0, ~0.71, ~0.32.
    rates = [sum(e[k] for k in ("misread", "arithmetic", "choice")) for e in errors.values()]
    assert [round(1 - r, 2) for r in rates] == [1.0, 0.7, 0.3]
    for task in ("ezpoints", "points24"):
        for cell in [c for c in cells if c.task == task]:
            run = cfg.run_config(cell)
            assert run.task == task and run.train.num_updates == 60
            assert run.init.kind == "warm_start" and run.metrics.eval_episodes == 128
            # The paper's GTR loop truncates; RL4VLM's does not.
            rule = "off" if cell.arm == "rl4vlm" else "reference"
            assert run.env.early_truncation == rule, cell


def test_gtr_study_plan_lists_the_cells_and_refuses_a_bad_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = gtr_cli("study", "plan", str(V3), env={"GTR_DATA_DIR": str(tmp_path / "data")})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("study gtr-v3-corrector-quality: 63 runs, ")
    assert "task points24: seeds 0, 1, 2" in lines
    assert "  variant acc-0.3: gtr 6, sft_only 6" in lines
    assert "  no variant, shared by every variant: rl4vlm 3" in lines
    assert lines[-1].startswith("warm starts to build: 9 ")
    assert not (tmp_path / "data").exists()  # a plan writes nothing
    bad = tmp_path / "bad.toml"
    bad.write_text(
        "name = 'x'\nseeds = [0]\nshared_arms = ['nope']\n"
        "[tasks.t]\nbase = {task = 'numberline'}\n[arms.a]\n"
    )
    for command in ("plan", "run"):
        refused = gtr_cli("study", command, str(bad), env={"GTR_DATA_DIR": str(tmp_path / "data")})
        assert refused.returncode == 1, refused.stderr
        assert "shared_arms: 'nope' is not an arm of the study (its arms: 'a')" in refused.stderr
        assert "Traceback" not in refused.stderr


def test_the_study_page_marks_the_shared_arm_in_each_variant(shared_study: TinyStudy) -> None:
    from services.api.app import create_app
    from tests.conftest import live_server

    with (
        live_server(create_app()) as url,
        httpx.Client(base_url=url, cookies={"gtr_token": shared_study.read_token}) as c,
    ):
        page = c.get(f"/studies/{shared_study.study_id}")
    assert page.status_code == 200
    marks = re.findall(r'<p class="muted shared-arms">(.*?)</p>', page.text)
    assert len(marks) == 2  # the exact and the fallible variant's groups
    escaped = html.escape(HOSTILE_ARM).replace("&#x27;", "&#39;")  # Jinja escapes quotes so
    assert all(f'<span class="arm">{escaped}</span>' in m for m in marks), marks
    assert "<script>alert(" not in page.text
