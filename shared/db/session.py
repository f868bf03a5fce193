"""Engines and sessions. Services never commit; the request, task or CLI command does."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from shared.settings import get_settings


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.removeprefix("sqlite:///")
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # IMMEDIATE: a write transaction takes SQLite's write lock at its BEGIN, waiting up to
        # `timeout` for it. A deferred one that read first holds a snapshot; when another thread
        # or process commits meanwhile, its first write fails at once with "database is locked"
        # (no busy wait), which lost corrections written beside a recording rollout.
        engine = create_engine(
            url,
            connect_args={
                "check_same_thread": False,
                "timeout": 30,
                "isolation_level": "IMMEDIATE",
            },
        )

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn, _record):  # type: ignore[no-untyped-def]
            # WAL lets the API read while the embedded trainer writes; FKs are off by default.
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        @event.listens_for(engine, "savepoint")
        def _savepoint_takes_the_write_lock(conn, _name):  # type: ignore[no-untyped-def]
            # The driver opens a transaction only before INSERT/UPDATE/DELETE: a SAVEPOINT sent
            # outside one would open a deferred transaction (see above). Open it IMMEDIATE.
            dbapi = conn.connection.dbapi_connection
            if dbapi is not None and not dbapi.in_transaction:
                dbapi.execute("BEGIN IMMEDIATE")

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10)


@lru_cache
def get_engine(url: str | None = None) -> Engine:
    return make_engine(url or get_settings().db_url)


def session_factory(url: str | None = None) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str | None = None) -> Iterator[Session]:
    """One unit of work: commits at the end, rolls back on error."""
    session = session_factory(url)()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()
