"""step search: FTS5 indexes of thoughts and corrected thoughts on SQLite; corrections by
status in step order

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 00:00:00

Both engines: ``corrections(run_id, status)`` gains ``step_id``, so that the verdict filter
(failed, pending) walks a run's corrections in step order from the page's cursor and stops at the
page, as ``(run_id, verdict, step_id)`` already lets it for corrected and correct.

PostgreSQL searches text with its GIN indexes of migration 0003. On SQLite (the embedded
default) two external-content FTS5 tables index the text where it lives (``steps.thought``,
``corrections.corrected_thought``) without a second copy; triggers keep them in step with every
write, whoever makes it: the batched recorder's inserts, a correction's late update, a resume's
deletes and a run's cascade.
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# Porter stemming over unicode61 words: close to PostgreSQL's 'english' configuration. No
# per-row sizes (columnsize=0): search needs no ranking.
TOKENIZE = "porter unicode61 remove_diacritics 2"
INDEXES = (
    ("steps_fts", "steps", "thought"),
    ("corrections_fts", "corrections", "corrected_thought"),
)


def _statements(fts: str, table: str, column: str) -> list[str]:
    # External content: FTS5 keeps no copy of the text, and a row is taken out of the index by
    # handing it the text it was indexed with (the old row's, in the triggers).
    delete = f"INSERT INTO {fts}({fts}, rowid, {column}) VALUES ('delete', old.id, old.{column});"
    insert = f"INSERT INTO {fts}(rowid, {column}) VALUES (new.id, new.{column});"
    return [
        f"CREATE VIRTUAL TABLE {fts} USING fts5({column}, content='{table}', "
        f"content_rowid='id', columnsize=0, tokenize='{TOKENIZE}')",
        f"CREATE TRIGGER {fts}_insert AFTER INSERT ON {table} BEGIN {insert} END",
        f"CREATE TRIGGER {fts}_delete AFTER DELETE ON {table} BEGIN {delete} END",
        f"CREATE TRIGGER {fts}_update AFTER UPDATE OF {column} ON {table} "
        f"BEGIN {delete} {insert} END",
        f"INSERT INTO {fts}({fts}) VALUES ('rebuild')",  # the rows already stored
    ]


def upgrade() -> None:
    op.create_index(
        "ix_corrections_run_status_step", "corrections", ["run_id", "status", "step_id"]
    )
    op.drop_index("ix_corrections_run_status", table_name="corrections")
    if op.get_bind().dialect.name != "sqlite":
        return
    for fts, table, column in INDEXES:
        for statement in _statements(fts, table, column):
            op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for fts, _, _ in INDEXES:
            for trigger in ("insert", "delete", "update"):
                op.execute(f"DROP TRIGGER IF EXISTS {fts}_{trigger}")
            op.execute(f"DROP TABLE IF EXISTS {fts}")
    op.create_index("ix_corrections_run_status", "corrections", ["run_id", "status"])
    op.drop_index("ix_corrections_run_status_step", table_name="corrections")
