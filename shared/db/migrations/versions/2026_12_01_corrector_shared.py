"""corrector shared: an admin may mark a corrector usable by every team's runs

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Existing correctors stay private to their team: sharing is an explicit admin decision.
    op.add_column(
        "correctors",
        sa.Column("shared", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    op.drop_column("correctors", "shared")
