"""`gtr train` in one process on the embedded default: SQLite, local folders, the oracle."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine, select, text

from services.api.auth import create_token
from services.api.search import StepFilter, search_steps
from services.controller.recorder import discard_after
from shared.db.migrate import downgrade, upgrade
from shared.db.models import EvalOutcome, Run, Step
from shared.db.session import session_scope
from shared.seeds import eval_seed
from tests.conftest import free_port, wait_serving
from tests.e2e.helpers import ROOT, counts, tiny_config
from tests.services.api.search_checks import HOSTILE, check_search, key_words

TOKENIZE = "porter unicode61 remove_diacritics 2"  # the FTS5 tables' (migrations 0008, 0010)

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
    # Stdout is a pipe: one plain line per update, no progress bar; updates numbered from 0, as
    # the charts, the step search and `gtr run watch` number them, and so the summary's columns.
    progress = [line for line in proc.stdout.splitlines() if line.startswith("update ")]
    assert [p.split("  ")[0] for p in progress] == [
        "update 0 done (1 of 2)",
        "update 1 done (2 of 2)",
    ]
    assert "env steps 16/16" in progress[1]
    assert re.search(r"metric .* #0 .* #1 ", proc.stdout), proc.stdout[-3000:]
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
    # Update -1: the start, evaluated on the same deals before update 0.
    assert [(u, d, seed) for u, d, seed, _ in deals] == [
        (u, d, eval_seed(d)) for u in (-1, 0, 1) for d in range(4)
    ]
    for u, m in enumerate(evals):
        assert m["eval/success_rate"] == sum(ok for x, _, _, ok in deals if x == u) / 4
    assert evals[0]["eval_start/success_rate"] == sum(ok for x, _, _, ok in deals if x == -1) / 4
    # Step search on what the run wrote: FTS5 kept in step by the recorder's inserts and the
    # corrections' late updates, then by a resume's deletes.
    url = f"sqlite:///{db}"
    _fts_integrity(url)
    _index_holds_values(url)
    check_search(url, 1)
    _upgrade_leaves_keys_out(url)
    _search_over_http(tmp_path)
    with session_scope(url) as s:
        assert discard_after(s, 1, 0) == 2 * 4
    _fts_integrity(url)
    _index_holds_values(url)


def _fts_integrity(url: str) -> None:
    """FTS5 checks its index's own structure and raises on any fault."""
    engine = create_engine(url)
    with engine.begin() as conn:
        for fts in ("steps_fts", "corrections_fts"):
            conn.execute(text(f"INSERT INTO {fts}({fts}, rank) VALUES ('integrity-check', 1)"))
    engine.dispose()


def _values(stored: str | None) -> str | None:
    """The words search looks in, as Python reads them: the JSON's leaf values (keys left out),
    or a text that is no JSON as it is."""

    def leaves(x: object) -> Iterator[str]:
        if isinstance(x, dict):
            for v in x.values():
                yield from leaves(v)
        elif isinstance(x, list):
            for v in x:
                yield from leaves(v)
        else:
            yield json.dumps(x) if x is None or isinstance(x, bool) else str(x)

    if stored is None:
        return None
    try:  # strict JSON, as SQLite's json_valid (Python alone also reads NaN and Infinity)
        return " ".join(leaves(json.loads(stored, parse_constant=_not_json)))
    except ValueError:
        return stored


def _not_json(word: str) -> None:
    raise ValueError(word)


def _index_holds_values(url: str) -> None:
    """Each row's words in the FTS5 tables (kept by triggers on every insert, update and
    delete) are exactly those of an index of its values built here, word and position."""
    con = sqlite3.connect(url.removeprefix("sqlite:///"))
    try:
        for fts, table, col in (
            ("steps_fts", "steps", "thought"),
            ("corrections_fts", "corrections", "corrected_thought"),
        ):
            rows = con.execute(f"SELECT id, {col} FROM {table}").fetchall()
            assert any(t for _, t in rows), table  # the run wrote some text to compare
            con.execute(f"CREATE VIRTUAL TABLE temp.ref USING fts5(t, tokenize='{TOKENIZE}')")
            con.executemany("INSERT INTO temp.ref(rowid, t) VALUES (?, ?)", [
                (i, _values(t)) for i, t in rows
            ])  # fmt: skip
            con.execute(f"CREATE VIRTUAL TABLE temp.v USING fts5vocab(main, {fts}, 'instance')")
            con.execute("CREATE VIRTUAL TABLE temp.w USING fts5vocab(temp, ref, 'instance')")
            held = con.execute("SELECT term, doc, offset FROM temp.v").fetchall()
            want = con.execute("SELECT term, doc, offset FROM temp.w").fetchall()
            assert sorted(held) == sorted(want), fts
            for t in ("v", "w", "ref"):
                con.execute(f"DROP TABLE temp.{t}")
    finally:
        con.close()


def _step_hits(url: str, q: str) -> list[int]:
    with session_scope(url) as s:
        run = s.get(Run, 1)
        assert run is not None
        return [st.id for st in search_steps(s, run, StepFilter(q=q), 1000).steps]


def _upgrade_leaves_keys_out(url: str) -> None:
    """Migration 0010 re-indexes the rows already stored: before it, the key word "target"
    found every step whose thought has the key; after it, none, and the values are still
    found."""
    with session_scope(url) as s:
        rows = s.execute(select(Step.id, Step.thought).order_by(Step.id)).all()
    keyed = [i for i, thought in rows if "target" in key_words(thought)]
    assert keyed
    downgrade(url, "0009")
    assert _step_hits(url, "target") == keyed
    upgrade(url)
    assert _step_hits(url, "target") == [] and _step_hits(url, "thoughts") == []
    assert _step_hits(url, "choose")  # a word of the thoughts' values ("3 < 5, I choose '+'")
    _fts_integrity(url)
    _index_holds_values(url)


def _search_over_http(tmp_path: Path) -> None:
    """`gtr serve` on the embedded store: the step search by a key word finds nothing and by
    a value word finds steps, over the REST API and on the page; hostile text is a page or a
    4xx, never a 500."""
    url = f"sqlite:///{tmp_path / 'gtr-data' / 'gtr.sqlite3'}"
    with session_scope(url) as s:
        token = create_token(s, "search", "read")[1]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    env |= {"GTR_DATA_DIR": str(tmp_path / "gtr-data"), "GTR_API_RATE_LIMIT_PER_MINUTE": "0"}
    cmd = [sys.executable, "-m", "services.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_serving(base, proc)
        api, auth = f"{base}/api/runs/1/steps", {"Authorization": f"Bearer {token}"}
        page, cookies = f"{base}/runs/1/steps", {"gtr_token": token}

        def items(q: str) -> list[int]:
            r = httpx.get(api, params={"q": q, "limit": 200}, headers=auth)
            assert r.status_code == 200, (q, r.text[:300])
            return [h["id"] for h in r.json()["items"]]

        assert items("target") == [] and items("choose")
        rows = httpx.get(page, params={"q": "target"}, cookies=cookies)
        assert rows.status_code == 200 and "No step matches" in rows.text
        for q in HOSTILE:
            items(q)
            r = httpx.get(page, params={"q": q}, cookies=cookies)
            assert r.status_code == 200 and "text/html" in r.headers["content-type"], q
            assert "<script>alert(1)" not in r.text and "<img src=x" not in r.text, q
        long = "x" * 201  # longer than the field allows
        assert httpx.get(api, params={"q": long}, headers=auth).status_code == 422
        r = httpx.get(page, params={"q": long}, cookies=cookies)
        assert r.status_code == 422 and "text/html" in r.headers["content-type"]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err, err[-3000:]


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
