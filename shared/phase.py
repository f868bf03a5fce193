"""What a run is doing now, for the run page and the runs list: its phase, written to the run's
row by whoever does the work (the controller, or the trainer during a warm start).

Phases: ``warm_start`` (step k of n) · ``rollout`` (env step k of n) · ``corrections`` (waiting
for this rollout's corrections) · ``training`` · ``evaluating``; None once the run has ended.
Each writer commits on a connection of its own, so the page sees it while the work goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar

from sqlalchemy import select, update

from shared.db.models import Run, utcnow
from shared.db.session import session_scope

PHASES = ("warm_start", "rollout", "corrections", "training", "evaluating")

# A warm start calls this every chunk of steps with (steps done, steps planned); set by the
# trainer's init stage for its run (services/trainer/runs.py), unset elsewhere.
warm_progress: ContextVar[Callable[[int, int], None] | None] = ContextVar(
    "warm_progress", default=None
)


class RunCancelled(RuntimeError):
    """The run's cancel was requested while work on it was under way."""


def set_phase(run_id: int, phase: str | None, step: int | None = None, total: int | None = None):  # type: ignore[no-untyped-def]
    """Record the phase; its start time moves only when the phase itself changes."""
    with session_scope() as s:
        current = s.scalar(select(Run.phase).where(Run.id == run_id))
        values: dict = {"phase": phase, "phase_step": step, "phase_total": total}
        if current != phase:
            values["phase_at"] = utcnow()
        s.execute(update(Run).where(Run.id == run_id).values(**values))


def cancel_requested(run_id: int) -> bool:
    with session_scope() as s:
        return bool(s.scalar(select(Run.cancel_requested).where(Run.id == run_id)))


def warm_start_reporter(run_id: int) -> Callable[[int, int], None]:
    """The hook a run's warm start calls each chunk: show k of n, and stop if cancelled."""

    def report(done: int, total: int) -> None:
        set_phase(run_id, "warm_start", done, total)
        if cancel_requested(run_id):
            raise RunCancelled(f"run {run_id} cancelled during its warm start")

    return report
