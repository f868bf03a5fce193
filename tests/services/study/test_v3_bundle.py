"""The study v3 runs carried in git (docs/results/v3/study.json.gz, written by `gtr study export`
where they ran): the bundle imports into a fresh embedded store as a user would, every run in
it is a finished run of the grid configs/studies/v3.toml declares, with the config that cell
gets, and the report rebuilds from it: docs/results-v3.md's verdict section is that report, as
`gtr study report --markdown` prints it. A session that continues the study starts from here."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from services.study.bundle import read_bundle
from services.study.report import build_report
from services.study.schemas import StudyConfig
from services.study.service import cell_of
from shared.db.models import Run
from shared.db.session import session_scope
from shared.schemas import RunConfig
from tests.e2e.helpers import ROOT
from tests.services.study.tiny_study import gtr_cli, page_section

BUNDLE = ROOT / "docs" / "results" / "v3" / "study.json.gz"
V3 = ROOT / "configs" / "studies" / "v3.toml"
RESULTS = ROOT / "docs" / "results-v3.md"

pytestmark = pytest.mark.slow


def test_the_carried_v3_runs_are_finished_cells_of_the_declared_grid(tmp_path: Path) -> None:
    cfg = StudyConfig.from_toml(V3)
    bundle = read_bundle(BUNDLE)
    assert bundle["study"]["name"] == cfg.name and bundle["runs"]
    env = {"GTR_DATA_DIR": str(tmp_path), "GTR_DATABASE_URL": None, "GTR_REDIS_URL": None}
    got = gtr_cli("study", "import", str(BUNDLE), env=env)
    assert got.returncode == 0, got.stderr
    # The warm starts of the seeds still to train travel with the bundle and are filed here, so
    # the next session's runs of a seed start from the weights its finished runs started from.
    # A change to the warm-start recipe or its code while a seed is unfinished fails here.
    carried = [w for w in bundle.get("warm_starts", []) if w["entry"]]
    assert "warning" not in got.stderr, got.stderr
    assert got.stdout.count(" is in this cache (") == len(carried), got.stdout
    for w in carried:
        seed = (w["cell"]["task"], w["cell"]["seed"])
        starts = {
            r["info"]["init_weights_sha256"]
            for r in bundle["runs"]
            if (r["study_task"], r["study_seed"]) == seed
        }
        assert starts <= {w["entry"]["weights_sha256"]}, seed
    with session_scope(f"sqlite:///{tmp_path / 'gtr.sqlite3'}") as s:
        runs = s.scalars(select(Run)).all()
        assert len(runs) == len(bundle["runs"])
        cells = set(cfg.cells())
        for run in runs:
            cell = cell_of(run)
            assert cell in cells, cell
            assert run.status == "completed" and run.updates_done == run.num_updates == 60
            # The run trained the cell's config as the study file declares it today (less the
            # base config's init.checkpoint, an absolute path of the clone it ran in, which a
            # warm-started run does not read).
            ran, declared = RunConfig.model_validate(run.config), cfg.run_config(cell)
            assert ran.init.kind == declared.init.kind == "warm_start"
            # v3 ran before evaluation protocols: each run was evaluated under its own env
            # (metrics.eval_protocol unset), which the report reads as a protocol of its own.
            unread = {"init": {"checkpoint"}, "metrics": {"eval_protocol"}}
            assert ran.model_dump(exclude=unread) == declared.model_dump(exclude=unread), cell
        report = build_report(s, 1)
    assert report.primary == "eval/success_rate (final)"
    assert report.progress.done == len(runs) and report.progress.cells == len(cfg.cells())
    for group in report.groups:
        assert group.split_starts == []  # each seed's arms started from the same weights
    # docs/results-v3.md's verdict section is this report, as `gtr study report --markdown`
    # prints it from the imported rows: the page a reviewer reads is what the stored data gives.
    page = gtr_cli("study", "report", "1", "--markdown", env=env)
    assert page.returncode == 0, page.stderr
    assert page.stdout == page_section(RESULTS, "docs/results/v3/study.json.gz")
