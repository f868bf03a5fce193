from __future__ import annotations

import uuid

import psycopg
from sqlalchemy import create_engine, inspect

from shared.db.migrate import downgrade, upgrade
from shared.db.models import Base
from tests.conftest import PG_ADMIN

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
