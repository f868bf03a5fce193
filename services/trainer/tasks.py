"""The trainer worker's Celery tasks, on queue ``trainer``: ``trainer.init(run_id)`` and
``trainer.update(run_id, update_idx)``, each one transaction around ``runs.run_init`` /
``runs.run_update`` (or, on a multi-GPU pod, ``distributed.launch``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy.exc import OperationalError

from services.trainer.distributed import launch
from services.trainer.runs import forget_run, run_init, run_update
from shared.db.session import session_scope
from shared.logs import run_context
from shared.queues import TASK_INIT, TASK_UPDATE, celery_app

log = logging.getLogger(__name__)

# An accelerate config file: set on a multi-GPU trainer pod to run each update data-parallel.
ACCELERATE_ENV = "GTR_TRAINER_ACCELERATE_CONFIG"
# Seconds between a running task's beats (``_beating``); the controller's lost_after_s is larger.
BEAT_S = 2.0


@contextmanager
def _beating(task: Any, every_s: float = BEAT_S) -> Iterator[None]:
    """While a task runs, a thread rewrites its STARTED state with a new beat: the controller
    tells a worker at work from a killed one by it (a busy solo worker answers no broadcast)."""
    stop = threading.Event()
    task_id = task.request.id  # the request is thread-local: read it here, not in the thread

    def beat() -> None:
        n = 0
        while not stop.wait(every_s):
            n += 1
            try:
                task.update_state(task_id, "STARTED", {"pid": os.getpid(), "beat": n})
            except Exception:  # Redis restarting: the next beat lands in the new one
                log.debug("beat of task %s failed", task_id, exc_info=True)

    thread = threading.Thread(target=beat, name="beat", daemon=True)
    if task_id and not task.request.is_eager:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()  # a beat stored after the result would turn it back into STARTED


# The database away (a restart, a failover) fails the task's transaction: run it again after 1,
# 2, 4, ... 30 s, about 3 minutes in all; both tasks are idempotent, and the failed copy dropped
# its cached trainer. The controller reads RETRY as a task still held (or, past its
# lost_after_s, sends a copy, which finds the update trained or trains it once).
_TASK_OPTIONS: dict[str, Any] = {
    "acks_late": True,
    "bind": True,
    "autoretry_for": (OperationalError,),
    "retry_backoff": True,
    "retry_backoff_max": 30,
    "retry_jitter": False,
    "max_retries": 10,
}


@celery_app.task(name=TASK_INIT, **_TASK_OPTIONS)
def init(self: Any, run_id: int) -> dict[str, Any]:
    """Celery entry point: one transaction around ``run_init``."""
    with _beating(self), run_context(run_id), session_scope() as session:
        return run_init(session, run_id)


@celery_app.task(name=TASK_UPDATE, **_TASK_OPTIONS)
def update(self: Any, run_id: int, update_idx: int) -> dict[str, Any]:
    """Celery entry point: one transaction around ``run_update``."""
    config_file = os.environ.get(ACCELERATE_ENV)
    try:
        with _beating(self):
            if config_file:  # several GPUs: one data-parallel job per update
                return launch(run_id, update_idx, config_file)
            with run_context(run_id), session_scope() as session:
                return run_update(session, run_id, update_idx)
    except BaseException:
        forget_run(run_id)
        raise
