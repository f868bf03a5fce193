"""Every table of the platform, in one module.

Unique keys make the writers idempotent: a redelivered Celery task or a resumed controller
writes nothing twice (one step per episode and index, one correction per step and corrector,
one update row and one checkpoint per run and update index).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# degraded: the run went to its end, but too many of its corrections failed to call it GTR
# superseded: a study run whose cell is trained again (`gtr study rerun`); it keeps its data.
RUN_STATUSES = (
    "queued",
    "running",
    "completed",
    "degraded",
    "failed",
    "cancelled",
    "superseded",
)
TERMINAL_STATUSES = ("completed", "degraded", "failed", "cancelled", "superseded")
STUDY_STATUSES = ("queued", "running", "done", "failed", "cancelled")


def utcnow() -> datetime:
    return datetime.now(UTC)


class FreeText(TypeDecorator[str]):
    """Text written by a model or a remote service: NUL becomes U+FFFD on the way in.

    A sampled output can contain any token, NUL included, and PostgreSQL text columns refuse
    NUL (a run failed on it); SQLite takes it. Replacing it keeps every store the same."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Any) -> str | None:
        return value.replace("\x00", "\ufffd") if isinstance(value, str) else value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret
    prefix: Mapped[str] = mapped_column(String(12))  # shown in listings to tell tokens apart
    scope: Mapped[str] = mapped_column(String(10), default="write")  # read | write | admin
    team: Mapped[str] = mapped_column(String(100), default="default")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Corrector(Base):
    __tablename__ = "correctors"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    kind: Mapped[str] = mapped_column(String(20))  # oracle | openai | http
    base_url: Mapped[str | None] = mapped_column(String(500))
    model: Mapped[str | None] = mapped_column(String(200))
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    api_key_encrypted: Mapped[str | None] = mapped_column(Text)  # Fernet token, never returned
    api_key_env: Mapped[str | None] = mapped_column(String(100))  # or: the env var holding it
    team: Mapped[str] = mapped_column(String(100), default="default")
    # Usable by every team's runs (an admin's choice); otherwise only by the owning team's.
    shared: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Run(Base):
    __tablename__ = "runs"
    # One run per study cell and attempt: two launchers of one study cannot both create it.
    __table_args__ = (
        UniqueConstraint(
            "study_id", "study_task", "study_arm", "study_seed", "study_variant", "study_attempt"
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    team: Mapped[str] = mapped_column(String(100), default="default", index=True)
    task: Mapped[str] = mapped_column(String(40))
    algorithm: Mapped[str] = mapped_column(String(20))
    status: Mapped[str] = mapped_column(String(20), default="queued", index=True)
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(FreeText)
    env_steps: Mapped[int] = mapped_column(BigInteger, default=0)  # env steps recorded so far
    total_env_steps: Mapped[int] = mapped_column(BigInteger)
    num_updates: Mapped[int] = mapped_column(Integer)  # planned updates
    updates_done: Mapped[int] = mapped_column(Integer, default=0)
    alarm: Mapped[bool] = mapped_column(Boolean, default=False)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Beside training: {"warm_start": {"reused": ..., "key": ...}, "tracking": {name: error}}.
    info: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict, server_default="{}")
    # What the run is doing now (shared/phase.py): warm_start | rollout | corrections | ...
    phase: Mapped[str | None] = mapped_column(String(40))
    phase_step: Mapped[int | None] = mapped_column(Integer)  # k of phase_total, e.g. a chunk
    phase_total: Mapped[int | None] = mapped_column(Integer)
    phase_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # phase began
    # The study cell this run belongs to (services/study); all None for a run of its own.
    study_id: Mapped[int | None] = mapped_column(
        ForeignKey("studies.id", ondelete="SET NULL"), index=True
    )
    study_task: Mapped[str | None] = mapped_column(String(100))  # the study's task name
    study_arm: Mapped[str | None] = mapped_column(String(100))
    study_seed: Mapped[int | None] = mapped_column(Integer)
    study_variant: Mapped[str | None] = mapped_column(String(100))  # "" when the study has none
    study_attempt: Mapped[int | None] = mapped_column(Integer)  # 1, or 2 for the one retry

    updates: Mapped[list[Update]] = relationship(back_populates="run", order_by="Update.idx")


class Study(Base):
    """A grid of runs (tasks x arms x seeds x variants) judged by one primary metric declared
    before any run started; the runs point back here through `runs.study_id`."""

    __tablename__ = "studies"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    team: Mapped[str] = mapped_column(String(100), default="default", index=True)  # as Run.team
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)  # the validated study file (StudyConfig)
    # The primary metric's key (e.g. "eval/success_rate"), frozen at creation; its reduction
    # ("final" | "last_k_mean") is in spec["primary"].
    primary_metric: Mapped[str] = mapped_column(String(100))
    status: Mapped[str] = mapped_column(String(20), default="queued", index=True)
    concurrency: Mapped[int] = mapped_column(Integer, default=1)  # runs in flight at once
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )


class EvalOutcome(Base):
    """One deal of one greedy evaluation: deal k is the same deal in every run of a task."""

    __tablename__ = "eval_outcomes"
    __table_args__ = (UniqueConstraint("run_id", "update_idx", "deal"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    update_idx: Mapped[int] = mapped_column(Integer)
    deal: Mapped[int] = mapped_column(Integer)  # index in the evaluation set, 0..N-1
    seed: Mapped[int] = mapped_column(BigInteger)  # the env seed the deal was reset with
    success: Mapped[bool] = mapped_column(Boolean)
    episode_return: Mapped[float] = mapped_column(Float)
    episode_length: Mapped[int] = mapped_column(Integer)


class Update(Base):
    """One PPO update of a run, with every metric of that update (losses, success, collapse)."""

    __tablename__ = "updates"
    __table_args__ = (UniqueConstraint("run_id", "idx"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    idx: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    alarm: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    run: Mapped[Run] = relationship(back_populates="updates")


class Episode(Base):
    __tablename__ = "episodes"
    __table_args__ = (
        UniqueConstraint("run_id", "env_index", "seq"),
        Index("ix_episodes_run_update", "run_id", "update_idx"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    env_index: Mapped[int] = mapped_column(Integer)  # which of the run's parallel envs
    seq: Mapped[int] = mapped_column(Integer)  # n-th episode of that env
    update_idx: Mapped[int] = mapped_column(Integer)  # update during which it started
    seed: Mapped[int | None] = mapped_column(BigInteger)
    length: Mapped[int] = mapped_column(Integer, default=0)
    total_return: Mapped[float] = mapped_column(Float, default=0.0)
    success: Mapped[bool | None] = mapped_column(Boolean)  # None while running
    finished: Mapped[bool] = mapped_column(Boolean, default=False)
    corrected_steps: Mapped[int] = mapped_column(Integer, default=0)
    meta: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # e.g. ALFWorld subtask


class Step(Base):
    __tablename__ = "steps"
    __table_args__ = (
        UniqueConstraint("episode_id", "idx"),
        Index("ix_steps_run_update", "run_id", "update_idx"),
        Index("ix_steps_run_update_id", "run_id", "update_idx", "id"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    episode_id: Mapped[int] = mapped_column(
        ForeignKey("episodes.id", ondelete="CASCADE"), index=True
    )
    idx: Mapped[int] = mapped_column(Integer)  # index within the episode
    update_idx: Mapped[int] = mapped_column(Integer)
    rollout_pos: Mapped[int] = mapped_column(Integer)  # position in the update's rollout (t*E+e)
    prompt: Mapped[str] = mapped_column(FreeText)
    output: Mapped[str] = mapped_column(FreeText)  # the agent's full generated text
    thought: Mapped[str | None] = mapped_column(FreeText)
    action_text: Mapped[str | None] = mapped_column(FreeText)  # the action as written by the agent
    parsed_action: Mapped[str | None] = mapped_column(String(200))  # the action the env executed
    format_valid: Mapped[bool] = mapped_column(Boolean)
    action_valid: Mapped[bool] = mapped_column(Boolean)
    reward: Mapped[float] = mapped_column(Float)
    done: Mapped[bool] = mapped_column(Boolean)
    value: Mapped[float | None] = mapped_column(Float)
    logprob: Mapped[float | None] = mapped_column(Float)
    thought_entropy: Mapped[float | None] = mapped_column(Float)
    image_sha: Mapped[str | None] = mapped_column(String(64))
    # The same frame at display resolution, for people (None on steps recorded before it).
    display_sha: Mapped[str | None] = mapped_column(String(64))
    state: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # privileged env state
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Correction(Base):
    __tablename__ = "corrections"
    __table_args__ = (
        UniqueConstraint("step_id", "corrector"),
        # step_id last: the verdict filter of step search walks it in step order (migration 0008)
        Index("ix_corrections_run_status_step", "run_id", "status", "step_id"),
        Index("ix_corrections_run_verdict", "run_id", "verdict", "step_id"),
        Index("ix_corrections_run_update", "run_id", "update_idx"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    step_id: Mapped[int] = mapped_column(ForeignKey("steps.id", ondelete="CASCADE"))
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    update_idx: Mapped[int] = mapped_column(Integer)
    corrector: Mapped[str] = mapped_column(String(100))  # corrector name (registry or "oracle")
    status: Mapped[str] = mapped_column(String(10), default="pending")  # pending | done | failed
    verdict: Mapped[str | None] = mapped_column(String(10))  # correct | incorrect
    corrected_thought: Mapped[str | None] = mapped_column(FreeText)
    extras: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    reasoning: Mapped[str | None] = mapped_column(FreeText)
    raw: Mapped[str | None] = mapped_column(FreeText)  # the corrector's raw answer, for audits
    error: Mapped[str | None] = mapped_column(FreeText)
    latency_ms: Mapped[float | None] = mapped_column(Float)
    tokens: Mapped[int] = mapped_column(Integer, default=0)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class CorrectorSpend(Base):
    """Calls and tokens a run has spent on a corrector: every call attempt reserves one call here,
    atomically, before it is sent (`services/corrector/spend.py`).

    Kept apart from `corrections`: a reservation commits at once on a connection of its own, so a
    call stays counted when its correction is rolled back, discarded with its rollout, or its
    worker dies mid-call. No foreign key: that connection may not yet see a run its caller added.
    """

    __tablename__ = "corrector_spend"

    run_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    corrector: Mapped[str] = mapped_column(String(100), primary_key=True)
    calls: Mapped[int] = mapped_column(Integer, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "update_idx"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    update_idx: Mapped[int] = mapped_column(Integer)  # -1 = the init (warm start) checkpoint
    path: Mapped[str] = mapped_column(String(500))  # relative to the checkpoint store
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
