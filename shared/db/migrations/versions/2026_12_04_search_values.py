"""step search on SQLite: the FTS5 indexes hold the values of the stored JSON, not its keys

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04 18:00:00

A stored thought (and a corrected thought) is the model's JSON minus its action: its keys
("target number", "thoughts") are the task's format, found in every step. PostgreSQL's search
matches the values only (services/api/search.py JSON_KEY); on SQLite the FTS5 tables of 0008
indexed the whole text, so ``q=target`` matched every NumberLine step. They now index the JSON's
leaf values (strings, numbers, true/false/null) joined by spaces, and a text that is not JSON as
it is.

The tables become contentless (``content=''``): FTS5 reads an external content table with
virtual tables disabled, so a view over ``json_tree`` cannot be their content, while the
triggers, ordinary statements, can compute the values. They keep no copy of the text either. A
row leaves the index by the FTS5 'delete' command with the values it was indexed with, which
the triggers compute again from the old row (json_tree walks a text in the same order every
time). The upgrade indexes the rows already stored.
"""

from __future__ import annotations

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

TOKENIZE = "porter unicode61 remove_diacritics 2"  # as 0008: close to PostgreSQL's 'english'
INDEXES = (
    ("steps_fts", "steps", "thought"),
    ("corrections_fts", "corrections", "corrected_thought"),
)


def values_text(text: str) -> str:
    """SQL: the leaf values of the JSON in ``text``, space-separated (true, false and null as
    written); a text that is not JSON as it is; NULL stays NULL."""
    leaf = "CASE WHEN type IN ('true', 'false', 'null') THEN type ELSE atom END"
    leaves = (
        f"(SELECT group_concat({leaf}, ' ') FROM json_tree({text}) "
        "WHERE type NOT IN ('object', 'array'))"
    )
    return f"CASE WHEN json_valid({text}) THEN coalesce({leaves}, '') ELSE {text} END"


def _drop(fts: str) -> None:
    for trigger in ("insert", "delete", "update"):
        op.execute(f"DROP TRIGGER IF EXISTS {fts}_{trigger}")
    op.execute(f"DROP TABLE IF EXISTS {fts}")


def _triggers(fts: str, table: str, column: str, old: str, new: str) -> list[str]:
    delete = f"INSERT INTO {fts}({fts}, rowid, {column}) VALUES ('delete', old.id, {old});"
    insert = f"INSERT INTO {fts}(rowid, {column}) VALUES (new.id, {new});"
    return [
        f"CREATE TRIGGER {fts}_insert AFTER INSERT ON {table} BEGIN {insert} END",
        f"CREATE TRIGGER {fts}_delete AFTER DELETE ON {table} BEGIN {delete} END",
        f"CREATE TRIGGER {fts}_update AFTER UPDATE OF {column} ON {table} "
        f"BEGIN {delete} {insert} END",
    ]


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    for fts, table, column in INDEXES:
        _drop(fts)
        op.execute(
            f"CREATE VIRTUAL TABLE {fts} USING fts5({column}, content='', columnsize=0, "
            f"tokenize='{TOKENIZE}')"
        )
        old, new = values_text(f"old.{column}"), values_text(f"new.{column}")
        for statement in _triggers(fts, table, column, old, new):
            op.execute(statement)
        op.execute(
            f"INSERT INTO {fts}(rowid, {column}) SELECT id, {values_text(column)} FROM {table}"
        )


def downgrade() -> None:
    """Back to 0008's indexes of the whole text, over the tables' own columns."""
    if op.get_bind().dialect.name != "sqlite":
        return
    for fts, table, column in INDEXES:
        _drop(fts)
        op.execute(
            f"CREATE VIRTUAL TABLE {fts} USING fts5({column}, content='{table}', "
            f"content_rowid='id', columnsize=0, tokenize='{TOKENIZE}')"
        )
        for statement in _triggers(fts, table, column, f"old.{column}", f"new.{column}"):
            op.execute(statement)
        op.execute(f"INSERT INTO {fts}({fts}) VALUES ('rebuild')")
