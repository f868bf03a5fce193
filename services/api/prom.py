"""The API's Prometheus metrics read from the database and Redis at scrape time: runs by status,
corrections, latency and spend by corrector, the latest update's speed of the running runs, and
the depth of the Celery queues. A scrape is a handful of aggregate queries.

The open ``/metrics`` aggregates: registered correctors together (``registered``; the built-ins
by name, inline ones as ``inline``) and the running runs' figures as their mean, so nothing in it
follows one team's corrector or run. ``GET /api/metrics`` (an admin token, which sees every team)
gives the same series per corrector registry id and per run id."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import func, select

from services.corrector.service import ORACLE
from shared.db.models import RUN_STATUSES, Correction, Corrector, Run, Update
from shared.db.session import session_scope
from shared.schemas import SELF_TEACHER
from shared.settings import get_settings

log = logging.getLogger("gtr.api")

# Figures of a running run's latest update, exported per run.
RUN_FIGURES = {
    "env_steps_per_s": "Env steps per second of the latest rollout",
    "update_s": "Seconds of the latest update (rollout, training, probe)",
    "update_cpu_s": "CPU seconds the run's driver process spent on the latest update",
    "train_s": "Seconds the trainer took for the latest update",
    "corrector_latency_ms": "Mean correction latency of the latest update (ms)",
    "tracking_s": "Seconds spent in experiment trackers in the latest update",
}


class StoreCollector(Collector):
    def __init__(self, detailed: bool = False) -> None:
        self.detailed = detailed  # per corrector id and per run id (behind an admin token)

    def collect(self) -> Iterator[Metric]:
        try:
            with session_scope() as s:
                yield from _runs(s)
                yield from _corrections(s, self.detailed)
                yield from _running(s, self.detailed)
        except Exception as e:  # a database outage shows as a missing series, not a 500
            log.warning("metrics: the database did not answer: %s", e)
        yield from _queues()

    def describe(self) -> list[Metric]:
        return []  # collected lazily: no database query at registration


def _runs(s: Any) -> Iterator[Metric]:
    g = GaugeMetricFamily("gtr_runs", "Runs by status", labels=["status"])
    counts = dict(s.execute(select(Run.status, func.count()).group_by(Run.status)).all())
    for status in RUN_STATUSES:
        g.add_metric([status], float(counts.get(status, 0)))
    yield g


def _label(ids: dict[str, int], name: str, detailed: bool) -> str:
    """A corrector's label: never its name (names are teams' own); its registry id when
    detailed, else all registered ones together; the built-ins by name, inline ones together."""
    if name in ids:
        return str(ids[name]) if detailed else "registered"
    return name if name in (ORACLE, SELF_TEACHER) else "inline"


def _corrections(s: Any, detailed: bool) -> Iterator[Metric]:
    ids = {name: cid for name, cid in s.execute(select(Corrector.name, Corrector.id)).all()}
    by = GaugeMetricFamily(
        "gtr_corrections",
        "Corrections by corrector (registry id), status and verdict",
        labels=["corrector", "status", "verdict"],
    )
    rows = s.execute(
        select(Correction.corrector, Correction.status, Correction.verdict, func.count()).group_by(
            Correction.corrector, Correction.status, Correction.verdict
        )
    ).all()
    counts: dict[tuple[str, str, str], float] = defaultdict(float)
    for name, status, verdict, n in rows:
        counts[(_label(ids, name, detailed), status, verdict or "")] += float(n)
    for key, n in counts.items():
        by.add_metric(list(key), n)
    yield by
    lat = GaugeMetricFamily(
        "gtr_correction_latency_ms_mean",
        "Mean latency of finished corrections, by corrector (registry id)",
        labels=["corrector"],
    )
    spend = GaugeMetricFamily(
        "gtr_corrector_tokens", "Tokens spent by corrector (registry id)", labels=["corrector"]
    )
    done = s.execute(
        select(
            Correction.corrector,
            func.sum(Correction.latency_ms),
            func.count(Correction.latency_ms),
            func.sum(Correction.tokens),
        )
        .where(Correction.status == "done")
        .group_by(Correction.corrector)
    ).all()
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for name, total_ms, n, tokens in done:
        acc = sums[_label(ids, name, detailed)]
        acc[0], acc[1], acc[2] = acc[0] + float(total_ms or 0), acc[1] + n, acc[2] + (tokens or 0)
    for label, (total_ms, n, tokens) in sums.items():
        lat.add_metric([label], total_ms / n if n else 0.0)
        spend.add_metric([label], tokens)
    yield lat
    yield spend


def _running(s: Any, detailed: bool) -> Iterator[Metric]:
    """Each running run's latest figures by run id (detailed), or their mean over the running
    runs (the open scrape)."""
    gauges = {
        k: GaugeMetricFamily(
            f"gtr_run_{k}",
            doc if detailed else f"{doc}, mean over the running runs",
            labels=["run_id"] if detailed else [],
        )
        for k, doc in RUN_FIGURES.items()
    }
    values: dict[str, list[float]] = defaultdict(list)
    running = s.scalars(select(Run.id).where(Run.status == "running")).all()
    for run_id in running[:200]:
        latest = s.scalar(
            select(Update.metrics)
            .where(Update.run_id == run_id)
            .order_by(Update.idx.desc())
            .limit(1)
        )
        for k, g in gauges.items():
            v = (latest or {}).get(k)
            if isinstance(v, int | float) and not isinstance(v, bool):
                if detailed:
                    g.add_metric([str(run_id)], float(v))
                values[k].append(float(v))
    if not detailed:
        for k, vs in values.items():
            gauges[k].add_metric([], sum(vs) / len(vs))
    yield from gauges.values()


def _queues() -> Iterator[Metric]:
    if not get_settings().redis_url:
        return
    from services.controller.backends import queued_messages

    g = GaugeMetricFamily("gtr_queue_depth", "Messages waiting in a Celery queue", labels=["queue"])
    for q in ("corrector", "trainer"):
        try:
            g.add_metric([q], float(queued_messages(q)))
        except Exception as e:
            log.warning("metrics: queue %s unreadable: %s", q, e)
    yield g


def api_registry(detailed: bool = False) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(StoreCollector(detailed))
    return reg
