"""step display frame: a display-resolution frame for people beside the model's input

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 00:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Steps recorded before this keep only the model's input: the UI falls back to image_sha.
    op.add_column("steps", sa.Column("display_sha", sa.String(length=64), nullable=True))


def downgrade() -> None:
    op.drop_column("steps", "display_sha")
