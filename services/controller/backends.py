"""How the controller reaches the other services: in-process objects (embedded) or the network
(full stack). Both expose the same small interface, so the run logic exists once."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from celery.exceptions import TimeoutError as CeleryTimeout
from kombu.exceptions import ChannelError
from kombu.exceptions import OperationalError as BrokerError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeout
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from shared.db.models import Correction
from shared.db.session import session_scope
from shared.phase import RunCancelled, cancel_requested
from shared.queues import (
    QUEUE_TRAINER,
    TASK_CORRECT,
    TASK_CORRECT_BATCH,
    TASK_INIT,
    TASK_UPDATE,
    celery_app,
)
from shared.settings import Settings

if TYPE_CHECKING:
    from collections.abc import Sequence

    from services.env.client import EnvClient
    from services.env.service import EnvPool, Observation, StepResult
    from services.policy.protocol import ImageLike, RolloutPolicy
    from services.policy.schemas import Generation
    from services.policy.service import Policy
    from services.policy.vllm_backend import VllmPolicy
    from shared.schemas import EnvConfig, ModelConfig

log = logging.getLogger("gtr.controller")

# The broker or the result backend (both Redis) cannot be reached.
BROKER_ERRORS = (BrokerError, RedisConnectionError, RedisTimeout)


class Envs(Protocol):
    """The env sessions a run steps: ``EnvPool`` in this process, ``EnvClient`` over HTTP."""

    def create(
        self, task: str, config: EnvConfig | dict[str, Any] | None = None, seed: int | None = None
    ) -> str: ...
    def reset(self, session_id: str, /) -> Observation: ...
    def step_batch(self, items: Sequence[tuple[str, str]], /) -> list[StepResult]: ...
    def close(self, session_id: str, /) -> None: ...
    def set_target_formula(self, session_id: str, formula: str, /) -> None: ...


if TYPE_CHECKING:  # mypy holds both to the contract
    _pool: type[Envs] = EnvPool
    _client: type[Envs] = EnvClient


class Corrections(Protocol):
    def submit(self, run_id: int, step_ids: list[int]) -> None: ...
    def close(self, wait: bool = True) -> None: ...


def backlog_of(corrections: Corrections, step_ids: list[int]) -> set[int]:
    """The steps among ``step_ids`` still waiting in this process's queue, never sent; only the
    embedded pool knows (a Celery task's state is the broker's)."""
    known = getattr(corrections, "backlog", None)
    return known(step_ids) if known is not None else set()


def withdraw_backlog(corrections: Corrections, step_ids: list[int]) -> set[int]:
    """Takes the steps among ``step_ids`` still waiting in this process's queue out of it, so
    none of them is sent from now on, and returns them: the run is about to record them
    ``skipped: backlog`` (never sent). Reading the backlog instead would race a slot that frees
    meanwhile: the step would be sent and recorded as never sent."""
    known = getattr(corrections, "withdraw", None)
    return known(step_ids) if known is not None else set()


def in_flight_of(corrections: Corrections, step_ids: list[int]) -> set[int]:
    """The steps among ``step_ids`` sent to the corrector and not answered yet, as far as this
    process knows (the embedded pool; a Celery task's state is the broker's)."""
    known = getattr(corrections, "in_flight", None)
    return known(step_ids) if known is not None else set()


def resend_missing(corrections: Corrections, run_id: int, missing: list[int], when: str) -> None:
    """Sends again the missing corrections that are neither queued nor in flight here, and
    logs what the missing ones are: never sent, in flight, or lost (sent again)."""
    waiting = backlog_of(corrections, missing)
    flying = in_flight_of(corrections, missing)
    lost = [i for i in missing if i not in waiting and i not in flying]
    parts = [f"{len(waiting)} never sent yet (queued here)"] if waiting else []
    parts += [f"{len(flying)} in flight"] if flying else []
    parts += [f"{len(lost)} not queued here: sent again"] if lost else []
    log.warning(
        "run %s: %s corrections missing %s: %s", run_id, len(missing), when, ", ".join(parts)
    )
    if lost:
        corrections.submit(run_id, lost)


class TrainerBackend(Protocol):
    def init(self, run_id: int) -> Path: ...
    def update(self, run_id: int, update_idx: int) -> Path: ...


def pending_corrections(run_id: int, step_ids: list[int]) -> int:
    if not step_ids:
        return 0
    with session_scope() as s:
        done = s.scalar(
            select(func.count()).where(
                Correction.run_id == run_id,
                Correction.step_id.in_(step_ids),
                Correction.status.in_(("done", "failed")),
            )
        )
    return len(step_ids) - int(done or 0)


def wait_for_corrections(run_id: int, step_ids: list[int], timeout_s: float) -> int:
    """Strict mode: wait for this rollout's corrections; returns how many are still missing.
    A cancel of the run ends the wait (RunCancelled): a slow corrector must not hold it."""
    deadline = time.monotonic() + timeout_s
    while (left := pending_corrections(run_id, step_ids)) and time.monotonic() < deadline:
        if cancel_requested(run_id):
            raise RunCancelled(f"run {run_id} cancelled while it waited for corrections")
        time.sleep(0.2)
    return left


def missing_corrections(run_id: int, step_ids: list[int]) -> list[int]:
    """The steps among ``step_ids`` with no finished (done or failed) correction yet."""
    with session_scope() as s:
        finished = set(
            s.scalars(
                select(Correction.step_id).where(
                    Correction.run_id == run_id,
                    Correction.step_id.in_(step_ids),
                    Correction.status.in_(("done", "failed")),
                )
            )
        )
    return [i for i in step_ids if i not in finished]


def settle_corrections(
    corrections: Corrections, run_id: int, step_ids: list[int], corrector: str, timeout_s: float
) -> int:
    """Strict mode: wait for these corrections; at the timeout send the missing ones once more
    and wait again, then record the rest failed. Returns how many were recorded failed.

    A killed worker's tasks come back only after the broker's visibility timeout, and a Redis
    restart drops queued ones; a re-sent task for a step already corrected writes nothing."""
    if not wait_for_corrections(run_id, step_ids, timeout_s):
        return 0
    missing = missing_corrections(run_id, step_ids)
    resend_missing(corrections, run_id, missing, f"after {timeout_s:g} s")
    if not wait_for_corrections(run_id, missing, timeout_s):
        return 0
    backlog = withdraw_backlog(corrections, missing)
    return record_missing_as_failed(run_id, missing, corrector, 2 * timeout_s, backlog)


def record_missing_as_failed(
    run_id: int,
    step_ids: list[int],
    corrector: str,
    timeout_s: float,
    backlog: set[int] | frozenset[int] = frozenset(),
    skipped: str | None = None,
) -> int:
    """After a wait times out, every step still without a finished correction gets a failed row
    with the reason, so nothing is lost silently (a late answer then finds the row and stops).
    Steps in ``backlog`` were never sent: ``skipped: backlog``, and they never will be."""
    from shared.db.models import Step, utcnow

    reason = f"timeout: no answer within {timeout_s:g} s"
    skipped = skipped or (
        f"skipped: backlog: not sent within {timeout_s:g} s, the corrector answers slower "
        "than the rollout makes steps"
    )
    with session_scope() as s:
        n = 0
        for ids, error in ((set(step_ids) - set(backlog), reason), (backlog, skipped)):
            n += s.execute(  # type: ignore[attr-defined]
                update(Correction)
                .where(Correction.step_id.in_(ids), Correction.status == "pending")
                .values(status="failed", error=error, finished_at=utcnow())
            ).rowcount
        have = set(s.scalars(select(Correction.step_id).where(Correction.step_id.in_(step_ids))))
        missing = s.scalars(select(Step).where(Step.id.in_([i for i in step_ids if i not in have])))
        for step in missing:
            row = Correction(
                step_id=step.id,
                run_id=run_id,
                update_idx=step.update_idx,
                corrector=corrector,
                status="failed",
                error=skipped if step.id in backlog else reason,
                finished_at=utcnow(),
            )
            try:
                with s.begin_nested():
                    s.add(row)
            except IntegrityError:  # a late worker wrote its row meanwhile: that one stands
                continue
            n += 1
    return int(n or 0)


class CorrectionSweep:
    """Nothing waits for corrections under ``corrector.wait = "none"``, so a task lost with
    Redis's data, or held by a killed worker for the broker's visibility timeout, would leave
    its step uncorrected for good. Once per update, ``sweep`` sends again, once, the well-formed
    steps queued more than ``timeout_s`` ago that still have no finished correction, and records
    failed those still missing ``timeout_s`` after that; ``finish`` settles the rest at the end.

    One query per sweep, from the oldest update that still had a missing correction on."""

    def __init__(
        self, corrections: Corrections, run_id: int, corrector: str, timeout_s: float
    ) -> None:
        self.corrections, self.run_id = corrections, run_id
        self.corrector, self.timeout_s = corrector, timeout_s
        self.resent: dict[int, float] = {}  # step id -> monotonic time it was sent again
        self.from_update = 0  # every step of an earlier update has a finished correction

    def _unsettled(self) -> list[Any]:
        """(id, update_idx, old) of the steps from ``from_update`` on with no finished
        correction; ``old``: recorded (so queued) more than ``timeout_s`` ago."""
        from shared.db.models import Step, utcnow

        cutoff = utcnow() - timedelta(seconds=self.timeout_s)
        finished = (
            select(Correction.id)
            .where(Correction.step_id == Step.id, Correction.status.in_(("done", "failed")))
            .exists()
        )
        with session_scope() as s:
            return list(
                s.execute(
                    select(Step.id, Step.update_idx, (Step.created_at < cutoff).label("old"))
                    .where(
                        Step.run_id == self.run_id,
                        Step.update_idx >= self.from_update,
                        Step.format_valid.is_(True),
                        ~finished,
                    )
                    .order_by(Step.id)
                )
            )

    def sweep(self, update_idx: int) -> int:
        """After update ``update_idx``'s rollout is recorded; returns how many were sent again."""
        rows = self._unsettled()
        now = time.monotonic()
        expired = [r.id for r in rows if now - self.resent.get(r.id, now) > self.timeout_s]
        again = [r.id for r in rows if r.old and r.id not in self.resent]
        if expired:
            n = record_missing_as_failed(
                self.run_id,
                expired,
                self.corrector,
                2 * self.timeout_s,
                withdraw_backlog(self.corrections, expired),
            )
            log.warning("run %s: %s corrections never came, recorded failed", self.run_id, n)
        if again:  # from now on their clock runs: recorded failed timeout_s later
            resend_missing(self.corrections, self.run_id, again, f"after {self.timeout_s:g} s")
            self.resent.update((i, now) for i in again)
        gone = set(expired)
        self.from_update = min((r.update_idx for r in rows if r.id not in gone), default=update_idx)
        return len(again)

    def finish(self, drain_s: float | None = None) -> int:
        """At the run's end, when training is over: the backlog drains (the pool or the Celery
        workers go on sending it) for up to ``drain_s`` (default: the sweep's timeout). After
        the sweep's timeout (at most halfway), the missing ones neither queued nor in flight
        here (a lost task; a Celery task's state is the broker's) are sent again, once.
        Corrections not in by the deadline are recorded ``late`` (they could teach no update),
        not failed. Returns how many were recorded."""
        drain_s = self.timeout_s if drain_s is None else drain_s
        ids = [r.id for r in self._unsettled()]
        if not ids:
            return 0
        deadline = time.monotonic() + drain_s
        log.warning(
            "run %s: draining %s corrections (up to corrector.drain_s = %g s)",
            self.run_id,
            len(ids),
            drain_s,
        )
        if not wait_for_corrections(self.run_id, ids, min(drain_s / 2, self.timeout_s)):
            return 0
        missing = missing_corrections(self.run_id, ids)
        here = backlog_of(self.corrections, missing) | in_flight_of(self.corrections, missing)
        again = [i for i in missing if i not in self.resent and i not in here]
        if again:
            resend_missing(self.corrections, self.run_id, again, "at the end")
            self.resent.update((i, time.monotonic()) for i in again)
        if not wait_for_corrections(self.run_id, missing, max(deadline - time.monotonic(), 0)):
            return 0
        missing = missing_corrections(self.run_id, missing)
        why = f"late: not in within corrector.drain_s = {drain_s:g} s of the run's end "
        why += "(it could teach no update)"
        n = record_missing_as_failed(
            self.run_id, missing, self.corrector, drain_s, set(missing), why
        )
        log.warning("run %s: %s corrections recorded late", self.run_id, n)
        return n


MAX_THREADS = 512  # the embedded pool's most threads, whatever the corrector's limit


class ThreadCorrections:
    """Embedded: corrections run on a thread pool while the rollout goes on.

    A step already queued or in flight is not queued again (a sweep's re-send would otherwise
    call the corrector twice for it); how many requests reach the endpoint at once is the
    corrector's own adaptive limit, the pool only has to have enough threads for it."""

    def __init__(
        self,
        corrector_name: str,
        noise: float,
        seed: int,
        settings: Settings,
        workers: int = 8,
        run_id: int | None = None,
        inline: dict[str, Any] | None = None,
        errors: dict[str, Any] | None = None,
    ) -> None:
        from services.corrector.service import build_corrector

        with session_scope() as s:
            self.corrector = build_corrector(
                corrector_name,
                s,
                settings,
                noise=noise,
                seed=seed,
                run_id=run_id,
                inline=inline,
                errors=errors,
            )
        self.name = corrector_name
        # A thread per request the endpoint may have in flight: a thread that waits on a
        # 30 s answer costs nothing, and fewer threads than the limit would cap it.
        limit = getattr(getattr(self.corrector, "limit", None), "max_limit", 0)
        workers = max(workers, min(int(limit or 0), MAX_THREADS))
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="corrector")
        self._queued: set[int] = set()  # submitted, not sent yet: the backlog
        self._running: set[int] = set()  # sent, not answered
        self._withdrawn: set[int] = set()  # taken out of the backlog: never to be sent
        self._lock = threading.Lock()

    def _one(self, step_id: int) -> None:
        from services.corrector.service import record_correction

        try:
            with session_scope() as s:
                record_correction(
                    s, step_id, self.name, self.corrector, on_send=lambda: self._sent(step_id)
                )
        except Exception:  # recorded as failed by record_correction where it can be
            log.exception("correction of step %s failed", step_id)
        finally:
            with self._lock:
                self._queued.discard(step_id)
                self._running.discard(step_id)
                self._withdrawn.discard(step_id)

    def _sent(self, step_id: int) -> None:
        """The step got a slot at the endpoint: it leaves the backlog, unless the run withdrew
        it (then it is not sent, and its row says what the run's will: skipped, backlog)."""
        from services.corrector.base import CorrectorError

        with self._lock:
            if step_id in self._withdrawn:
                raise CorrectorError("skipped", "backlog: withdrawn by the run before it was sent")
            self._queued.discard(step_id)
            self._running.add(step_id)

    def _many(self, step_ids: list[int]) -> None:
        """A batch of steps for a corrector that answers in process: one transaction."""
        from services.corrector.service import record_corrections

        with self._lock:
            gone = self._withdrawn.intersection(step_ids)
            self._withdrawn.difference_update(gone)
            self._queued.difference_update(step_ids)
            step_ids = [i for i in step_ids if i not in gone]
            self._running.update(step_ids)
        if not step_ids:
            return
        try:
            with session_scope() as s:
                record_corrections(s, step_ids, self.name, self.corrector)
        except Exception:  # noqa: BLE001 - the sweep and the final wait record what is missing
            log.exception("correction of steps %s failed", step_ids)
        finally:
            with self._lock:
                self._running.difference_update(step_ids)

    def submit(self, run_id: int, step_ids: list[int]) -> None:
        from services.corrector.service import BATCHED

        with self._lock:
            fresh = [i for i in step_ids if i not in self._queued and i not in self._running]
            self._queued.update(fresh)
        if self.name in BATCHED and fresh:
            self.pool.submit(self._many, fresh)
            return
        for sid in fresh:
            self.pool.submit(self._one, sid)

    def backlog(self, step_ids: list[int]) -> set[int]:
        with self._lock:
            return self._queued.intersection(step_ids) - self._withdrawn

    def withdraw(self, step_ids: list[int]) -> set[int]:
        """See ``withdraw_backlog``: the queued ones among ``step_ids`` will not be sent."""
        with self._lock:
            gone = self._queued.intersection(step_ids) - self._withdrawn
            self._withdrawn.update(gone)
            return gone

    def in_flight(self, step_ids: list[int]) -> set[int]:
        with self._lock:
            return self._running.intersection(step_ids)

    def close(self, wait: bool = True) -> None:
        """Finish every queued correction; or (a cancelled run) drop the queued ones and leave
        those in flight to end in the background, however slow the corrector."""
        self.pool.shutdown(wait=wait, cancel_futures=not wait)


class CeleryCorrections:
    """Full stack: one Celery task per step on queue ``corrector``."""

    def __init__(self, corrector_name: str) -> None:
        self.name = corrector_name

    def submit(self, run_id: int, step_ids: list[int]) -> None:
        from services.corrector.service import BATCHED

        if self.name in BATCHED and step_ids:  # one task, one transaction, for them all
            celery_app.send_task(TASK_CORRECT_BATCH, args=[step_ids, self.name], ignore_result=True)
            return
        for sid in step_ids:
            # The result is the database row: no result-backend subscription per task.
            celery_app.send_task(TASK_CORRECT, args=[sid, self.name], ignore_result=True)

    def close(self, wait: bool = True) -> None:
        pass

    def health(self) -> None:
        broker_ping()


def checkpoint_dir(run_id: int, update_idx: int) -> Path:
    from shared.db.models import Checkpoint
    from shared.storage import checkpoint_store

    with session_scope() as s:
        row = s.scalar(
            select(Checkpoint)
            .where(Checkpoint.run_id == run_id, Checkpoint.update_idx <= update_idx)
            .order_by(Checkpoint.update_idx.desc())
            .limit(1)
        )
        if row is None:
            raise RuntimeError(f"run {run_id} has no checkpoint up to update {update_idx}")
        return checkpoint_store().resolve(row.path)


class InProcessTrainer:
    """Embedded: the trainer's own functions, called directly."""

    def init(self, run_id: int) -> Path:
        from services.trainer.runs import run_init

        with session_scope() as s:
            run_init(s, run_id)
        return checkpoint_dir(run_id, -1)

    def update(self, run_id: int, update_idx: int) -> Path:
        from services.trainer.runs import run_update

        with session_scope() as s:
            run_update(s, run_id, update_idx)
        return checkpoint_dir(run_id, update_idx)


def broker_ping(timeout_s: float = 2.0) -> None:
    """Raises ``kombu.exceptions.OperationalError`` unless the broker answers."""
    with celery_app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=1, timeout=timeout_s)


def queued_messages(queue: str) -> int:
    with celery_app.pool.acquire(block=True) as conn:
        try:
            return int(conn.default_channel.queue_declare(queue=queue, passive=True).message_count)
        except ChannelError:  # Redis drops an empty queue's key: nothing waits in it
            return 0


class CeleryTrainer:
    """Full stack: ``trainer.init`` / ``trainer.update`` on the trainer worker (the GPU pod).

    The result is awaited in slices. A task that is not finished, not started by a worker that
    still beats (``services/trainer/tasks.py::_beating``) and not waiting in the queue is lost
    (a killed worker's task comes back only after the broker's visibility timeout, a Redis
    restart drops a queued one): past ``lost_after_s`` it is sent again, which the idempotent
    trainer tasks allow. Meanwhile ``loop.Heartbeat`` keeps the run's heartbeat fresh."""

    def __init__(
        self, timeout_s: float = 6 * 3600, lost_after_s: float = 30.0, slice_s: float = 2.0
    ) -> None:
        self.timeout_s, self.lost_after_s, self.slice_s = timeout_s, lost_after_s, slice_s

    def _call(self, name: str, args: list[Any]) -> None:
        deadline = time.monotonic() + self.timeout_s
        result = celery_app.send_task(name, args=args)
        seen: Any = None  # the task's state and beat at the last look
        alive_at = time.monotonic()  # the last sign that someone holds the task
        while True:
            try:
                # A failed task raises here with the worker's error, which ends the run failed.
                result.get(timeout=self.slice_s, propagate=True, disable_sync_subtasks=False)
                return
            except CeleryTimeout:
                pass
            except BROKER_ERRORS:
                # Redis restarting: wait out a short outage here; past lost_after_s the error
                # goes up, and the run driver waits for the broker (RunDriver._ride_out).
                if time.monotonic() - alive_at > self.lost_after_s:
                    raise
                time.sleep(self.slice_s)
                continue
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"{name}{args} did not finish within {self.timeout_s:g} s")
            try:
                meta = celery_app.backend.get_task_meta(result.id)
                look = (meta["status"], meta.get("result"))  # STARTED carries the worker's beat
                queued = look[0] == "PENDING" and queued_messages(QUEUE_TRAINER) > 0
            except BROKER_ERRORS:
                continue  # Redis away: the next result.get tells
            if look != seen or queued:
                seen, alive_at = look, now
            elif now - alive_at > self.lost_after_s:
                log.warning(
                    "%s%s lost (%s, no sign of life for %.0f s): sent again",
                    name,
                    args,
                    look[0],
                    now - alive_at,
                )
                result, seen, alive_at = celery_app.send_task(name, args=args), None, now

    def init(self, run_id: int) -> Path:
        self._call(TASK_INIT, [run_id])
        return checkpoint_dir(run_id, -1)

    def update(self, run_id: int, update_idx: int) -> Path:
        self._call(TASK_UPDATE, [run_id, update_idx])
        return checkpoint_dir(run_id, update_idx)

    def health(self) -> None:
        broker_ping()


class InProcessPolicy:
    """Embedded: the policy object in this process, built on the first checkpoint it loads, in
    the run's ``model.dtype``, sampling with vLLM under ``model.backend = "vllm"``."""

    def __init__(self, model_cfg: ModelConfig) -> None:
        self.model_cfg = model_cfg
        self.policy: Policy | VllmPolicy | None = None

    def load_weights(self, directory: str | Path, /) -> None:
        from services.policy.vllm_backend import served_for_checkpoint

        # A checkpoint names the base model it was trained on (a warm start may have made one).
        cfg = self.model_cfg
        self.policy = served_for_checkpoint(self.policy, directory, cfg.dtype, cfg.backend)

    def generate(
        self, images: Sequence[ImageLike], prompts: Sequence[str], **kw: Any
    ) -> list[Generation]:
        if self.policy is None:
            raise RuntimeError("no checkpoint loaded yet: call load_weights first")
        return self.policy.generate(images, prompts, **kw)


if TYPE_CHECKING:  # mypy holds the class to the contract the run driver codes against
    _contract: type[RolloutPolicy] = InProcessPolicy
