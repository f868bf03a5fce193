"""A run's launch, the same whoever launches it (REST, the UI, ``gtr train``, a study): the
checks a config must pass beyond its schema, and the queued row a controller claims."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.corrector.service import ORACLE, usable_by
from shared.db.models import Run
from shared.schemas import SELF_TEACHER, RunConfig


class Invalid(ValueError):
    """A value that passed the schema but names something absent or not the caller's (-> 422)."""

    def __init__(self, loc: tuple[str, ...], msg: str) -> None:
        super().__init__(f"{'.'.join(loc)}: {msg}")
        self.loc, self.msg = loc, msg


def check_corrector(session: Session, config: RunConfig, team: str) -> None:
    """A run naming a corrector its team cannot use would train without corrections (every
    call failing): refuse it at launch. One message for "absent" and "another team's", so
    nothing here tells a team what exists outside its reach."""
    name = config.corrector.name
    # Built in (oracle, the self-teacher) or inline in the run's [corrector]: nothing to look up
    # (an inline one still meets the egress policy and the key prefix when it is called).
    if not config.uses_corrector or name in (ORACLE, SELF_TEACHER) or config.corrector.kind:
        return
    from shared.db.models import Corrector

    row = session.scalar(select(Corrector).where(Corrector.name == name))
    if row is None or not usable_by(row, team):
        raise Invalid(
            ("corrector", "name"),
            f"no corrector named '{name}' is available to team '{team}' (register one with "
            "`gtr corrector add` or POST /api/correctors, ask an admin to mark one shared, "
            "or use 'oracle')",
        )


def queued_run(config: RunConfig, team: str, **fields: Any) -> Run:
    """A run row for ``config``, queued for a controller (not added to a session); ``fields``:
    more columns (a study's cell, ``info``)."""
    return Run(
        name=config.name,
        team=team,
        task=config.task,
        algorithm=config.algorithm,
        status="queued",
        config=config.model_dump(mode="json"),
        total_env_steps=config.total_env_steps,
        num_updates=config.train.num_updates,
        **fields,
    )


def create_run(session: Session, config: RunConfig, team: str) -> Run:
    """The run's row, queued (flushed, not committed: the caller's transaction)."""
    check_corrector(session, config, team)
    run = queued_run(config, team)
    session.add(run)
    session.flush()
    return run
