"""A run's corrector budget (`[corrector] max_calls`, `max_tokens`), kept in `corrector_spend`.

Every call attempt, retries and tool rounds included, reserves one call with a conditional UPDATE
before it is sent, in a short transaction of its own: concurrent threads, Celery workers and
retries can never spend past `max_calls`, and none waits on another's row lock while it calls.
Tokens are known only once an answer is in, so a spent token budget stops the *next* call; calls
already in flight may each add their tokens past it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from services.corrector.resilience import BudgetExceeded
from shared.db.models import CorrectorSpend, Run


class RunBudget:
    """The budget one run has for one corrector; charged by `call_with_retries` per attempt."""

    def __init__(
        self,
        engine: Engine,
        run_id: int,
        corrector: str,
        max_calls: int | None,
        max_tokens: int | None,
    ) -> None:
        self.engine, self.run_id, self.corrector = engine, run_id, corrector
        self.max_calls, self.max_tokens = max_calls, max_tokens
        self._key = (CorrectorSpend.run_id == run_id, CorrectorSpend.corrector == corrector)

    def check(self) -> None:
        """Raises BudgetExceeded when nothing is left, reserving nothing."""
        with self.engine.connect() as conn:
            spent = self._spent(conn)
        if spent:
            raise BudgetExceeded(spent)

    def charge_call(self) -> None:
        """Reserves one call, or raises BudgetExceeded when none is left."""
        with self.engine.begin() as conn:
            if self._reserve(conn):
                return
            # The run's first call creates its row; a concurrent creator's row is waited for.
            insert = postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert
            row = {"run_id": self.run_id, "corrector": self.corrector, "calls": 0, "tokens": 0}
            conn.execute(insert(CorrectorSpend).values(**row).on_conflict_do_nothing())
            if self._reserve(conn):
                return
            spent = self._spent(conn)
        raise BudgetExceeded(spent or "budget spent")

    def add_tokens(self, n: int) -> None:
        if n <= 0:
            return
        with self.engine.begin() as conn:
            conn.execute(
                update(CorrectorSpend).where(*self._key).values(tokens=CorrectorSpend.tokens + n)
            )

    def _reserve(self, conn: Connection) -> bool:
        # PostgreSQL re-checks the WHERE on the updated row after a concurrent writer commits,
        # so the test and the increment are one atomic step.
        room: list[ColumnElement[bool]] = []
        if self.max_calls is not None:
            room.append(CorrectorSpend.calls < self.max_calls)
        if self.max_tokens is not None:
            room.append(CorrectorSpend.tokens < self.max_tokens)
        result = conn.execute(
            update(CorrectorSpend).where(*self._key, *room).values(calls=CorrectorSpend.calls + 1)
        )
        return result.rowcount == 1

    def _spent(self, conn: Connection) -> str | None:
        row = conn.execute(
            select(CorrectorSpend.calls, CorrectorSpend.tokens).where(*self._key)
        ).first()
        calls, tokens = row if row is not None else (0, 0)
        if self.max_calls is not None and calls >= self.max_calls:
            return f"call budget of {self.max_calls} spent"
        if self.max_tokens is not None and tokens >= self.max_tokens:
            return f"token budget of {self.max_tokens} spent"
        return None


def run_budget(session: Session, run_id: int, corrector: str) -> RunBudget | None:
    """The run's budget for `corrector`. Without limits it still counts every call (retries and
    duplicate deliveries included), so the spend a run shows is what the endpoint saw; only the
    built-in oracle, which calls nothing, has none."""
    if corrector == "oracle":
        return None
    run = session.get(Run, run_id)
    cfg: dict[str, Any] = (run.config or {}).get("corrector", {}) if run else {}
    max_calls, max_tokens = cfg.get("max_calls"), cfg.get("max_tokens")
    # Reservations commit on connections of their own, never inside the caller's transaction.
    engine = session.get_bind().engine
    return RunBudget(engine, run_id, corrector, max_calls, max_tokens)
