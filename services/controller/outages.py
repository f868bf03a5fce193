"""What stops a run other than its budget: a cancel, and a service that went away (an outage,
waited out a bounded number of times in a row)."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx

from services.controller.backends import BROKER_ERRORS
from shared.phase import cancel_requested

log = logging.getLogger("gtr.controller")


class Cancelled(Exception):
    pass


class Outage(RuntimeError):
    """A service the run needs stayed away, or kept failing, past the driver's bounds."""


def check_cancel(run_id: int) -> None:
    if cancel_requested(run_id):
        raise Cancelled()


def is_interruption(e: BaseException) -> bool:
    """Whether an error is an outage that a restart of the service cures, not the run's own fault:
    the env or policy service gone (a transport error, a 5xx, env sessions it no longer knows),
    or Redis (a publish, or the result backend, whose errors come wrapped in a RuntimeError)."""
    from services.env.service import SessionNotFound

    seen: BaseException | None = e
    for _ in range(5):  # the chain of causes, a few links deep
        if seen is None:
            return False
        if isinstance(seen, (httpx.TransportError, SessionNotFound, *BROKER_ERRORS)):
            return True
        if int(getattr(seen, "status_code", 0) or 0) >= 500:  # EnvClient, PolicyClient errors
            return True
        seen = seen.__cause__
    return False


class Outages:
    """An outage is waited out for up to ``outage_s``; ``max_interruptions`` in a row (no update
    trained in between) end the run."""

    def __init__(
        self, run_id: int, parts: list[Any], outage_s: float, max_interruptions: int
    ) -> None:
        self.run_id, self.parts = run_id, parts  # the backends, networked or in-process
        self.outage_s, self.max_interruptions, self.interruptions = outage_s, max_interruptions, 0

    def count(self, e: Exception) -> None:
        """One more interruption in a row; past the bound, the run ends with an ``Outage``."""
        self.interruptions += 1
        if self.interruptions > self.max_interruptions:
            raise Outage(
                f"gave up after {self.max_interruptions} interruptions in a row; "
                f"the last: {type(e).__name__}: {e}"
            ) from e
        log.warning(
            "run %s interrupted (%s of %s): %s: %s; waiting for the services",
            self.run_id,
            self.interruptions,
            self.max_interruptions,
            type(e).__name__,
            e,
        )

    def wait(self, cause: Exception) -> None:
        """Until every networked backend answers its health check, for up to ``outage_s``."""
        deadline = time.monotonic() + self.outage_s
        for part in [p for p in self.parts if hasattr(p, "health")]:  # in-process parts have none
            while True:
                check_cancel(self.run_id)
                try:
                    part.health()
                    break
                except Exception as e:
                    if time.monotonic() > deadline:
                        raise Outage(
                            f"{type(part).__name__} did not come back within {self.outage_s:g} s "
                            f"({type(e).__name__}: {e}) after {type(cause).__name__}: {cause}"
                        ) from cause
                time.sleep(1.0)
