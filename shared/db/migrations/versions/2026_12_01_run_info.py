"""run info: what the platform did for a run beside training (warm-start cache, trackers)

Revision ID: 0006
Revises: 0004
Create Date: 2026-12-01 00:06:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("info", sa.JSON(), nullable=False, server_default="{}"))


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_column("info")
