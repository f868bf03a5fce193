"""Study v4's state carried in git (docs/results/v4/study.json.gz for EZPoints and
docs/results/v4-points24/study.json.gz for Points24, written by `gtr study export` where they
ran; issue 56): the studies run across sessions, and each session goes on from these bundles.
Each imports into a fresh embedded store as a user would: its tuning stage arrives with
every finished trial at a point of the arm's declared grid (so the study here does not tune
again and cannot mix two settings in one arm), the warm starts of the seeds still to train are
filed, and every finished run is a cell of the grid its study file declares, trained with the
settings its arm's tuning chose. Imported into one store (EZPoints' first: studies 1 and 2),
each study's `gtr study report ID --markdown` is its section of docs/results-v4.md and its
`--markdown --brief` its summary on docs/results.md."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from sqlalchemy import select

from services.controller.launch import queued_run
from services.study.bundle import read_bundle
from services.study.cli import load_study
from services.study.runner import seconds_needed, warm_start_seconds
from services.study.service import cell_of
from services.study.tuning import apply_selection, grid_points
from shared.db.models import Run
from shared.db.session import session_scope
from shared.schemas import RunConfig
from tests.e2e.helpers import ROOT
from tests.services.study.tiny_study import gtr_cli, page_section

BUNDLE_PATH = "docs/results/v4/study.json.gz"
BUNDLE = ROOT / BUNDLE_PATH
V4 = ROOT / "configs" / "studies" / "v4.toml"
# Points24's study (its own file: a study tunes its arms on one task), carried beside EZPoints'.
POINTS24_PATH = "docs/results/v4-points24/study.json.gz"
POINTS24_BUNDLE = ROOT / POINTS24_PATH
V4_POINTS24 = ROOT / "configs" / "studies" / "v4-points24.toml"
RESULTS = ROOT / "docs" / "results.md"  # the answers: each study's summary (--brief)
FULL = ROOT / "docs" / "results-v4.md"  # each study's full report
FIGURE = ROOT / "docs" / "results" / "v4" / "curves-from-start.png"
POINTS24_FIGURE = ROOT / "docs" / "results" / "v4-points24" / "curves-from-start.png"

pytestmark = pytest.mark.slow


@dataclass
class Imported:
    folder: Path  # the embedded store's data folder
    env: dict[str, str | None]
    out: subprocess.CompletedProcess[str]  # `gtr study import`'s
    study_id: int  # the id the store gave the imported study


def import_bundle(folder: Path, bundle: Path, study_id: int) -> Imported:
    """A bundle imported by `gtr study import` into the embedded store in ``folder``, as a user
    would; it becomes the store's study ``study_id`` (the next id: studies are numbered in the
    order they arrive)."""
    env: dict[str, str | None] = {
        "GTR_DATA_DIR": str(folder),
        "GTR_DATABASE_URL": None,
        "GTR_REDIS_URL": None,
    }
    out = gtr_cli("study", "import", str(bundle), env=env)
    assert f"study {study_id} (new)" in out.stdout, (out.stdout, out.stderr)
    return Imported(folder, env, out, study_id)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One embedded store for both bundles, as docs/results.md's readers import them: EZPoints'
    first (study 1), then Points24's (study 2)."""
    return tmp_path_factory.mktemp("v4-bundle")


@pytest.fixture(scope="module")
def imported(store: Path) -> Imported:
    """EZPoints' bundle, imported: study 1 of the store."""
    return import_bundle(store, BUNDLE, 1)


@pytest.fixture(scope="module")
def imported_points24(store: Path, imported: Imported) -> Imported:
    """Points24's bundle, imported after EZPoints': study 2 of the store."""
    return import_bundle(store, POINTS24_BUNDLE, 2)


def test_the_carried_v4_study_goes_on_where_it_stopped(imported: Imported) -> None:
    check_carried(BUNDLE, V4, imported)

    # docs/results-v4.md's section is this report, as `gtr study report --markdown` prints it
    # from the imported rows, and docs/results.md's summary is its `--brief`: the pages a
    # reviewer reads are what the carried data gives, and an export that changes the data
    # without the pages fails here.
    check_pages(imported, BUNDLE_PATH)
    page = gtr_cli("study", "report", "1", "--markdown", env=imported.env)
    # A choice at an end of a grid that could have found an interior best is named under the
    # arm's choice (tuning.grid_edges): BC's lr is the largest of its 4.
    assert "- bc: selected trial 7" in page.stdout
    assert "  - at the grid's edge: lr 0.001 is the largest of the 4 values searched" in page.stdout
    # An undecided comparison says what the seeds it would need are, past the power estimate's
    # cap too (GTR 0.08 ahead of SFT-only at 0.7, the seeds split 4 to 5), rather than a blank.
    row = next(
        r
        for r in page.stdout.splitlines()
        if r.startswith("| ezpoints · acc-0.7 | gtr vs sft_only")
    )
    assert row.endswith(
        "the seeds disagree: gtr ahead at 4, sft_only at 5 (p = 0.246 ≥ α = 0.05); "
        "more than 40 seeds for 80 % power |"
    ), row


def test_the_carried_points24_study_goes_on_where_it_stopped(imported_points24: Imported) -> None:
    check_carried(POINTS24_BUNDLE, V4_POINTS24, imported_points24)
    check_pages(imported_points24, POINTS24_PATH)  # study 2's, as for EZPoints' above


def check_pages(imported: Imported, bundle: str) -> None:
    """The imported study's full report is its section of docs/results-v4.md, its summary
    (`--brief`) its section of docs/results.md; the summary holds the answers, each arm's
    change from its start and the tuned settings, and none of the full report's per-seed
    tables or trials."""
    sid = str(imported.study_id)
    full = gtr_cli("study", "report", sid, "--markdown", env=imported.env)
    brief = gtr_cli("study", "report", sid, "--markdown", "--brief", env=imported.env)
    assert full.returncode == 0 and brief.returncode == 0, (full.stderr, brief.stderr)
    assert full.stdout == page_section(FULL, bundle, imported.study_id)
    assert brief.stdout == page_section(RESULTS, bundle, imported.study_id, brief=True)
    assert "### The answers" in brief.stdout and "Tuning stage: " in brief.stdout
    assert "Each seed's start" not in brief.stdout and "| arm | trial |" not in brief.stdout


def check_carried(path: Path, study_file: Path, imported: Imported) -> None:
    """The bundle at ``path`` imported (``imported``) is the study ``study_file`` declares, as far
    as it has gone: its tuning stage, the warm starts it still needs, its finished runs."""
    cfg = load_study(study_file)
    assert cfg.tuning is not None
    bundle = read_bundle(path)
    assert bundle["study"]["name"] == cfg.name
    env, got, tmp_path, sid = imported.env, imported.out, imported.folder, imported.study_id
    assert got.returncode == 0, got.stderr
    assert "warning" not in got.stderr, got.stderr
    assert "" not in got.stdout.splitlines(), got.stdout  # no stray output between its lines

    # The tuning stage: every finished trial carried, each at a point of its arm's grid, no
    # point tried twice; an arm's choice, once made, is one of its completed trials.
    carried = {a["arm"]: a for a in bundle["tuning"]}
    assert set(carried) == set(cfg.tuning.arms)
    for arm, knobs in cfg.tuning.arms.items():
        trials = [t for t in carried[arm]["trials"] if t["state"] in ("complete", "pruned")]
        assert f"tuning {arm}: {len(trials)} finished trials carried" in got.stdout
        points = [json.dumps(t["params"], sort_keys=True) for t in trials]
        grid = {json.dumps(p, sort_keys=True) for p in grid_points(knobs)}
        assert set(points) <= grid and len(points) == len(set(points)), arm
        chosen = carried[arm]["selected"]
        if chosen is not None:
            best = [t for t in trials if t["number"] == chosen["trial"]]
            assert best and best[0]["state"] == "complete" and best[0]["params"] == chosen["params"]
    report = gtr_cli("study", "report", str(sid), "--json", env=env)
    assert report.returncode == 0, report.stderr
    tuning = {a["arm"]: a for a in json.loads(report.stdout)["tuning"]}
    for arm, a in carried.items():
        finished = {t["number"]: t["params"] for t in a["trials"] if t["state"] != "running"}
        shown = {t["number"]: t["params"] for t in tuning[arm]["trials"] if t["number"] in finished}
        assert shown == finished, arm

    # The warm starts of the seeds still to train (tuning seeds included) are filed here, so the
    # next session's runs of a seed start from the weights its finished runs started from. A
    # change to the warm-start recipe or its code while a seed is unfinished fails here. Only a
    # seed with cells left carries one (a finished grid has none to carry), and while the
    # tuning stage goes on, its seeds do; a grid seed no run has started has none yet.
    warm = [w for w in bundle["warm_starts"] if w["entry"]]
    assert got.stdout.count(" is in this cache (") == len(warm), got.stdout
    seeds_done = Counter(r["study_seed"] for r in bundle["runs"] if r["status"] == "completed")
    per_seed = Counter(c.seed for c in cfg.cells())
    for w in warm:
        seed = w["cell"]["seed"]
        assert seed in cfg.tuning.seeds or seeds_done[seed] < per_seed[seed], seed
    tuning_seeds = {w["cell"]["seed"] for w in warm} & set(cfg.tuning.seeds)
    assert tuning_seeds == set(cfg.tuning.seeds) or all(a["selected"] for a in carried.values())

    # Every finished grid run is a cell of the declared grid, trained to its last update with
    # the config that cell gets once each arm carries its tuning's choice (less the base's
    # init.checkpoint, an absolute path of the clone it ran in, unread by a warm start).
    with session_scope(f"sqlite:///{tmp_path / 'gtr.sqlite3'}") as s:
        runs = s.scalars(select(Run).where(Run.study_id == sid)).all()
    assert len(runs) == len(bundle["runs"])
    if runs:  # the grid starts only once every arm has its choice
        chosen = {a: carried[a]["selected"]["params"] for a in carried}
        tuned = apply_selection(cfg, chosen)
        cells = set(cfg.cells())
        unread = {"init": {"checkpoint"}}
        for run in runs:
            cell = cell_of(run)
            assert cell in cells, cell
            assert run.status == "completed" and run.updates_done == run.num_updates
            ran, declared = RunConfig.model_validate(run.config), tuned.run_config(cell)
            assert ran.model_dump(exclude=unread) == declared.model_dump(exclude=unread), cell


def test_the_deadline_counts_the_warm_start_a_seeds_first_run_builds(imported: Imported) -> None:
    """`--stop-by` (runner.seconds_needed): a seed whose warm start the carried runs built is
    reused from the cache, while a seed no run has started builds one first; its estimate adds
    what the study's warm starts took to build (each run records it), read from the carried
    runs. Unsaved runs of two cells are estimated against the imported store, which they do not
    change. Once every declared seed has started, the fresh seed is the next one after them (a
    study file that adds seeds gets that estimate)."""
    cfg = load_study(V4)
    carried = {a["arm"]: a["selected"]["params"] for a in read_bundle(BUNDLE)["tuning"]}
    tuned = apply_selection(cfg, carried)
    with session_scope(f"sqlite:///{imported.folder / 'gtr.sqlite3'}") as s:
        runs = s.scalars(select(Run).where(Run.study_id == 1)).all()
        started = {r.study_seed for r in runs}
        built = {w["key"]: w["built_seconds"] for r in runs if (w := r.info.get("warm_start"))}
        again = [c for c in cfg.cells() if c.seed in started and c.arm == "gtr"]
        fresh = [c for c in cfg.cells() if c.seed not in started and c.arm == "gtr"]
        assert again and built
        fresh = fresh or [replace(again[0], seed=max(cfg.seeds_of(again[0].task)) + 1)]
        estimate = {}
        for cell in (fresh[0], again[0]):
            run = queued_run(
                tuned.run_config(cell),
                "default",
                study_id=1,
                study_task=cell.task,
                study_arm=cell.arm,
                study_seed=cell.seed,
                study_variant=cell.variant,
            )
            estimate[cell.seed] = (seconds_needed(s, run), warm_start_seconds(s, run))
        assert s.scalars(select(Run).where(Run.study_id == 1)).all() == runs
    build = sum(built.values()) / len(built)
    assert build > 0
    (fresh_total, fresh_warm), (again_total, again_warm) = estimate.values()
    assert fresh_warm == pytest.approx(build) and again_warm == 0.0
    assert fresh_total is not None and again_total is not None
    assert fresh_total == pytest.approx(again_total + build)


def test_report_into_rewrites_the_pages_section_and_refuses_a_page_it_cannot_place(
    imported: Imported, tmp_path: Path
) -> None:
    """`gtr study report 1 [--brief] --into PAGE` is how docs/results-v4.md and docs/results.md
    take a new export's report: from a stale copy of the page it writes back the page in git
    (the rest kept byte for byte); a page without the study's markers, or opening its section
    twice, is refused in one line with a non-zero exit and left as it was."""
    assert imported.out.returncode == 0, imported.out.stderr
    stale = "## Study: an older export\n\nFinished: 0 of 70 runs.\n"
    for kept, brief in [(FULL, False), (RESULTS, True)]:
        page = tmp_path / kept.name
        current = kept.read_text()
        page.write_text(current.replace(page_section(kept, BUNDLE_PATH, brief=brief), stale))
        assert page.read_text() != current
        args = ["study", "report", "1", *(["--brief"] if brief else []), "--into", str(page)]
        got = gtr_cli(*args, env=imported.env)
        assert got.returncode == 0, got.stderr
        assert f"study 1's {'summary' if brief else 'section'} replaced" in got.stdout
        assert page.read_text() == current
        again = gtr_cli(*args, env=imported.env)
        assert again.returncode == 0 and "already the report" in again.stdout
    # The summary goes only where a page asks for it: a page with the full report's markers
    # alone is refused, and --brief without Markdown is a usage error.
    page = tmp_path / FULL.name
    brief_into = gtr_cli("study", "report", "1", "--brief", "--into", str(page), env=imported.env)
    assert brief_into.returncode == 1 and page.read_text() == FULL.read_text()
    no_line = "has no line `<!-- begin: gtr study report 1 --markdown --brief -->`"
    assert no_line in brief_into.stderr, brief_into.stderr
    bare = gtr_cli("study", "report", "1", "--brief", env=imported.env)
    assert bare.returncode == 2 and "add --markdown or --into PAGE" in bare.stderr
    current = FULL.read_text()

    hostile = "# a page <script>alert('x')</script> \"quoted\"\n\nno markers here\n"
    twice = f"{current}\n<!-- begin: gtr study report 1 --markdown -->\n{stale}"
    unmarked = "<!-- begin: gtr study report 1 --markdown -->\nno end marker\n"
    for body, says in [
        (hostile, "has no line `<!-- begin: gtr study report 1 --markdown -->`"),
        (twice, "opens study 1's section 2 times"),
        (unmarked, "no `<!-- end: gtr study report -->` line after"),
    ]:
        page.write_text(body)
        bad = gtr_cli("study", "report", "1", "--into", str(page), env=imported.env)
        assert bad.returncode == 1, bad.stdout
        assert says in bad.stderr and "nothing was written" in bad.stderr, bad.stderr
        assert "Traceback" not in bad.stderr
        assert page.read_text() == body
    missing = gtr_cli("study", "report", "1", "--into", str(tmp_path / "no.md"), env=imported.env)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    both = gtr_cli("study", "report", "1", "--json", "--into", str(page), env=imported.env)
    assert both.returncode == 2 and "choose one" in both.stderr


@pytest.mark.parametrize(
    ("which", "bundle", "figure"),
    [("imported", BUNDLE, FIGURE), ("imported_points24", POINTS24_BUNDLE, POINTS24_FIGURE)],
    ids=["ezpoints", "points24"],
)
def test_the_pages_figure_is_the_one_the_carried_runs_draw(
    which: str, bundle: Path, figure: Path, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """docs/results.md's figure of each study (each arm's change from each seed's start, a band
    over seeds) is `gtr study figure ID --from-start` on the carried runs: drawn again here, it
    differs from the committed one by at most a few anti-aliased pixels (a new run's curve
    moves far more)."""
    from PIL import Image, ImageChops

    imported: Imported = request.getfixturevalue(which)
    assert imported.out.returncode == 0, imported.out.stderr
    link = f"]({figure.relative_to(ROOT / 'docs').as_posix()})"
    if not read_bundle(bundle)["runs"]:  # nothing to draw yet: the page shows no figure
        assert link not in RESULTS.read_text() and not figure.exists()
        return
    assert link in RESULTS.read_text()
    out = tmp_path / "curves.png"
    sid = str(imported.study_id)
    got = gtr_cli("study", "figure", sid, "--from-start", "--out", str(out), env=imported.env)
    assert got.returncode == 0, got.stderr
    kept, drawn = (Image.open(p).convert("RGB") for p in (figure, out))
    assert kept.size == drawn.size
    diff = ImageChops.difference(kept, drawn).convert("L").point(lambda v: 255 if v > 48 else 0)
    changed = sum(1 for v in diff.getdata() if v)
    assert changed <= 0.002 * kept.size[0] * kept.size[1], changed
