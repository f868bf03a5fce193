"""One logging setup for every process: plain text, or one JSON object a line
(``GTR_LOG_FORMAT=json``) carrying the run id of the work being done.

The run id lives in a context variable: the run driver and the trainer tasks set it
(``run_context``), and the services read it from the ``X-GTR-Run-Id`` header their clients send
(``shared.observe.install``), so every line a run causes, in any process, names the run.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from shared.settings import get_settings

RUN_HEADER = "X-GTR-Run-Id"
current_run: ContextVar[int | None] = ContextVar("gtr_run_id", default=None)
_FIELDS = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "run_id"}


@contextmanager
def run_context(run_id: int | None) -> Iterator[None]:
    token = current_run.set(run_id)
    try:
        yield
    finally:
        current_run.reset(token)


class RunIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "run_id", None) is None:
            record.run_id = current_run.get()
        return True


class JsonFormatter(logging.Formatter):
    """time, level, logger, message, run_id, the exception, and any ``extra=`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "run_id": getattr(record, "run_id", None),
        }
        out |= {k: v for k, v in record.__dict__.items() if k not in _FIELDS}
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def json_logs() -> bool:
    return get_settings().log_format.lower() == "json"


def setup_logging(level: str | None = None) -> None:
    """The root logger: JSON lines or text, the run id on each record either way."""
    handler = logging.StreamHandler()
    handler.addFilter(RunIdFilter())
    if json_logs():
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel((level or get_settings().log_level).upper())


def uvicorn_log_config() -> dict[str, Any]:
    """uvicorn's own logging config, with JSON lines when asked for."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    if json_logs():
        for name in cfg["formatters"]:
            cfg["formatters"][name] = {"()": "shared.logs.JsonFormatter"}
        cfg["filters"] = {"run_id": {"()": "shared.logs.RunIdFilter"}}
        for handler in cfg["handlers"].values():
            handler["filters"] = ["run_id"]
    return cfg


def tag_clients(parts: dict[str, Any], run_id: int) -> None:
    """Network clients of a run send its id, so the services' log lines name the run."""
    for part in parts.values():
        http = getattr(part, "_http", None)
        if http is not None and hasattr(http, "headers"):
            http.headers[RUN_HEADER] = str(run_id)


def celery_logging(**_: Any) -> None:
    """Celery's ``setup_logging`` signal: our format in the workers too."""
    setup_logging()
