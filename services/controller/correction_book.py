"""The run's side of its corrections: steps queued, waited for in the strict modes, the missing
sent again once (then recorded failed), and each update's correction figures kept current."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from services.controller import correction_stats as CS
from services.controller.backends import Corrections, CorrectionSweep, settle_corrections
from shared.db.models import utcnow
from shared.db.session import session_scope
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

    def finish(self) -> None:
        if self.sweeper is not None and (n := self.sweeper.finish()):
            log.warning("run %s: %s corrections recorded failed or skipped", self.run_id, n)

    def final_status(self, s: Session, status: str, error: str | None) -> tuple[str, str | None]:
        """A run that went to its end with most of its corrections failed ends ``degraded``."""
        if not self.correcting:
            return status, error
        return CS.final_status(s, self.run_id, self.cfg, status, error)

    def figures(self, s: Session, u: int) -> dict[str, float]:
        """Update ``u``'s correction figures; earlier updates whose corrections came late are
        recomputed too, so no update keeps a snapshot."""
        since, self.stats_at = self.stats_at, utcnow() - LATE_MARGIN
        CS.refresh_late(s, self.run_id, since, before=u)
        return CS.update_figures(s, self.run_id, u)

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
