"""The controller process (``gtr controller``): claims queued runs and drives them; resumes the
runs whose controller died (a stale heartbeat). Scale out by running more of them."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy import or_, select, update

from services.controller.backends import (
    CeleryCorrections,
    CeleryTrainer,
    InProcessPolicy,
    InProcessTrainer,
    ThreadCorrections,
)
from services.controller.service import RunDriver
from shared.db.models import Run, utcnow
from shared.db.session import session_scope
from shared.logs import run_context, tag_clients
from shared.schemas import RunConfig
from shared.settings import Settings, get_settings

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from services.controller.backends import Envs
    from services.policy.protocol import RolloutPolicy

log = logging.getLogger("gtr.controller")


def backends(cfg: RunConfig, settings: Settings, run_id: int | None = None) -> dict[str, Any]:
    """Network clients where a service URL / Redis is configured, in-process objects otherwise."""
    if settings.env_service_url:
        from services.env.client import EnvClient

        envs: Envs = EnvClient(settings.env_service_url)
    else:
        from services.env import EnvPool

        envs = EnvPool()
    if settings.policy_service_url:
        from services.policy.client import PolicyClient

        policy: RolloutPolicy = PolicyClient(settings.policy_service_url)
    else:
        policy = InProcessPolicy(cfg.model)
    if settings.redis_url:
        corrections: Any = CeleryCorrections(cfg.corrector.name)
        trainer: Any = CeleryTrainer(lost_after_s=settings.trainer_lost_after_s)
    else:
        c = cfg.corrector
        corrections = ThreadCorrections(
            c.name,
            c.noise,
            cfg.seed,
            settings,
            run_id=run_id,
            inline=c.inline(),
            errors=c.errors.model_dump(),
        )
        trainer = InProcessTrainer()
    if not cfg.uses_corrector:
        corrections = None
    return {"envs": envs, "policy": policy, "corrections": corrections, "trainer": trainer}


def claim_next(stale_after_s: float) -> int | None:
    """Atomically take a queued run, or a running one whose heartbeat stopped."""
    stale = utcnow() - timedelta(seconds=stale_after_s)
    with session_scope() as s:
        candidates = s.scalars(
            select(Run.id)
            .where(
                or_(
                    Run.status == "queued",
                    (Run.status == "running")
                    & ((Run.heartbeat_at.is_(None)) | (Run.heartbeat_at < stale)),
                )
            )
            .order_by(Run.id)
            .limit(5)
        ).all()
        for run_id in candidates:
            # Compare-and-set on the heartbeat: two controllers never take the same run.
            claimed = s.execute(  # type: ignore[attr-defined]
                update(Run)
                .where(
                    Run.id == run_id,
                    or_(
                        Run.status == "queued",
                        (Run.heartbeat_at.is_(None)) | (Run.heartbeat_at < stale),
                    ),
                )
                .values(status="running", heartbeat_at=utcnow())
            ).rowcount
            if claimed:
                return int(run_id)
    return None


class Heartbeat:
    """Keeps a run's heartbeat fresh while its driver works (trainer updates can take minutes)."""

    def __init__(self, run_id: int, every_s: float = 5.0) -> None:
        self.run_id, self.every_s = run_id, every_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._beat, daemon=True)

    def _beat(self) -> None:
        while not self.stop.wait(self.every_s):
            try:
                with session_scope() as s:
                    s.execute(
                        update(Run).where(Run.id == self.run_id).values(heartbeat_at=utcnow())
                    )
            except Exception:
                log.warning("heartbeat of run %s failed", self.run_id)

    def __enter__(self) -> Heartbeat:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def check_services(settings: Settings) -> None:
    """Fail a run at once, with a clear reason, when a service it needs does not answer."""
    import httpx

    for name, url in (
        ("env service", settings.env_service_url),
        ("policy service", settings.policy_service_url),
    ):
        if not url:
            continue
        try:
            httpx.get(f"{url}/healthz", timeout=5).raise_for_status()
        except httpx.HTTPError as e:
            raise ServiceDown(f"the {name} at {url} does not answer: {e}") from None


class ServiceDown(RuntimeError):
    pass


def fail_run(run_id: int, error: str) -> str:
    with session_scope() as s:
        s.execute(
            update(Run)
            .where(Run.id == run_id)
            .values(status="failed", error=error, finished_at=utcnow())
        )
    log.error("run %s failed: %s", run_id, error)
    return "failed"


def drive(run_id: int, settings: Settings | None = None, on_progress: Any = None) -> str:
    settings = settings or get_settings()
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run is not None
        cfg = RunConfig.model_validate(run.config)
    try:
        check_services(settings)
        parts = backends(cfg, settings, run_id)
    except Exception as e:  # a run that cannot start ends failed, with the reason shown in the API
        return fail_run(
            run_id, str(e) if isinstance(e, ServiceDown) else f"{type(e).__name__}: {e}"
        )
    with Heartbeat(run_id), run_context(run_id):
        tag_clients(parts, run_id)
        driver = RunDriver(
            run_id,
            **parts,
            on_progress=on_progress,
            outage_s=settings.outage_s,
            max_interruptions=settings.max_interruptions,
            policy_steps_envs=settings.policy_steps_envs,
        )
        return driver.run()


@contextmanager
def _polling(each_poll: Callable[[Session], object] | None, poll_s: float) -> Iterator[None]:
    """While this controller drives a run, ``each_poll`` goes on every ``poll_s`` in a thread of
    its own: a study's tuning trial is reported to and stopped mid-run, and other studies move on
    even when every controller is busy."""
    if each_poll is None:
        yield
        return
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(poll_s):
            try:
                with session_scope() as s:
                    each_poll(s)
            except Exception:
                log.exception("studies' scheduler error; retrying in %.1fs", poll_s)

    thread = threading.Thread(target=loop, name="each-poll", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def serve_forever(
    poll_s: float = 2.0,
    stale_after_s: float = 60.0,
    once: bool = False,
    each_poll: Callable[[Session], object] | None = None,
) -> None:
    """Claim and drive runs until killed; ``each_poll`` (the studies' scheduler, which queues
    their next runs) runs in its own transaction before each claim."""
    log.info("controller up: polling for runs every %.1fs", poll_s)
    while True:
        try:
            if each_poll is not None:
                with session_scope() as s:
                    each_poll(s)
            run_id = claim_next(stale_after_s)
            if run_id is not None:
                log.info("driving run %s", run_id)
                with _polling(each_poll, poll_s):
                    drive(run_id)
        except Exception:
            # The database (or Redis) went away: keep polling; a run left 'running' is resumed
            # by the stale-heartbeat claim once it is back.
            log.exception("controller loop error; retrying in %.1fs", poll_s)
            run_id = None
        if run_id is None:
            if once:
                return
            time.sleep(poll_s)
