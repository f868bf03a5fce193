"""What a run is doing now, for the run page and the runs list: its phase, written to the run's
row by whoever does the work (the controller, or the trainer during a warm start).

Phases: ``warm_start`` (step k of n) · ``rollout`` (env step k of n) · ``corrections`` (waiting
for this rollout's corrections) · ``training`` · ``evaluating``; None once the run has ended.
Each writer commits on a connection of its own, so the page sees it while the work goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar

from sqlalchemy import select, update

from shared.db.models import Run, utcnow
from shared.db.session import session_scope

PHASES = ("warm_start", "rollout", "corrections", "training", "evaluating")

# A warm start calls this every chunk of steps with (steps done, steps planned); set by the
# trainer's init stage for its run (services/trainer/runs.py), unset elsewhere.
warm_progress: ContextVar[Callable[[int, int], None] | None] = ContextVar(
    "warm_progress", default=None
)


class RunCancelled(RuntimeError):
    """The run's cancel was requested while work on it was under way."""


def set_phase(  # type: ignore[no-untyped-def]
    run_id: int,
    phase: str | None,
    step: int | None = None,
    total: int | None = None,
    eta: tuple[str, float] | None = None,
):
    """Record the phase; its start time moves only when the phase itself changes. ``eta``
    (what it is the time left of, seconds) is the time left as measured now, written in the
    same transaction as the step it was measured at: readers count it down from then."""
    with session_scope() as s:
        current = s.scalar(select(Run.phase).where(Run.id == run_id))
        values: dict = {"phase": phase, "phase_step": step, "phase_total": total}
        if current != phase:
            values["phase_at"] = utcnow()
        if eta is not None:
            info = s.scalar(select(Run.info).where(Run.id == run_id).with_for_update())
            mark = {"of": eta[0], "left_s": round(eta[1], 3), "at": utcnow().isoformat()}
            values["info"] = {**(info or {}), "eta": mark}
        s.execute(update(Run).where(Run.id == run_id).values(**values))


def cancel_requested(run_id: int) -> bool:
    with session_scope() as s:
        return bool(s.scalar(select(Run.cancel_requested).where(Run.id == run_id)))


def warm_start_reporter(run_id: int) -> Callable[[int, int], None]:
    """The hook a run's warm start calls each chunk: show k of n with the time left at the
    current stage's own rate (the run's ``info["eta"]``: seconds left as of when), and stop if
    cancelled."""
    clock = WarmClock()

    def report(done: int, total: int) -> None:
        left = clock.left_s(time.monotonic(), done, total)
        set_phase(run_id, "warm_start", done, total, None if left is None else ("warm start", left))
        if cancel_requested(run_id):
            raise RunCancelled(f"run {run_id} cancelled during its warm start")

    return report


# ---- the ETA: each stage at its own measured rate, counting down within the stage ----------

WARM_JUMP = 3  # a warm start's report this many chunks past the last one: a new stage began


class WarmClock:
    """A warm start's time left, from the reports of its current stage only: the vision
    warm-up and the SFT run at different rates, and the vision stage may stop early (its loss
    reached the target), so k of n jumps; the rate restarts at each jump."""

    def __init__(self) -> None:
        self.anchor: tuple[float, int] | None = None  # (monotonic time, steps) of the stage
        self.last = 0
        self.chunk = 0

    def left_s(self, now: float, done: int, total: int) -> float | None:
        step = done - self.last
        if self.anchor is None or (self.chunk and step > WARM_JUMP * self.chunk):
            self.anchor, self.last = (now, done), done
            return None
        self.chunk = self.chunk or step
        self.last = done
        t0, d0 = self.anchor
        if done <= d0 or now <= t0:
            return None
        return (now - t0) / (done - d0) * max(0, total - done)


def evaluated_at(u: int, num_updates: int, every: int, episodes: int) -> bool:
    """Whether update ``u`` ends with a greedy evaluation (controller: after the first update,
    every N-th and the last)."""
    return bool(episodes) and (u == 0 or (u + 1) % max(every, 1) == 0 or u + 1 == num_updates)


def generating_s(metrics: dict) -> float | None:
    """Seconds an update's rollout spent generating: ``time/generate_s``, or where the policy
    service played the env steps too, ``time/stream_wait_s``; None where neither was recorded."""
    for key in ("time/generate_s", "time/stream_wait_s"):
        v = metrics.get(key)
        if isinstance(v, int | float) and v > 0:
            return float(v)
    return None


def stage_seconds(rows: list[dict], evaluated: list[dict] | None = None) -> dict[str, float] | None:
    """Mean seconds per stage of an update over recent update rows' metrics (``rows``, the
    latest first): ``rollout`` (collecting), ``train`` (the trainer), ``eval`` (a greedy
    evaluation) and ``other`` (waiting for corrections, the probe, recording).

    ``evaluated``: the run's latest evaluated updates, where ``rows`` (a few updates) may hold
    none (a run evaluated every 10th update). An evaluation costs what generating costs when it
    runs: a policy whose outputs grew to the token cap makes both its rollouts and its
    evaluations slower (measured: 3x within 3 updates). Rollouts are measured every update,
    evaluations every N-th, so each evaluation's seconds per second of its update's rollout
    generation is scaled by the latest rollout's generation seconds."""
    timed = [m for m in rows if isinstance(m.get("update_s"), int | float)]
    if not timed:
        return None

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else 0.0

    def num(m: dict, k: str) -> float:
        v = m.get(k)
        return float(v) if isinstance(v, int | float) else 0.0

    def spent(m: dict) -> float:
        return num(m, "rollout_s") + num(m, "train_s") + num(m, "eval_s")

    # The run's evaluated updates where it has them; else the rows' own (an imported run's).
    measured = [m for m in evaluated or [] if "eval_s" in m] or [m for m in timed if "eval_s" in m]
    evals = [num(m, "eval_s") for m in measured]
    plain = [m for m in timed if "eval/success_rate" not in m]
    if not evals:  # rows from before eval_s was recorded: an evaluated update's extra seconds
        with_eval = [num(m, "update_s") for m in timed if "eval/success_rate" in m]
        base = mean([num(m, "update_s") for m in plain]) if plain else 0.0
        evals = [max(0.0, s - base) for s in with_eval] if plain else []
    eval_s = mean(evals)
    now = generating_s(timed[0])
    per_generating = [num(m, "eval_s") / g for m in measured if (g := generating_s(m))]
    if now is not None and per_generating and len(per_generating) == len(measured):
        eval_s = mean(per_generating) * now
    rollout = mean([num(m, "rollout_s") for m in timed])
    train = mean([num(m, "train_s") for m in timed])
    recorded = any("eval_s" in m for m in timed)  # else an evaluated row's extra is unknown
    other = mean(
        [max(0.0, num(m, "update_s") - spent(m)) for m in (timed if recorded else plain or timed)]
    )
    return {"rollout": rollout, "train": train, "eval": eval_s, "other": other}


def _update_order(
    stages: dict[str, float], u: int, num_updates: int, every: int, episodes: int
) -> list[tuple[str, float]]:
    """The phases of update ``u`` in the order they run, each with its measured seconds (the
    evaluating phase also holds the update's other seconds: recording, the probe)."""
    finish = stages["other"] + (
        stages["eval"] if evaluated_at(u, num_updates, every, episodes) else 0.0
    )
    return [
        ("rollout", stages["rollout"]),
        ("corrections", 0.0),
        ("training", stages["train"]),
        ("evaluating", finish),
    ]


def run_left_s(
    stages: dict[str, float],
    phase: str | None,
    in_phase_s: float,
    updates_done: int,
    num_updates: int,
    every: int,
    episodes: int,
) -> float:
    """Seconds left of a run at its stages' own rates: what is left of the current stage
    (which counts down as the stage goes on), the rest of the current update, then the updates
    after it, each with its evaluation where it has one. A stage past its measured seconds
    counts as done: the sum is then a floor (``stage_over_s`` says by how much it overran)."""
    u = updates_done  # the update under way
    order = _update_order(stages, u, num_updates, every, episodes)
    names = [n for n, _ in order]
    at = names.index(phase) if phase in names else 0
    left = max(0.0, order[at][1] - in_phase_s) + sum(s for _, s in order[at + 1 :])
    per_update = stages["rollout"] + stages["train"] + stages["other"]
    for later in range(u + 1, num_updates):
        left += per_update + (
            stages["eval"] if evaluated_at(later, num_updates, every, episodes) else 0
        )
    return left


def stage_over_s(
    stages: dict[str, float],
    phase: str | None,
    in_phase_s: float,
    updates_done: int,
    num_updates: int,
    every: int,
    episodes: int,
) -> float:
    """Seconds the stage under way has run past its measured seconds (0 within them): how long
    it has left is then unknown, so the run's ETA is a floor and says so. Waiting for
    corrections has no measured seconds of its own (it is in the update's other seconds): it
    never overruns here."""
    if phase not in ("rollout", "training", "evaluating"):
        return 0.0
    usual = dict(_update_order(stages, updates_done, num_updates, every, episodes))[phase]
    return max(0.0, in_phase_s - usual)
