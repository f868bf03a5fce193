"""Request-scoped dependencies: one database session per request, committed at its end."""

from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy.orm import Session

from shared.db.session import session_scope


def get_db() -> Iterator[Session]:
    with session_scope() as session:
        yield session
