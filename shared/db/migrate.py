"""Run the alembic migrations programmatically (``gtr db upgrade``), on PostgreSQL or SQLite."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from alembic import command
from alembic.config import Config

from shared.settings import get_settings

MIGRATIONS = Path(__file__).parent / "migrations"


def alembic_config(url: str | None = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", (url or get_settings().db_url).replace("%", "%%"))
    return cfg


class SchemaAhead(RuntimeError):
    """The store was migrated by a newer gtr-lab: its revision is not among this version's."""


def unknown_revisions(url: str | None = None) -> list[str]:
    """The store's schema revisions that this version's migrations do not contain (empty when
    it is at a revision this version knows, or has no schema yet)."""
    from alembic.runtime.migration import MigrationContext

    from shared.db.session import get_engine

    with get_engine(url).connect() as conn:
        current = MigrationContext.configure(conn).get_current_heads()
    return [rev for rev in current if rev not in known_revisions()]


@cache
def known_revisions() -> frozenset[str]:
    """Every schema revision this version's migrations contain."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    return frozenset(rev.revision for rev in script.walk_revisions())


def check_known(url: str | None = None) -> None:
    """Raise SchemaAhead where a newer gtr-lab migrated the store. This version would fail
    later, inside alembic ("Can't locate revision") or on a column it does not know."""
    ahead = unknown_revisions(url)
    if ahead:
        raise SchemaAhead(
            f"the database is at schema revision {', '.join(ahead)}, which this version of "
            "gtr-lab does not know: a newer version migrated it; use that version (or a newer "
            "one) with this database"
        )


def upgrade(url: str | None = None, revision: str = "head") -> None:
    url = url or get_settings().db_url
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    check_known(url)
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | None = None, revision: str = "base") -> None:
    check_known(url)
    command.downgrade(alembic_config(url), revision)


def ensure_schema(url: str | None = None) -> None:
    """Embedded mode: bring the SQLite file to head on first use."""
    upgrade(url)
