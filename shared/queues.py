"""The Celery app, its queues, task names and routes: all in one place.

Task arguments are ids and small JSON; images, rollouts and checkpoints go through the stores.
Tasks are idempotent and acknowledged late, so a worker killed mid-task gets it redelivered.
"""

from __future__ import annotations

from celery import Celery

from shared.settings import get_settings

QUEUE_CORRECTOR = "corrector"
QUEUE_TRAINER = "trainer"
QUEUE_CONTROL = "control"

# Task names: "<service>.<verb>".
TASK_CORRECT = "corrector.correct"
TASK_CORRECT_BATCH = "corrector.correct_batch"  # many steps, one transaction (oracle)
TASK_UPDATE = "trainer.update"
TASK_INIT = "trainer.init"
TASK_PING = "control.ping"

ROUTES = {
    "corrector.*": {"queue": QUEUE_CORRECTOR},
    "trainer.*": {"queue": QUEUE_TRAINER},
    "control.*": {"queue": QUEUE_CONTROL},
}

# Modules that define tasks; each worker imports them so any task name resolves.
TASK_MODULES = ["shared.tasks", "services.corrector.tasks", "services.trainer.tasks"]


def make_celery(redis_url: str | None = None) -> Celery:
    url = redis_url or get_settings().redis_url or "redis://127.0.0.1:6379/0"
    app = Celery("gtr", broker=url, backend=url)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_routes=ROUTES,
        task_acks_late=True,
        task_reject_on_worker_lost=True,  # a killed worker's task goes back to the queue
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 3600},
        # Ride out a broker restart while publishing: Celery's default gives up after about a
        # second; this retries for about 30 s, after which the controller treats the error as
        # an outage (services/controller/service.py::is_interruption).
        task_publish_retry_policy={
            "max_retries": 18,
            "interval_start": 0,
            "interval_step": 0.5,
            "interval_max": 2,
        },
        # A worker marks a task STARTED, so the controller can tell a task in hand from a lost one.
        task_track_started=True,
        result_expires=3600,
        imports=TASK_MODULES,
    )
    return app


celery_app = make_celery()

if get_settings().log_format.lower() == "json":  # workers log JSON lines with the run id too
    from celery.signals import setup_logging as _celery_setup_logging

    from shared.logs import celery_logging

    _celery_setup_logging.connect(celery_logging, weak=False)
