"""`gtr train` in one process on the embedded default: SQLite, local folders, the oracle."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sqlalchemy import create_engine, select, text

from services.controller.recorder import discard_after
from shared.db.models import EvalOutcome
from shared.db.session import session_scope
from shared.seeds import eval_seed
from tests.e2e.helpers import ROOT, counts, tiny_config
from tests.services.api.search_checks import check_search

pytestmark = pytest.mark.slow


def _train(config, tmp_path, timeout: float = 60, **settings: str) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
    """`gtr train CONFIG` with no GTR_ settings but a data folder (and `settings`): the
    embedded default. One torch thread, as every process of the suite (tests/conftest.py): the
    tiny model gains nothing from a second, and on busy cores its threads spin (a run of this
    module took 3x the CPU time with the default two)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    env["GTR_DATA_DIR"] = str(tmp_path / "gtr-data")
    env["GTR_TORCH_THREADS"] = "1"
    env |= settings
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "train", str(config)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_gtr_train_embedded_completes_with_exact_counts(tmp_path, warm_checkpoint) -> None:
    cfg = tmp_path / "tiny.toml"
    # Ends in [metrics]: greedy evaluation of 4 held-out episodes after each update.
    evaluated = "eval_episodes = 4\neval_every = 1\n"
    cfg.write_text(tiny_config(warm_checkpoint, envs=2, steps=4, updates=2) + evaluated)
    proc = _train(cfg, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "completed" in proc.stdout and "gtr serve" in proc.stdout
    assert "eval/success_rate" in proc.stdout  # the summary's first row
    # Stdout is a pipe: one plain line per update, no progress bar.
    progress = [line for line in proc.stdout.splitlines() if line.startswith("update ")]
    assert [p.split()[1] for p in progress] == ["1/2", "2/2"] and "env steps 16/16" in progress[1]
    db = tmp_path / "gtr-data" / "gtr.sqlite3"
    assert db.exists()
    c = counts(1, f"sqlite:///{db}")
    assert c["steps"] == c["env_steps"] == 2 * 4 * 2
    assert c["dup_steps"] == 0 and c["dup_corrections"] == 0
    assert c["checkpoints"] == 2 and c["updates"] == 2
    assert c["corrections"] > 0 and c["pending"] == 0
    # Evaluation episodes are played but never recorded as steps (the counts above).
    evals = _update_metrics(f"sqlite:///{db}")
    assert [m["eval/episodes"] for m in evals] == [4.0, 4.0]
    assert all(0.0 <= m["eval/success_rate"] <= 1.0 for m in evals)
    # Each evaluation's deals are stored one by one (studies resample them), from the
    # evaluation seed space, and add up to the update's figure.
    with session_scope(f"sqlite:///{db}") as s:
        rows = s.scalars(select(EvalOutcome).order_by(EvalOutcome.update_idx, EvalOutcome.deal))
        deals = [(o.update_idx, o.deal, o.seed, o.success) for o in rows]
    assert [(u, d, seed) for u, d, seed, _ in deals] == [
        (u, d, eval_seed(d)) for u in (0, 1) for d in range(4)
    ]
    for u, m in enumerate(evals):
        assert m["eval/success_rate"] == sum(ok for x, _, _, ok in deals if x == u) / 4
    # Step search on what the run wrote: FTS5 kept in step by the recorder's inserts and the
    # corrections' late updates, then by a resume's deletes.
    url = f"sqlite:///{db}"
    _fts_integrity(url)
    check_search(url, 1)
    with session_scope(url) as s:
        assert discard_after(s, 1, 0) == 2 * 4
    _fts_integrity(url)


def _fts_integrity(url: str) -> None:
    """FTS5 compares its index with the text of every row and raises on any difference."""
    engine = create_engine(url)
    with engine.begin() as conn:
        for fts in ("steps_fts", "corrections_fts"):
            conn.execute(text(f"INSERT INTO {fts}({fts}, rank) VALUES ('integrity-check', 1)"))
    engine.dispose()


def _update_metrics(url: str) -> list[dict]:
    engine = create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT metrics FROM updates ORDER BY idx")).all()
    engine.dispose()
    return [r[0] if isinstance(r[0], dict) else json.loads(r[0]) for r in rows]


def test_gtr_train_rejects_a_bad_config_clearly(tmp_path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('task = "chess"\n[train]\nnum_envs = -3\n')
    proc = _train(cfg, tmp_path)
    assert proc.returncode != 0
    assert "task" in proc.stderr and "num_envs" in proc.stderr and "Traceback" not in proc.stderr
    missing = _train(tmp_path / "nope.toml", tmp_path)
    assert missing.returncode != 0 and "not found" in missing.stderr
