"""studies: a grid of runs judged by a declared primary metric, and per-deal evaluation outcomes

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04 14:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

CELL = ["study_id", "study_task", "study_arm", "study_seed", "study_variant", "study_attempt"]


def upgrade() -> None:
    op.create_table(
        "studies",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("team", sa.String(length=100), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("primary_metric", sa.String(length=100), nullable=False),
        sa.Column("status", sa.String(length=20), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_studies")),
    )
    with op.batch_alter_table("studies") as batch:
        batch.create_index(batch.f("ix_studies_team"), ["team"], unique=False)
        batch.create_index(batch.f("ix_studies_status"), ["status"], unique=False)

    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("study_id", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("study_task", sa.String(length=100), nullable=True))
        batch.add_column(sa.Column("study_arm", sa.String(length=100), nullable=True))
        batch.add_column(sa.Column("study_seed", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("study_variant", sa.String(length=100), nullable=True))
        batch.add_column(sa.Column("study_attempt", sa.Integer(), nullable=True))
        batch.create_foreign_key(
            batch.f("fk_runs_study_id_studies"),
            "studies",
            ["study_id"],
            ["id"],
            ondelete="SET NULL",
        )
        batch.create_index(batch.f("ix_runs_study_id"), ["study_id"], unique=False)
        batch.create_unique_constraint(batch.f("uq_runs_study_id"), CELL)

    op.create_table(
        "eval_outcomes",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("update_idx", sa.Integer(), nullable=False),
        sa.Column("deal", sa.Integer(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("success", sa.Boolean(), nullable=False),
        sa.Column("episode_return", sa.Float(), nullable=False),
        sa.Column("episode_length", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_eval_outcomes_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_eval_outcomes")),
        sa.UniqueConstraint("run_id", "update_idx", "deal", name=op.f("uq_eval_outcomes_run_id")),
    )
    with op.batch_alter_table("eval_outcomes") as batch:
        batch.create_index(batch.f("ix_eval_outcomes_run_id"), ["run_id"], unique=False)


def downgrade() -> None:
    op.drop_table("eval_outcomes")
    with op.batch_alter_table("runs") as batch:
        batch.drop_constraint(batch.f("uq_runs_study_id"), type_="unique")
        batch.drop_index(batch.f("ix_runs_study_id"))
        batch.drop_constraint(batch.f("fk_runs_study_id_studies"), type_="foreignkey")
        for column in reversed(CELL):
            batch.drop_column(column)
    op.drop_table("studies")
