"""Where a rollout's time goes: wall-clock seconds per stage, summed over an update's steps.

The controller writes the totals into the update's metrics (``time/<stage>_s``), so the pipeline
bench (``bench/pipeline_bench.py --profile``) compares the embedded run and the full stack stage
by stage from the runs themselves, with no separate instrumentation."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StageClock:
    """Accumulates wall-clock seconds per named stage."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[stage] = self.totals.get(stage, 0.0) + time.perf_counter() - start

    def add(self, stage: str, seconds: float) -> None:
        """Seconds timed elsewhere (a rollout step times its generation and env step itself)."""
        self.totals[stage] = self.totals.get(stage, 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        """``{"time/<stage>_s": seconds}`` for an update's metrics."""
        return {f"time/{k}_s": round(v, 6) for k, v in self.totals.items()}
