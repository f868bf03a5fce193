"""stored thoughts keep their characters: the \\uXXXX escapes of older rows are decoded

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05 00:00:00

The parser stored an agent's thought as ``json.dumps`` wrote it by default, every non-ASCII
character escaped ("caf\\u00e9"); it now writes the characters (services/env/parser.py), as
corrected thoughts always were. PostgreSQL's text search reads the stored text as it is, so an
older row's "café" could not be found by "café". The upgrade rewrites exactly the rows that
default ``json.dumps`` wrote: a text is rewritten when re-encoding its JSON that way gives the
same text back, so a thought written any other way (by hand, by another version) is left as it
is. The JSON's value is unchanged, so the downgrade has nothing to undo. On SQLite the FTS5
triggers of 0010 re-index each rewritten row.
"""

from __future__ import annotations

import json

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

BATCH = 1000  # candidate rows read (and rewritten) at a time


def characters(text: str) -> str | None:
    """The text with its escapes decoded, where default ``json.dumps`` wrote it; else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if json.dumps(value) != text:
        return None
    decoded = json.dumps(value, ensure_ascii=False)
    return decoded if decoded != text else None


def upgrade() -> None:
    bind = op.get_bind()
    steps = sa.table("steps", sa.column("id", sa.Integer), sa.column("thought", sa.Text))
    escaped = steps.c.thought.contains("\\u", autoescape=True)
    rewrite = (
        sa.update(steps)
        .where(steps.c.id == sa.bindparam("row_id"))
        .values(thought=sa.bindparam("text"))
    )
    last = 0
    while True:  # a batch of candidates at a time, by id: memory stays flat on a large table
        rows = bind.execute(
            sa.select(steps.c.id, steps.c.thought)
            .where(escaped, steps.c.id > last)
            .order_by(steps.c.id)
            .limit(BATCH)
        ).all()
        if not rows:
            return
        last = rows[-1][0]
        changed = [
            {"row_id": row_id, "text": decoded}
            for row_id, text in rows
            if (decoded := characters(text)) is not None
        ]
        if changed:
            bind.execute(rewrite, changed)


def downgrade() -> None:
    pass  # the same JSON value either way: nothing to undo
