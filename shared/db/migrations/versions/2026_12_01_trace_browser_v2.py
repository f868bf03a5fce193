"""trace browser v2: a run's live phase, and indexes for step search

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

# Full-text search in thoughts and corrected thoughts (PostgreSQL; SQLite searches with LIKE).
STEP_TSV = "to_tsvector('english', coalesce(thought, ''))"
CORR_TSV = "to_tsvector('english', coalesce(corrected_thought, ''))"


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("phase", sa.String(length=40), nullable=True))
        batch.add_column(sa.Column("phase_step", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("phase_total", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("phase_at", sa.DateTime(timezone=True), nullable=True))
    # The verdict filter reads a run's corrections by verdict, in step order.
    op.create_index("ix_corrections_run_verdict", "corrections", ["run_id", "verdict", "step_id"])
    op.create_index("ix_corrections_run_update", "corrections", ["run_id", "update_idx"])
    # One update's steps in id order: a search within an update stops at its page.
    op.create_index("ix_steps_run_update_id", "steps", ["run_id", "update_idx", "id"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"CREATE INDEX ix_steps_thought_tsv ON steps USING gin ({STEP_TSV})")
        op.execute(f"CREATE INDEX ix_corrections_thought_tsv ON corrections USING gin ({CORR_TSV})")


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP INDEX IF EXISTS ix_corrections_thought_tsv")
        op.execute("DROP INDEX IF EXISTS ix_steps_thought_tsv")
    op.drop_index("ix_steps_run_update_id", table_name="steps")
    op.drop_index("ix_corrections_run_update", table_name="corrections")
    op.drop_index("ix_corrections_run_verdict", table_name="corrections")
    with op.batch_alter_table("runs") as batch:
        for column in ("phase_at", "phase_total", "phase_step", "phase"):
            batch.drop_column(column)
