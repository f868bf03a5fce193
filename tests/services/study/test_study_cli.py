"""`gtr study run`: a bad study file is one clear message and a non-zero exit; an edited primary
metric is refused once the study has runs; and the demo study runs to its verdict table on the
embedded default, its evaluation deals stored from the evaluation seed space."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select, update

from services.study import service
from services.study.report import build_report
from services.study.schemas import StudyConfig
from shared.db.models import EvalOutcome, Run, Study, Update
from shared.db.session import session_scope
from shared.seeds import eval_seed
from shared.storage import CheckpointStore
from tests.e2e.helpers import ROOT, tiny_config
from tests.services.study.tiny_study import gtr_cli

DEMO = ROOT / "configs" / "studies" / "demo.toml"
GOOD = """
name = "cli-study"
seeds = [0, 1]
eval_episodes = 4
[tasks.numberline]
config = "{base}"
[arms.gtr]
algorithm = "gtr"
[arms.rl4vlm]
algorithm = "rl4vlm"
"""


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("name = 'x'\nseeds = [0]\n[arms.a]\n", "tasks: Field required"),
        (
            "name = 'x'\nseeds = [-1]\n[tasks.t]\nbase = {task = 'numberline'}\n[arms.a]\n",
            "seed -1",
        ),
        ("name = 'x'\nseeds = [0]\n[tasks.t]\nconfig = 'nowhere.toml'\n[arms.a]\n", "cannot read"),
        (
            "name = 'x'\nseeds = [0]\n[tasks.t]\nbase = {task = 'numberline'}\n"
            "[arms.a]\ntrain = {lr = 'fast'}\n",
            "task 't', arm 'a', seed 0: train.lr",
        ),
        ("name = 'x'\nseeds = [0\n", "is not valid TOML"),
    ],
)
def test_a_bad_study_file_is_one_message_and_a_non_zero_exit(
    tmp_path: Path, text: str, says: str
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    out = gtr_cli("study", "run", str(bad), env={"GTR_DATA_DIR": str(tmp_path / "data")})
    assert out.returncode != 0
    assert says in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert not (tmp_path / "data" / "studies").exists()  # nothing ran
    missing = gtr_cli("study", "run", str(tmp_path / "none.toml"))
    assert missing.returncode != 0 and "study file not found" in missing.stderr


def test_an_edited_primary_metric_is_refused_once_the_study_has_runs(
    pg_url: str, tmp_path: Path
) -> None:
    base = ROOT / "configs" / "numberline-tiny.toml"
    path = tmp_path / "study.toml"
    path.write_text(GOOD.format(base=base))
    cfg = StudyConfig.from_toml(path)
    with session_scope() as s:  # the study as `gtr study run` leaves it: created, runs queued
        study = service.create_study(s, cfg, "default")
        queued = service.advance(s, study)
        study_id = study.id
    assert queued
    try:
        edited = "primary = { metric = 'eval/success_rate', reduce = 'last_k_mean', k = 2 }\n"
        path.write_text(edited + GOOD.format(base=base))
        out = gtr_cli("study", "run", str(path))
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert f"study {study_id} ('cli-study') has runs" in out.stderr
        assert "eval/success_rate (final); it cannot become" in out.stderr
        assert "eval/success_rate (mean of last 2)" in out.stderr
        with session_scope() as s:
            row = s.get(Study, study_id)
            assert row is not None and row.spec["primary"]["reduce"] == "final"
    finally:
        with session_scope() as s:
            s.execute(update(Study).where(Study.id == study_id).values(status="cancelled"))
            s.execute(update(Run).where(Run.study_id == study_id).values(status="cancelled"))


def gtr_here(*args: str, env: dict[str, str | None]) -> subprocess.CompletedProcess[str]:
    """`gtr ARGS` as ``gtr_cli`` gives it (exit code, stdout, stderr), through the CLI's own group
    in this process: the pytest worker has torch loaded already, which a process of its own spends
    ~4 s of CPU importing (most of a bundle command's time). ``env`` as ``gtr_cli``'s; the
    variables, the settings and the default engine are this process's own again afterwards. An
    exception the CLI lets through is raised here (a traceback in a process of its own)."""
    from click.testing import CliRunner

    from services.cli import main
    from shared.db.session import get_engine
    from shared.settings import get_settings

    saved = dict(os.environ)

    def fresh() -> None:  # the settings and the engine of no URL follow the variables
        with suppress(Exception):
            get_engine().dispose()
        get_engine.cache_clear()
        get_settings.cache_clear()

    try:
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        fresh()
        result = CliRunner().invoke(main, list(args))
    finally:
        fresh()
        os.environ.clear()
        os.environ.update(saved)
        get_settings.cache_clear()
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.stdout, result.stderr)


@dataclass
class Demo:
    """The demo study as `gtr study run` leaves it on a fresh embedded store."""

    env: dict[str, str | None]
    data: Path
    out: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Demo:
    data = tmp_path_factory.mktemp("demo") / "data"
    env = {
        "GTR_DATA_DIR": str(data),
        "GTR_MODEL_DIR": str(default_model_dir.parent),  # the session's tiny model, not a new one
        "GTR_DATABASE_URL": None,  # the embedded default: SQLite, every part in process
        "GTR_REDIS_URL": None,
    }
    out = gtr_cli("study", "run", str(DEMO), "--jobs", "2", env=env, timeout=1800)
    return Demo(env, data, out)


@pytest.mark.slow
def test_the_demo_study_runs_to_its_verdict_table_on_the_embedded_default(demo: Demo) -> None:
    env, out, tmp_path = demo.env, demo.out, demo.data.parent
    assert "study 1: demo (new), 4 runs" in out.stdout and "study 1 done" in out.stdout
    assert "eval/success_rate (final)" in out.stdout  # the verdict table
    # The tuning stage first: GTR's two sft_coef trials on tuning seed 100, then the choice.
    assert "tuning gtr trial 0 {'sft_coef': 0.5}: runs" in out.stdout
    assert "tuning gtr trial 1 {'sft_coef': 2.0}: runs" in out.stdout
    assert "tuning gtr: selected trial " in out.stdout
    assert out.stdout.index("tuning gtr: selected") < out.stdout.index("gtr seed 0: started")
    url = f"sqlite:///{tmp_path / 'data' / 'gtr.sqlite3'}"
    with session_scope(url) as s:
        (group,) = build_report(s, 1).groups
        # 2 seeds decide nothing (the smallest sign-flip p is 0.5): the verdict says so.
        assert [c.verdict for c in group.primary.comparisons] == ["not decided at 2 seeds"]
        trials = s.scalars(select(Run).where(Run.study_id.is_(None))).all()
        assert {r.config["seed"] for r in trials} == {100} and 1 <= len(trials) <= 2
        study = s.get(Study, 1)
        assert study is not None
        chosen = study.spec["arms"]["gtr"]["train"]["sft_coef"]
        assert chosen in (0.5, 2.0)
        grid = select(Run).where(Run.study_id == 1)
        runs = sorted(s.scalars(grid).all(), key=lambda r: (r.study_seed, r.study_arm))
        assert all(r.config["train"]["sft_coef"] == chosen for r in runs if r.study_arm == "gtr")
        assert [(r.study_arm, r.study_seed, r.status) for r in runs] == [
            ("gtr", 0, "completed"),
            ("rl4vlm", 0, "completed"),
            ("gtr", 1, "completed"),
            ("rl4vlm", 1, "completed"),
        ]
        # One warm start per seed: rl4vlm waited for gtr's and reused it.
        reused = [bool(r.info["warm_start"]["reused"]) for r in runs]
        assert reused == [False, True, False, True]
        ids = [r.id for r in runs]
        outcomes = s.scalars(select(EvalOutcome).where(EvalOutcome.run_id.in_(ids))).all()
    for run_id in ids:  # each run's process wrote its log where the study's runs are logged
        assert (
            f"run {run_id} completed"
            in (demo.data / "studies" / "1" / f"run-{run_id}.log").read_text()
        )
    # 4 deals before update 0 (the start), after the first and after the last of the 3 updates
    # (eval_every = 3) of each run, dealt from the evaluation seed space.
    assert len(outcomes) == 4 * 3 * 4
    assert sorted({o.update_idx for o in outcomes}) == [-1, 0, 2]
    assert sum(o.update_idx == -1 for o in outcomes) == 4 * 4
    assert {(o.deal, o.seed) for o in outcomes} == {(d, eval_seed(d)) for d in range(4)}
    # The report's JSON: the one protocol every arm was scored under, the start (one per seed,
    # shared by both arms) and each arm's change from it, Holm-adjusted p beside the raw one.
    got = gtr_here("study", "report", "1", "--json", env=env)
    data = json.loads(got.stdout)
    (g,) = data["groups"]
    assert g["protocol"]["key"] and g["protocol"]["episodes"] == 4 and not g["protocol_runs"]
    assert g["protocol"]["env"]["early_truncation"] == "off"  # the task's, not an arm's
    primary = g["primary"]
    assert sorted(primary["start_scores"]) == ["0", "1"] and primary["start"]["n"] == 2
    assert all(a["change_from_start"]["n"] == 2 for a in primary["arms"])
    (c,) = primary["comparisons"]
    assert c["p_holm"] is not None and c["p_holm"] >= c["p_value"] and c["confirmatory"]
    gtr = next(a for a in primary["arms"] if a["arm"] == "gtr")
    assert gtr["sft_share"] is not None and gtr["sft_share"] >= 0
    again = gtr_here("study", "run", str(DEMO), env=env)  # resumes: nothing to rerun
    assert again.returncode == 0 and "started" not in again.stdout, again.stdout
    with session_scope(url) as s:  # the ETA's divisor: the processes of the last invocation
        study = s.get(Study, 1)
        declared = StudyConfig.from_toml(DEMO).concurrency
        assert study is not None and study.concurrency == 1 != declared


@pytest.mark.slow
def test_a_bundle_carries_the_warm_start_a_seed_still_needs(demo: Demo, tmp_path: Path) -> None:
    """A study moving to another machine mid-seed: its bundle carries the seed's cached warm
    start, the import files it in the other machine's cache (whose base model it built itself,
    equal by content), and the cell trained there starts from the very weights the seed's
    finished run started from: the seed stays like for like. A warm start that machine would
    build otherwise (other code) is a warning and is not filed; a malformed one is one message
    and nothing written."""
    assert demo.out.returncode == 0, demo.out.stdout[-3000:] + demo.out.stderr[-3000:]
    here = tmp_path / "here"
    shutil.copytree(demo.data, here)
    env = {**demo.env, "GTR_DATA_DIR": str(here)}
    with session_scope(f"sqlite:///{here / 'gtr.sqlite3'}") as s:
        seed1 = s.scalars(select(Run).where(Run.study_seed == 1)).all()
        odd = next(r.id for r in seed1 if r.study_arm == "rl4vlm")
        start = {r.info["init_weights_sha256"] for r in seed1}
    assert len(start) == 1
    assert gtr_here("study", "rerun", "1", str(odd), "--why", "moves", env=env).returncode == 0
    bundle, thin = tmp_path / "study.json.gz", tmp_path / "thin.json.gz"
    out = gtr_here("study", "export", "1", "--out", str(bundle), env=env)
    assert out.returncode == 0, out.stderr
    assert "carried the warm start of numberline seed 1 (" in out.stdout
    assert "seed 0" not in out.stdout  # finished: nothing of it to carry
    out = gtr_here("study", "export", "1", "--out", str(thin), "--no-warm-starts", env=env)
    assert out.returncode == 0 and "warm start" not in out.stdout, out.stdout

    # Another machine: a fresh store that builds its own tiny base model.
    there = tmp_path / "there"
    elsewhere = {**demo.env, "GTR_DATA_DIR": str(there), "GTR_MODEL_DIR": None}
    for i in range(2):  # importing twice files nothing new
        got = gtr_here("study", "import", str(bundle), env=elsewhere)
        assert got.returncode == 0 and "warning" not in got.stderr, got.stderr
        assert "the warm start of numberline seed 1 is in this cache (" in got.stdout
        # The tuning stage comes along (both trials finished, the choice made), once.
        carried = "tuning gtr: 2 finished trials carried, its choice"
        kept = "tuning gtr: this store's own stage kept (not the bundle's)"
        assert (carried if i == 0 else kept) in got.stdout, got.stdout
    (entry,) = [d for d in (there / "cache" / "warmstart").iterdir() if d.name[0] != "."]
    assert CheckpointStore.weights_digest(entry / "model") in start
    trained = gtr_here("study", "run", str(DEMO), env=elsewhere)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "started from other weights" not in trained.stdout
    assert "tuning gtr trial" not in trained.stdout  # not tuned again: trains at the choice
    here_report = json.loads(gtr_here("study", "report", "1", "--json", env=env).stdout)
    there_report = json.loads(gtr_here("study", "report", "1", "--json", env=elsewhere).stdout)
    (mine,), (theirs,) = here_report["tuning"], there_report["tuning"]
    assert theirs["selected"] == mine["selected"] is not None
    assert [(t["params"], t["state"], t["score"]) for t in theirs["trials"]] == [
        (t["params"], t["state"], t["score"]) for t in mine["trials"]
    ]
    with session_scope(f"sqlite:///{there / 'gtr.sqlite3'}") as s:
        new = s.scalars(select(Run).where(Run.study_seed == 1, Run.study_arm == "rl4vlm")).one()
        assert new.status == "completed" and new.info["warm_start"]["reused"] is True
        assert new.info["init_weights_sha256"] in start
        (group,) = build_report(s, 1).groups
        assert group.split_starts == [] and sorted(group.primary.arms[1].runs) == [0, 1]

    def stored(data: Path) -> tuple[int, list[str]]:
        with session_scope(f"sqlite:///{data / 'gtr.sqlite3'}") as s:
            studies = len(s.scalars(select(Study)).all())
        cache = data / "cache" / "warmstart"
        return studies, sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []

    def importing(
        name: str, edit: Callable[[dict[str, Any]], None] | None = None
    ) -> tuple[Path, subprocess.CompletedProcess[str]]:
        data = json.loads(gzip.decompress((thin if edit is None else bundle).read_bytes()))
        if edit is not None:
            edit(data["warm_starts"][0])
        path, store = tmp_path / f"{name}.json", tmp_path / name
        path.write_text(json.dumps(data))
        got = gtr_here("study", "import", str(path), env={**env, "GTR_DATA_DIR": str(store)})
        assert "Traceback" not in got.stderr, got.stderr
        return store, got

    store, got = importing("thin")
    assert got.returncode == 0
    assert "warning: the bundle carries no warm start of numberline seed 1: its seed's next " in (
        got.stderr
    )
    assert stored(store) == (1, [])

    def other_code(w: dict[str, Any]) -> None:
        w["entry"]["inputs"]["code"] = "0" * 64

    store, got = importing("other-code", other_code)
    assert got.returncode == 0
    assert (
        "warning: the warm start of numberline seed 1 was not installed, it was built with "
        "other warm-start code: its seed's next runs build it again"
    ) in got.stderr
    assert stored(store) == (1, [])

    def damaged(w: dict[str, Any]) -> None:
        name = next(n for n in w["entry"]["files"] if n.endswith(".safetensors"))
        w["entry"]["files"][name] = "eA=="

    def outside(w: dict[str, Any]) -> None:
        w["entry"]["files"]["../../evil.safetensors"] = "eA=="

    def hostile(w: dict[str, Any]) -> None:
        w["cell"]["task"] = "<script>alert('t')</script>"

    for edit, says in (
        (damaged, "its weights are not the ones it was packed with (damaged)"),
        (outside, "it names a file outside its folder: '../../evil.safetensors'"),
        (hostile, "warm start 1 of the bundle is for no cell of the study"),
    ):
        store, got = importing(edit.__name__, edit)
        assert got.returncode == 1 and says in got.stderr, got.stderr
        assert stored(store) == (0, []), edit.__name__
    assert not (tmp_path / "evil.safetensors").exists()

    # A forged tuning stage: refused in one line, nothing written.
    def forged(name: str, edit: Callable[[dict[str, Any]], None]) -> str:
        data = json.loads(gzip.decompress(thin.read_bytes()))
        edit(data["tuning"][0])
        path, store = tmp_path / f"{name}.json", tmp_path / name
        path.write_text(json.dumps(data))
        got = gtr_here("study", "import", str(path), env={**env, "GTR_DATA_DIR": str(store)})
        assert got.returncode == 1 and "Traceback" not in got.stderr, got.stderr
        assert stored(store) == (0, []), name
        return got.stderr

    def off_grid(arm: dict[str, Any]) -> None:
        arm["trials"][0]["params"]["sft_coef"] = 3.0

    def other_knob(arm: dict[str, Any]) -> None:
        arm["trials"][0]["params"] = {"lr": 0.1}

    def other_arm(arm: dict[str, Any]) -> None:
        arm["arm"] = "<img src=x onerror=alert(1)>"

    def chosen_elsewhere(arm: dict[str, Any]) -> None:
        arm["selected"] = {"trial": 7, "params": {"sft_coef": 0.5}}

    def huge(arm: dict[str, Any]) -> None:
        arm["trials"][0]["reported"] = {"0": "Infinity"}

    def backwards(arm: dict[str, Any]) -> None:
        assert arm["trials"][0]["update_s"] > 0  # the seconds per update it took here
        arm["trials"][0]["update_s"] = -1.0

    for forge, says in (
        (off_grid, "tuning gtr trial 0: sft_coef = 3.0 is outside its search space"),
        (other_knob, "tuning gtr trial 0: its knobs are not the study file's"),
        (other_arm, "tuning arm '<img src=x onerror=alert(1)>' is not tuned by the study file"),
        (chosen_elsewhere, "tuning gtr: its choice is none of its complete trials"),
        (huge, "tuning gtr trial 0: a score that is not a finite number"),
        (backwards, "tuning arm 1: trials.0.update_s: Input should be greater than 0"),
    ):
        assert says in forged(forge.__name__, forge), forge.__name__


def _newer_study_file(c: sqlite3.Connection) -> None:
    """What a newer version would store: a study-file field unknown here."""
    import json

    (spec,) = c.execute("SELECT spec FROM studies").fetchone()
    c.execute(
        "UPDATE studies SET spec = ?", (json.dumps({**json.loads(spec), "from_the_future": True}),)
    )


def _gtr_study(
    folder: Path, checkpoint: Path, name: str, seeds: list[int], episodes: int, **run: int
) -> Path:
    """A study file of one GTR arm on a tiny NumberLine run from ``checkpoint`` (2 envs)."""
    run_file = folder / "run.toml"
    run_file.write_text(tiny_config(checkpoint, envs=2, **run))
    study_file = folder / "study.toml"
    study_file.write_text(
        f'name = "{name}"\nseeds = {seeds}\neval_episodes = {episodes}\n[tasks.numberline]\n'
        f'config = "{run_file}"\n[arms.gtr]\nalgorithm = "gtr"\n'
    )
    return study_file


def _newer_schema(c: sqlite3.Connection) -> None:
    """What a newer version's migration leaves: a schema revision unknown here."""
    c.execute("UPDATE alembic_version SET version_num = '2099_01_01_from_the_future'")


@pytest.mark.parametrize(
    ("skew", "says"),
    [
        (
            _newer_study_file,
            "its stored file no longer validates here "
            "(from_the_future: Extra inputs are not permitted)",
        ),
        (
            _newer_schema,
            "the database was migrated by a newer version "
            "(schema revision 2099_01_01_from_the_future)",
        ),
    ],
    ids=["study-file", "schema"],
)
def test_a_newer_versions_study_file_or_schema_stops_new_runs_with_one_message(
    tmp_path: Path,
    warm_checkpoint: Path,
    default_model_dir: Path,
    skew: Callable[[sqlite3.Connection], None],
    says: str,
) -> None:
    """Version skew: another process stores a study file this runner's version cannot read (a
    field it does not know), or migrates the store past this version's schema. The runner
    starts no further run, lets the one in flight finish, and stops with one message and
    exit 1, not a traceback (nor alembic's "Can't locate revision" in its children)."""
    import sys
    import time

    study_file = _gtr_study(tmp_path, warm_checkpoint, "skew", [0, 1], 4, steps=4, updates=3)
    data = tmp_path / "data"
    env = {
        **os.environ,
        "GTR_DATA_DIR": str(data),
        "GTR_MODEL_DIR": str(default_model_dir.parent),
    }
    for key in ("GTR_DATABASE_URL", "GTR_REDIS_URL"):
        env.pop(key, None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "study", "run", str(study_file), "--jobs", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    db = data / "gtr.sqlite3"

    def statuses() -> list[str]:
        if not db.exists():  # connecting would create it
            return []
        try:
            with sqlite3.connect(db) as c:
                return [r[0] for r in c.execute("SELECT status FROM runs ORDER BY id")]
        except sqlite3.OperationalError:  # the schema is not there yet
            return []

    try:
        deadline = time.monotonic() + 120
        while "running" not in statuses():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        with sqlite3.connect(db) as c:
            skew(c)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out + err
    assert "Traceback" not in err, err
    assert f"{says}; no new run starts," in out
    assert f"study 1 stopped: {says}; go on with `gtr study run` from the newer version" in err
    # The run in flight finished; the second seed never started.
    assert statuses() == ["completed"], out


def test_each_runs_process_takes_its_runners_environment(
    tmp_path: Path, warm_checkpoint: Path, default_model_dir: Path
) -> None:
    """A study's runs are forked from a server that keeps the environment it started with (the
    first study this process ran). Each run takes its own runner's instead: two studies run one
    after the other in this one process train into their own stores and log folders, though
    the second's runs come from a server started under the first's."""
    study_file = _gtr_study(tmp_path, warm_checkpoint, "forked", [0], 2, steps=2, updates=1)
    for name in ("first", "second"):
        data = tmp_path / name
        env = {
            "GTR_DATA_DIR": str(data),
            "GTR_MODEL_DIR": str(default_model_dir.parent),
            "GTR_DATABASE_URL": None,
            "GTR_REDIS_URL": None,
        }
        out = gtr_here("study", "run", str(study_file), env=env)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        with session_scope(f"sqlite:///{data / 'gtr.sqlite3'}") as s:
            runs = s.scalars(select(Run)).all()
            assert [(r.id, r.status) for r in runs] == [(1, "completed")], [r.error for r in runs]
            assert s.scalars(select(func.count()).select_from(Update)).one() == 1
        assert "run 1 completed" in (data / "studies" / "1" / "run-1.log").read_text()
