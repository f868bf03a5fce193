from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import create_engine, inspect, select

from services.api.search import StepFilter, search_steps
from services.env.parser import parse_output
from shared.db.migrate import SchemaAhead, downgrade, unknown_revisions, upgrade
from shared.db.models import Base, Run, Step
from shared.db.session import session_scope
from shared.schemas import RunConfig
from tests.conftest import PG_ADMIN
from tests.services.study.tiny_study import gtr_cli
from tests.services.trainer.dbutil import make_run, make_step

TABLES = {
    "runs",
    "updates",
    "episodes",
    "steps",
    "corrections",
    "checkpoints",
    "correctors",
    "api_tokens",
    "studies",
    "eval_outcomes",
}


def test_postgres_upgrade_downgrade_roundtrip(pg_url: str) -> None:
    name = f"gtr_mig_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    try:
        upgrade(url)
        engine = create_engine(url)
        assert TABLES <= set(inspect(engine).get_table_names())
        downgrade(url)
        assert not TABLES & set(inspect(engine).get_table_names())
        upgrade(url)
        assert TABLES <= set(inspect(engine).get_table_names())
        engine.dispose()
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_sqlite_migrations_match_models(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'x.sqlite3'}"
    upgrade(url)
    engine = create_engine(url)
    insp = inspect(engine)
    for table in Base.metadata.tables.values():
        cols = {c["name"] for c in insp.get_columns(table.name)}
        assert cols == {c.name for c in table.columns}, table.name
    downgrade(url)
    assert not TABLES & set(inspect(engine).get_table_names())


@pytest.fixture(params=["postgresql", "sqlite"])
def empty_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A database with no schema yet, on each dialect."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'x.sqlite3'}"
        return
    request.getfixturevalue("pg_url")  # PostgreSQL reachable, or the reason
    name = f"gtr_mig_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_thoughts_stored_with_escapes_are_found_by_their_words_after_0011(
    empty_store: str,
) -> None:
    url = empty_store
    upgrade(url, "0010")
    output = '{"thoughts": "le cœur naïf: 24 à la clé", "action": "+"}'  # as a model writes
    parsed = parse_output(output, ["+"], ("thoughts",))
    assert parsed.thought is not None and "cœur" in parsed.thought  # today's parser: characters
    before = json.dumps(json.loads(parsed.thought))  # the parser before it: json.dumps' default
    by_hand = '{"thoughts":"caf\\u00e9"}'  # not json.dumps' layout: not the parser's, left alone
    literal = json.dumps({"thoughts": "a backslash-u: \\u00e9"})  # no escape to decode
    with session_scope(url) as s:
        run = make_run(s, RunConfig.model_validate({"task": "numberline"}))
        texts = [before, by_hand, literal]
        for i, text in enumerate(texts):
            make_step(s, run, i, "+", None).thought = text
        run_id = run.id

    def found(q: str) -> list[int]:
        with session_scope(url) as s:
            got = s.get(Run, run_id)
            assert got is not None
            return [step.rollout_pos for step in search_steps(s, got, StepFilter(q=q), 10).steps]

    if url.startswith("postgresql"):
        assert found("cœur") == []  # the escape hid the word from PostgreSQL's search
    upgrade(url)
    with session_scope(url) as s:
        stored = s.scalars(select(Step.thought).where(Step.run_id == run_id).order_by(Step.id))
        assert list(stored) == [parsed.thought, by_hand, literal]
    assert found("cœur") == [0] and found("naïf") == [0]
    downgrade(url, "0010")  # nothing to undo: the same JSON either way
    with session_scope(url) as s:
        assert s.scalar(select(Step.thought).where(Step.rollout_pos == 0)) == parsed.thought


def test_a_store_a_newer_version_migrated_is_refused_with_one_message_and_left_as_it_is(
    empty_store: str,
) -> None:
    """An older checkout pointed at a store a newer gtr-lab migrated: every migration command
    says so (no alembic "Can't locate revision" traceback) and changes nothing."""
    url = empty_store
    upgrade(url)
    assert unknown_revisions(url) == []
    env = {"GTR_DATABASE_URL": url, "GTR_REDIS_URL": None}
    typo = gtr_cli("db", "upgrade", "--revision", "nonsense", env=env)
    assert typo.returncode == 1 and "Traceback" not in typo.stderr, typo.stderr
    assert "cannot migrate to 'nonsense': Can't locate revision" in typo.stderr
    with session_scope(url) as s:
        run_id = make_run(s, RunConfig.model_validate({"task": "numberline"})).id
    future = "2099_01_01_from_the_future"
    with create_engine(url).begin() as conn:
        conn.exec_driver_sql(f"UPDATE alembic_version SET version_num = '{future}'")
    assert unknown_revisions(url) == [future]
    for migrate in (upgrade, downgrade):
        with pytest.raises(SchemaAhead, match=f"schema revision {future}, which this version"):
            migrate(url)
    for args in (("db", "upgrade"), ("db", "downgrade")):
        out = gtr_cli(*args, env=env)
        assert out.returncode == 1, out.stdout + out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        assert f"Error: the database is at schema revision {future}" in out.stderr
    with session_scope(url) as s:  # the store is as it was: the run, the newer revision
        assert s.get(Run, run_id) is not None
    assert unknown_revisions(url) == [future]
