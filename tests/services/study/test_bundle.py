"""`gtr study export` / `gtr study import`: a study the platform really ran (tiny_study.py, on
PostgreSQL) carried as one file into a fresh embedded store (SQLite) reads the same report
there; importing twice adds nothing; a bundle missing a run leaves exactly that cell to train;
and a bad bundle is one message, a non-zero exit, and nothing written."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from services.api.auth import create_token
from services.study import service
from services.study.report import StudyReport, build_report
from services.study.runner import split_start_line
from shared.db.models import Checkpoint, EvalOutcome, Run, Study, Update
from shared.db.session import session_scope
from shared.storage import CheckpointStore, checkpoint_store
from tests.conftest import free_port, wait_serving
from tests.e2e.helpers import ROOT
from tests.services.study.tiny_study import HOSTILE_ARM, TinyStudy, gtr_cli

pytestmark = pytest.mark.slow


def _embedded(tmp: Path) -> dict[str, str | None]:
    """The environment of `gtr` on a fresh embedded store in ``tmp``."""
    return {"GTR_DATA_DIR": str(tmp), "GTR_DATABASE_URL": None, "GTR_REDIS_URL": None}


def _comparable(report: Any, ids: dict[int, int] | None = None) -> dict[str, Any]:
    """A report less what belongs to the store (its id, times, the ETA's clock), with the run
    ids it names mapped through ``ids`` (an imported run's id here -> its original id)."""
    out = report.model_dump(mode="json")
    for key in ("id", "created_at", "runs"):
        out.pop(key)
    out["progress"].pop("eta_s", None)
    return _remap(out, ids or {})


def _remap(obj: Any, ids: dict[int, int]) -> Any:
    """``obj`` with every run id (under a "runs" key, or a "run_id") mapped through ``ids``."""
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            if key == "runs" and isinstance(value, dict):
                out[key] = {k: ids.get(v, v) for k, v in value.items()}
            elif (
                key == "runs" and isinstance(value, list) and all(isinstance(v, int) for v in value)
            ):
                out[key] = [ids.get(v, v) for v in value]
            elif key == "run_id":
                out[key] = ids.get(value, value)
            else:
                out[key] = _remap(value, ids)
        return out
    if isinstance(obj, list):
        return [_remap(v, ids) for v in obj]
    return obj


def _sizes(url: str) -> tuple[int, int, int, int]:
    with session_scope(url) as s:
        return tuple(  # type: ignore[return-value]
            int(s.scalar(select(func.count()).select_from(m)) or 0)
            for m in (Study, Run, Update, EvalOutcome)
        )


@contextmanager
def serving(data: Path) -> Iterator[str]:
    """`gtr serve` on the embedded store in ``data``; yields its base URL."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    env |= {"GTR_DATA_DIR": str(data), "GTR_API_RATE_LIMIT_PER_MINUTE": "0"}
    cmd = [sys.executable, "-m", "services.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_serving(base, proc)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def bundle(real_study: TinyStudy, pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "study.json.gz"
    done = gtr_cli("study", "export", str(real_study.study_id), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert f"study {real_study.study_id}: 4 finished runs (4 completed)" in done.stdout
    return out


def test_an_imported_study_reads_the_same_report_in_another_store(
    real_study: TinyStudy, bundle: Path, tmp_path: Path
) -> None:
    team = ("--team", real_study.team)  # the operator names it (default: "default")
    got = gtr_cli("study", "import", str(bundle), *team, env=_embedded(tmp_path))
    assert got.returncode == 0, got.stderr
    assert "study 1 (new): 4 runs imported, 0 already here; 0 cells have no finished run" in (
        got.stdout
    )
    with session_scope() as s:
        original = build_report(s, real_study.study_id)
        originals = s.scalars(select(Run).where(Run.study_id == real_study.study_id)).all()
        init = {r.id: r.info["init_weights_sha256"] for r in originals}
        # The record's hash is that of the init checkpoint's weight files.
        for r in originals:
            row = s.scalar(
                select(Checkpoint).where(Checkpoint.run_id == r.id, Checkpoint.update_idx == -1)
            )
            assert row is not None
            folder = checkpoint_store().resolve(row.path)
            assert init[r.id] == CheckpointStore.weights_digest(folder, folder.parent / "base")
    sqlite = f"sqlite:///{tmp_path / 'gtr.sqlite3'}"
    with session_scope(sqlite) as s:
        imported = build_report(s, 1)
        study = s.get(Study, 1)
        assert study is not None and study.status == "done" and study.team == real_study.team
        # Nothing left to train: a rerun of the study would start no run.
        p = service.plan(s, study)
        assert (len(p.done), p.pending, p.retry) == (4, [], [])
        runs = s.scalars(select(Run)).all()
        # Each run's starting weights, by hash: arms of a seed compare fairly from the same.
        carried = {r.info["imported"]["from_run"]: r.info["init_weights_sha256"] for r in runs}
        assert carried == init and len(init) == 4
    ids = {r.id: r.info["imported"]["from_run"] for r in runs}  # this store's -> the original's
    assert _comparable(imported, ids) == _comparable(original)
    # The import built and kept the report, so the study page's first view reads it.
    (kept,) = (tmp_path / "cache" / "study-reports").glob("1-*.json")
    kept_report = StudyReport.model_validate_json(kept.read_bytes())
    assert _comparable(kept_report, ids) == _comparable(original)
    assert imported.groups[0].split_starts == []  # each seed's two arms started alike
    # The leak check still sees the training deals, though no step was carried.
    (group,) = imported.groups
    assert group.deal_space.in_training is not None
    assert group.deal_space == original.groups[0].deal_space
    assert HOSTILE_ARM in {a.arm for a in group.primary.arms}  # names carried as text
    # The same bundle again adds nothing.
    before = _sizes(sqlite)
    again = gtr_cli("study", "import", str(bundle), *team, env=_embedded(tmp_path))
    assert again.returncode == 0, again.stderr
    assert "study 1 (existing): 0 runs imported, 4 already here" in again.stdout
    assert _sizes(sqlite) == before

    # And back: exported from this SQLite store, imported into PostgreSQL under another team
    # (a study of its own there), the report is still the original's.
    back = tmp_path / "back.json.gz"
    assert (
        gtr_cli("study", "export", "1", "--out", str(back), env=_embedded(tmp_path)).returncode == 0
    )
    returned_team = f"{real_study.team}-returned"
    home = gtr_cli("study", "import", str(back), "--team", returned_team)
    assert home.returncode == 0 and "(new): 4 runs imported" in home.stdout, home.stderr
    with session_scope() as s:
        (study,) = s.scalars(select(Study).where(Study.team == returned_team)).all()
        returned = build_report(s, study.id)
        hops = {
            r.id: ids[r.info["imported"]["from_run"]]
            for r in s.scalars(select(Run).where(Run.study_id == study.id))
        }
    assert returned.team == returned_team
    assert _comparable(returned, hops) == _comparable(original) | {"team": returned_team}


def test_a_bundle_without_a_run_leaves_that_cell_to_train(bundle: Path, tmp_path: Path) -> None:
    data = json.loads(gzip.decompress(bundle.read_bytes()))
    gone = data["runs"].pop()
    part = tmp_path / "part.json"  # plain JSON reads too
    part.write_text(json.dumps(data))
    got = gtr_cli("study", "import", str(part), env=_embedded(tmp_path))
    assert got.returncode == 0, got.stderr
    assert "3 runs imported, 0 already here; 1 cells have no finished run" in got.stdout
    assert "gtr study run FILE" in got.stdout
    with session_scope(f"sqlite:///{tmp_path / 'gtr.sqlite3'}") as s:
        study = s.get(Study, 1)
        assert study is not None and study.status == "cancelled"  # nothing drives it yet
        service.resume_study(s, study)
        (queued,) = service.advance(s, study)  # what `gtr study run` would train: that cell
        assert (queued.study_arm, queued.study_seed) == (gone["study_arm"], gone["study_seed"])


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "bundle not found"),
        (b"\x1f\x8b not gzip at all", "is not a study bundle (gzip'd JSON)"),
        (b'{"runs": []}', "no format 'gtr-study-bundle'"),
        (b'{"format": "gtr-study-bundle", "version": 99}', "version 99 bundle"),
        (
            b'{"format": "gtr-study-bundle", "version": 1, "study": {"spec": {"name": "x"}}}',
            "the bundle's study is not valid: tasks: Field required",
        ),
    ],
)
def test_a_bad_bundle_is_one_message_and_writes_nothing(
    content: bytes | None, says: str, tmp_path: Path
) -> None:
    path = tmp_path / "bad.json.gz"
    if content is not None:
        path.write_bytes(content)
    got = gtr_cli("study", "import", str(path), env=_embedded(tmp_path))
    assert got.returncode == 1 and says in got.stderr, got.stderr
    assert "Traceback" not in got.stderr
    assert _sizes(f"sqlite:///{tmp_path / 'gtr.sqlite3'}") == (0, 0, 0, 0)


def test_a_bad_run_in_a_bundle_writes_none_of_it(bundle: Path, tmp_path: Path) -> None:
    data = json.loads(gzip.decompress(bundle.read_bytes()))
    data["runs"][1]["updates"][0]["idx"] = "<script>alert(1)</script>"
    del data["runs"][2]["status"]
    for run, says in ((1, "invalid literal for int()"), (2, "no field 'status'")):
        broken = dict(data, runs=[data["runs"][0], data["runs"][run]])
        path = tmp_path / f"broken{run}.json"
        path.write_text(json.dumps(broken))
        got = gtr_cli("study", "import", str(path), env=_embedded(tmp_path))
        assert got.returncode == 1 and "of the bundle: " + says in got.stderr, got.stderr
        assert "Traceback" not in got.stderr
        assert _sizes(f"sqlite:///{tmp_path / 'gtr.sqlite3'}") == (0, 0, 0, 0)


def test_export_refuses_a_missing_study_or_folder(real_study: TinyStudy, tmp_path: Path) -> None:
    got = gtr_cli("study", "export", "99999", "--out", str(tmp_path / "x.json.gz"))
    assert got.returncode == 1 and "study 99999 not found" in got.stderr
    got = gtr_cli(
        "study", "export", str(real_study.study_id), "--out", str(tmp_path / "no" / "x.json.gz")
    )
    assert got.returncode == 1 and "no folder" in got.stderr, got.stderr
    assert not (tmp_path / "x.json.gz").exists()


def test_the_imported_study_and_its_runs_are_pages_of_gtr_serve(
    real_study: TinyStudy, bundle: Path, tmp_path: Path
) -> None:
    """What a user browses after an import: the study page with its verdicts, and each run's
    page saying it came from a bundle, without its steps (hostile names stay text)."""
    team = ("--team", real_study.team)
    assert gtr_cli("study", "import", str(bundle), *team, env=_embedded(tmp_path)).returncode == 0
    with session_scope(f"sqlite:///{tmp_path / 'gtr.sqlite3'}") as s:
        token = create_token(s, "browse", "read", real_study.team)[1]
        run_ids = s.scalars(select(Run.id)).all()
    with serving(tmp_path) as base:
        cookies = {"gtr_token": token}
        study = httpx.get(f"{base}/studies/1", cookies=cookies)
        assert study.status_code == 200
        assert "&lt;script&gt;alert(" in study.text and "<script>alert(" not in study.text
        assert "split-starts" not in study.text
        for run_id in run_ids:
            page = httpx.get(f"{base}/runs/{run_id}", cookies=cookies)
            assert page.status_code == 200 and 'id="imported"' in page.text
            assert "Imported from a study bundle" in page.text
        steps = httpx.get(f"{base}/api/runs/{run_ids[0]}/steps", cookies=cookies)
        assert steps.status_code == 200 and steps.json()["items"] == []


def test_a_seed_whose_arms_started_from_different_weights_is_flagged(
    bundle: Path, tmp_path: Path
) -> None:
    """A bundle whose seed's arms record different starting weights (as when a later session
    rebuilt a warm start differently): the report, its table and its page say so."""
    data = json.loads(gzip.decompress(bundle.read_bytes()))
    run = data["runs"][0]
    run["info"]["init_weights_sha256"] = "0" * 64
    path = tmp_path / "split.json"
    path.write_text(json.dumps(data))
    team = ("--team", data["study"]["team"])
    assert gtr_cli("study", "import", str(path), *team, env=_embedded(tmp_path)).returncode == 0
    with session_scope(f"sqlite:///{tmp_path / 'gtr.sqlite3'}") as s:
        (group,) = build_report(s, 1).groups
    assert group.split_starts == [run["study_seed"]]
    table = gtr_cli("study", "report", "1", env=_embedded(tmp_path))
    assert table.returncode == 0, table.stderr
    assert f"seeds {run['study_seed']}: the arms started from different weights" in table.stdout
    md = gtr_cli("study", "report", "1", "--markdown", env=_embedded(tmp_path))
    assert md.returncode == 0, md.stderr
    assert f"**seeds {run['study_seed']}: the arms started from different weights**" in md.stdout
    both = gtr_cli("study", "report", "1", "--markdown", "--json", env=_embedded(tmp_path))
    assert both.returncode == 2 and "choose one" in both.stderr and "Traceback" not in both.stderr
    with session_scope(f"sqlite:///{tmp_path / 'gtr.sqlite3'}") as s:
        token = create_token(s, "browse", "read", data["study"]["team"])[1]
    with serving(tmp_path) as base:
        page = httpx.get(f"{base}/studies/1", cookies={"gtr_token": token})
    assert page.status_code == 200
    assert f"Not like for like at seed {run['study_seed']}:" in page.text


def test_a_run_from_another_start_is_superseded_and_its_cell_trains_again(
    bundle: Path, tmp_path: Path
) -> None:
    """The remedy for a split start: `gtr study rerun` marks the odd run superseded. It keeps its
    data and page, leaves the report (no split, its seed one run short) and the bundle, and the
    next scheduling queues its cell as the next attempt. Bad input changes nothing."""
    data = json.loads(gzip.decompress(bundle.read_bytes()))
    odd = data["runs"][0]
    odd["info"]["init_weights_sha256"] = "0" * 64
    path = tmp_path / "split.json"
    path.write_text(json.dumps(data))
    env = _embedded(tmp_path)
    assert (
        gtr_cli("study", "import", str(path), "--team", data["study"]["team"], env=env).returncode
        == 0
    )
    url = f"sqlite:///{tmp_path / 'gtr.sqlite3'}"
    cell = (odd["study_arm"], odd["study_seed"])
    with session_scope(url) as s:
        (run_id,) = s.scalars(
            select(Run.id).where(Run.study_arm == cell[0], Run.study_seed == cell[1])
        ).all()
        # What `gtr study run` says when a run of the seed finishes from the other start.
        sibling = s.scalars(
            select(Run).where(Run.study_arm != cell[0], Run.study_seed == cell[1])
        ).one()
        assert [r.id for r in service.other_starts(s, sibling)] == [run_id]
        line = split_start_line(sibling, service.other_starts(s, sibling))
        assert f"run {sibling.id} started from other weights than run {run_id} of " in line
        assert f"`gtr study rerun 1 {run_id} --why" in line
        sibling_id = sibling.id

    def refused(*args: str) -> str:
        out = gtr_cli("study", "rerun", *args, env=env)
        assert out.returncode != 0 and "Traceback" not in out.stderr, out.stderr
        return out.stderr

    assert "study 9 not found" in refused("9", str(run_id), "--why", "x")
    assert "run 999 is not a run of study 1; nothing was changed" in refused(
        "1", str(run_id), "999", "--why", "x"
    )
    assert "say why" in refused("1", str(run_id), "--why", "  ")
    why = "started from <b>another</b> warm start \"q\" 'r' <script>alert(1)</script>"
    ok = gtr_cli("study", "rerun", "1", str(run_id), "--why", why, env=env)
    assert ok.returncode == 0, ok.stderr
    assert f"run {run_id} (numberline / {cell[0]} seed {cell[1]}) superseded" in ok.stdout
    assert "trains its cell again" in ok.stdout
    assert "is superseded: only a finished run" in refused("1", str(run_id), "--why", "again")
    with session_scope(url) as s:
        report = build_report(s, 1)
        (group,) = report.groups
        assert group.split_starts == []  # the odd start is out of the comparison
        arm = next(a for a in group.primary.arms if a.arm == cell[0])
        assert cell[1] not in arm.runs and len(arm.runs) == len(data["runs"]) // 2 - 1
        assert (report.progress.done, report.progress.waiting) == (len(data["runs"]) - 1, 1)
        run = s.get(Run, run_id)
        assert run is not None and run.status == "superseded"
        assert run.info["superseded"]["why"] == why
        assert s.scalar(select(func.count()).where(Update.run_id == run_id))  # data kept
        sibling = s.get(Run, sibling_id)
        assert sibling is not None and service.other_starts(s, sibling) == []
    again = tmp_path / "again.json.gz"
    assert gtr_cli("study", "export", "1", "--out", str(again), env=env).returncode == 0
    assert run_id not in [r["id"] for r in json.loads(gzip.decompress(again.read_bytes()))["runs"]]
    with session_scope(url) as s:
        token = create_token(s, "browse", "read", data["study"]["team"])[1]
    with serving(tmp_path) as base:
        page = httpx.get(f"{base}/runs/{run_id}", cookies={"gtr_token": token})
    assert page.status_code == 200
    assert 'id="superseded"' in page.text and "<b>another</b>" not in page.text
    assert "started from &lt;b&gt;another&lt;/b&gt; warm start" in page.text
    assert "<script>alert(1)</script>" not in page.text
    with session_scope(url) as s:  # what `gtr study run` would train next: that cell, again
        study = s.get(Study, 1)
        assert study is not None and study.status == "queued"  # it was done: it has work again
        (queued,) = service.advance(s, study)
        assert (queued.study_arm, queued.study_seed, queued.study_attempt) == (*cell, 2)
        queued_id = queued.id
    assert f"run {queued_id} is queued: only a finished run" in refused(
        "1", str(queued_id), "--why", "x"
    )
