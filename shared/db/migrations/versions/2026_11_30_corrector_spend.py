"""corrector spend: a run's corrector budget, reserved per call attempt

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 02:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "corrector_spend",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("corrector", sa.String(length=100), nullable=False),
        sa.Column("calls", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "corrector", name=op.f("pk_corrector_spend")),
    )
    # Runs already under way keep what they spent before the budget moved here.
    op.execute(
        "INSERT INTO corrector_spend (run_id, corrector, calls, tokens) "
        "SELECT run_id, corrector, SUM(attempts), SUM(tokens) FROM corrections "
        "GROUP BY run_id, corrector"
    )


def downgrade() -> None:
    op.drop_table("corrector_spend")
