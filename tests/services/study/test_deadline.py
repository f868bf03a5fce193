"""`gtr study run FILE --stop-by WHEN` (services/study/runner.py): a study on a host booked until a
given time, or run in a session that must export before it ends, starts only the runs it expects
to finish by then and pauses at a run's end, not in the middle of one.

One embedded study of a tiny NumberLine run (no warm start, short episodes), run three times:
first without a deadline (its seed-0 run finishes: the seconds per update it took are the
estimate); then with a second seed and a deadline half that run's length away (nothing starts,
and it says which run needs how long); then with a new arm, which has no estimate yet, and a
deadline that comes while it trains (it stops, its trained updates kept for its resume). A
paused study is `cancelled`, as `gtr study cancel` leaves one: nothing drives it until `gtr
study run` resumes it; its export carries the finished run, not the stopped ones.
Each deadline is half the first run's length: longer than a start of `gtr study run`, shorter
than a run.
The deadline's parsing and its refusals are checked without a study."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import select

from services.study.runner import parse_deadline
from shared.db.models import Run, Study, Update
from shared.db.session import session_scope
from tests.services.study.tiny_study import gtr_cli, tiny_numberline

STUDY = """
name = "booked host"
seeds = {seeds}
eval_episodes = 2
primary = {{ metric = "eval/success_rate", reduce = "final" }}
[budget]
updates = 12
{task}
{arms}
"""
GTR = '[arms.gtr]\nalgorithm = "gtr"'
RL4VLM = '[arms.rl4vlm]\nalgorithm = "rl4vlm"'


def _write(path: Path, seeds: str, arms: str) -> Path:
    task = tiny_numberline(probe_states=2, eval_every=6)
    path.write_text(STUDY.format(seeds=seeds, task=task, arms=arms))
    return path


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_deadline_starts_only_runs_that_fit_and_pauses_at_a_runs_end(
    tmp_path: Path, default_model_dir: Path
) -> None:
    env: dict[str, str | None] = {
        "GTR_DATA_DIR": str(tmp_path / "data"),
        "GTR_MODEL_DIR": str(default_model_dir.parent),
        "GTR_DATABASE_URL": None,  # the embedded default
        "GTR_REDIS_URL": None,
    }
    url = f"sqlite:///{tmp_path / 'data' / 'gtr.sqlite3'}"
    study = tmp_path / "booked.toml"

    # A word that is no time is refused before anything is written.
    bad = gtr_cli("study", "run", str(_write(study, "[0]", GTR)), "--stop-by", "soon", env=env)
    assert bad.returncode == 2 and "'soon' is not a time" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "data" / "gtr.sqlite3").exists()

    first = gtr_cli("study", "run", str(study), env=env, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    with session_scope(url) as s:
        (run,) = s.scalars(select(Run)).all()
        assert run.status == "completed" and run.updates_done == 12
        seconds = [m["update_s"] for m in s.scalars(select(Update.metrics)) if "update_s" in m]
    took = sum(seconds)  # the estimate of a run of this task and arm: 12 x the mean update
    assert len(seconds) == 12 and took > 0

    # Seed 1's run would take about `took`; half of it is left: it does not start.
    half = max(1, int(took / 2))
    paused = gtr_cli(
        "study", "run", str(_write(study, "[0, 1]", GTR)), "--stop-by", f"{half}s", env=env
    )
    assert paused.returncode == 0, paused.stdout[-2000:] + paused.stderr[-2000:]
    assert "paused before its deadline" in paused.stdout, paused.stdout
    assert "numberline / gtr seed 1 needs about" in paused.stdout, paused.stdout
    assert "started" not in paused.stdout
    assert "Study 1: booked host  (cancelled" in paused.stdout  # its report: nothing drives it
    with session_scope(url) as s:
        runs = {r.study_seed: r for r in s.scalars(select(Run).where(Run.study_arm == "gtr"))}
        assert runs[0].status == "completed"
        assert 1 not in runs or (runs[1].status == "cancelled" and runs[1].updates_done == 0)
        row = s.get(Study, 1)
        assert row is not None and row.status == "cancelled"

    # Run again, the paused study resumes. A new arm has no estimate, so it starts (seed 1's
    # gtr run still does not fit); the deadline comes while it trains: it stops, its trained
    # updates kept for its resume, and the study says how to go on.
    both = _write(study, "[0, 1]", f"{GTR}\n{RL4VLM}")
    stopped = gtr_cli("study", "run", str(both), "--stop-by", f"{half}s", env=env, timeout=300)
    assert stopped.returncode == 0, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    assert "numberline / rl4vlm seed 0: started" in stopped.stdout, stopped.stdout
    assert "gtr seed 1: started" not in stopped.stdout
    assert "paused at its deadline" in stopped.stdout, stopped.stdout
    assert "(resumed)" in stopped.stdout
    assert "resume after their last trained update" in stopped.stdout
    with session_scope(url) as s:
        rl = s.scalars(select(Run).where(Run.study_arm == "rl4vlm", Run.study_seed == 0)).one()
        assert rl.status == "cancelled" and rl.updates_done < 12
        trained = len(s.scalars(select(Update.id).where(Update.run_id == rl.id)).all())
        assert trained == rl.updates_done  # what it trained is kept for the resume
        stopped_ids = sorted(r.id for r in s.scalars(select(Run)) if r.status == "cancelled")

    # The session exports for the next one: the bundle carries the finished run only. A stopped
    # run's curve ends part-way and its checkpoints stay here, so its cell trains again there.
    bundle = tmp_path / "booked.json.gz"
    out = gtr_cli("study", "export", "1", "--out", str(bundle), env=env)
    assert out.returncode == 0, out.stderr
    assert "1 finished runs (1 completed)" in out.stdout, out.stdout
    assert f"{', '.join(map(str, stopped_ids))}, stopped before the end" in out.stdout
    there = {**env, "GTR_DATA_DIR": str(tmp_path / "next")}
    got = gtr_cli("study", "import", str(bundle), env=there)
    assert got.returncode == 0 and "warning" not in got.stderr, got.stderr
    assert "1 runs imported, 0 already here; 3 cells have no finished run" in got.stdout


def test_the_deadline_is_read_in_three_forms_and_refused_in_words() -> None:
    now = datetime(2026, 12, 6, 16, 0, tzinfo=UTC)
    assert parse_deadline("90m", now) == now + timedelta(minutes=90)
    assert parse_deadline("1h30m", now) == parse_deadline("90m", now)
    assert parse_deadline("45s", now) == now + timedelta(seconds=45)
    assert parse_deadline("2026-12-06T18:40+00:00", now) == now + timedelta(hours=2, minutes=40)
    # A clock time is the next time this host's clock shows it, within 12 hours once past
    # today's: at local noon 13:00 is in an hour and 11:00 a slip; at 22:30, 00:30 is tonight's.
    noon = datetime.now().astimezone().replace(hour=12, minute=0, second=0, microsecond=0)
    assert parse_deadline("13:00", noon) == noon + timedelta(hours=1)
    assert parse_deadline("23:59", noon) == noon + timedelta(hours=11, minutes=59)
    late = noon.replace(hour=22, minute=30)
    assert parse_deadline("00:30", late) == late + timedelta(hours=2)
    assert parse_deadline("10:29", late) == late + timedelta(hours=11, minutes=59)
    with pytest.raises(ValueError, match="is already past"):
        parse_deadline("10:31", late)
    for when, says in [
        ("soon", "is not a time"),
        ("25:99", "is not a time"),
        ("0m", "no time at all"),
        ("2025-01-01T00:00+00:00", "is already past"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_deadline(when, now)
    with pytest.raises(ValueError, match="is already past"):
        parse_deadline("11:00", noon)
