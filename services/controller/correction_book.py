"""The run's side of its corrections: steps queued, waited for in the strict modes, the missing
sent again once (then recorded failed), and each update's correction figures kept current."""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from services.controller import correction_stats as CS
from services.controller.backends import Corrections, CorrectionSweep, settle_corrections
from shared.db.models import Correction, Run, Step, utcnow
from shared.db.session import session_scope
from shared.phase import RunCancelled, cancel_requested, set_phase
from shared.schemas import RunConfig

log = logging.getLogger("gtr.controller")

# A correction's finished_at is stamped before its row commits: look back this far for late ones.
LATE_MARGIN = timedelta(seconds=120)


class CorrectionBook:
    """Over the corrections backend (None: a run without one)."""

    def __init__(self, run_id: int, backend: Corrections | None, cfg: RunConfig) -> None:
        self.run_id, self.backend, self.cfg = run_id, backend, cfg
        self.sweeper: CorrectionSweep | None = None
        self.stats_at: datetime | None = None  # correction figures are current up to this
        self.waited_s: float | None = None  # how long ``bound`` held the last update back
        if backend is not None and cfg.uses_corrector:
            c = cfg.corrector
            self.sweeper = CorrectionSweep(backend, run_id, c.name, c.wait_timeout_s)

    @property
    def correcting(self) -> bool:
        return self.backend is not None and self.cfg.uses_corrector

    def submit(self, step_ids: list[int]) -> None:
        if step_ids and self.backend is not None:
            self.backend.submit(self.run_id, step_ids)

    def settle(self, step_ids: list[int]) -> None:
        """Strict modes: wait for these corrections (the missing re-sent once, then failed)."""
        assert self.backend is not None
        name, timeout = self.cfg.corrector.name, self.cfg.corrector.wait_timeout_s
        n = settle_corrections(self.backend, self.run_id, step_ids, name, timeout)
        if n:
            log.warning("run %s: %s corrections timed out, recorded failed", self.run_id, n)

    def sweep(self, u: int) -> None:
        """Any mode: send again, once, the corrections of earlier steps that never came."""
        if self.sweeper is not None:
            self.sweeper.sweep(u)

    def bound(self, u: int) -> None:
        """Bounded staleness, before update ``u`` trains: while the run is below
        ``corrector.min_coverage`` or a correction older than ``corrector.max_lag_updates``
        updates is missing, wait (up to ``wait_timeout_s``) instead of training without them."""
        c = self.cfg.corrector
        if not self.correcting or (not c.min_coverage and c.max_lag_updates is None):
            return
        started = time.monotonic()
        deadline = started + c.wait_timeout_s
        shown = False
        while (why := behind(self.run_id, u, c.min_coverage, c.max_lag_updates)) is not None:
            if time.monotonic() >= deadline:
                log.warning(
                    "run %s: update %s trains after %g s though %s",
                    self.run_id,
                    u,
                    c.wait_timeout_s,
                    why,
                )
                break
            if not shown:
                set_phase(self.run_id, "corrections")
                log.info("run %s: update %s waits for corrections: %s", self.run_id, u, why)
                shown = True
            if cancel_requested(self.run_id):
                raise RunCancelled(f"run {self.run_id} cancelled while it waited for corrections")
            time.sleep(0.2)
        self.waited_s = time.monotonic() - started

    def finish(self) -> None:
        if self.sweeper is None:
            return
        set_phase(self.run_id, "corrections")
        if n := self.sweeper.finish(self.cfg.corrector.drain_s):
            log.warning("run %s: %s corrections recorded failed or late", self.run_id, n)

    def final_status(self, s: Session, status: str, error: str | None) -> tuple[str, str | None]:
        """A run that went to its end with most of its corrections failed ends ``degraded``."""
        if not self.correcting:
            return status, error
        run = s.get(Run, self.run_id)
        if run is not None:  # the coverage the run trained with, on its record
            totals = CS.run_totals(s, self.run_id)
            kept = {k: totals[k] for k in CS.RECORDED if k in totals}
            run.info = {**(run.info or {}), "corrections": kept}
        return CS.final_status(s, self.run_id, self.cfg, status, error)

    def figures(self, s: Session, u: int) -> dict[str, float]:
        """Update ``u``'s correction figures; earlier updates whose corrections came late are
        recomputed too, so no update keeps a snapshot."""
        if not self.correcting:
            return CS.figures([])
        since, self.stats_at = self.stats_at, utcnow() - LATE_MARGIN
        CS.refresh_late(s, self.run_id, since, before=u)
        out = CS.update_figures(s, self.run_id, u)
        if self.waited_s is not None:  # bounded staleness held the update back this long
            out["corrector_wait_s"], self.waited_s = self.waited_s, None
        return out

    def close(self, status: str) -> None:
        """At the run's end: the pool drained (not for a failed run; a cancelled one is not
        waited for), then the late corrections counted."""
        if self.backend is None:
            return
        if status != "failed":
            try:
                self.backend.close(wait=status != "cancelled")
            except Exception:
                log.exception("closing the correction pool")
        try:
            with session_scope() as s:
                CS.refresh_late(s, self.run_id, self.stats_at, before=None)
        except Exception:  # the figures are a view; the run's status must still be written
            log.exception("run %s: refreshing the correction figures failed", self.run_id)


def behind(run_id: int, u: int, min_coverage: float, max_lag: int | None) -> str | None:
    """Why update ``u`` should not train yet, or None: corrections of update ``u - max_lag`` or
    older still missing, or fewer than ``min_coverage`` of the run's requested ones done while
    some are still to come."""
    finished = (
        select(Correction.id)
        .where(Correction.step_id == Step.id, Correction.status.in_(("done", "failed")))
        .exists()
    )
    asked = (Step.run_id == run_id, Step.format_valid.is_(True), Step.update_idx <= u)
    with session_scope() as s:
        if max_lag is not None:
            old = s.scalar(
                select(func.count())
                .select_from(Step)
                .where(*asked, Step.update_idx <= u - max_lag, ~finished)
            )
            if old:
                return f"{old} corrections older than corrector.max_lag_updates = {max_lag} missing"
        if min_coverage:
            n = int(s.scalar(select(func.count()).select_from(Step).where(*asked)) or 0)
            done = s.scalar(
                select(func.count())
                .select_from(Correction)
                .where(
                    Correction.run_id == run_id,
                    Correction.update_idx <= u,
                    Correction.status == "done",
                )
            )
            missing = s.scalar(select(func.count()).select_from(Step).where(*asked, ~finished))
            if n and missing and (done or 0) / n < min_coverage:
                return (
                    f"{done} of {n} corrections done, under corrector.min_coverage = "
                    f"{min_coverage:g}"
                )
    return None
