"""`gtr study run`: a whole study on this machine, N training processes at a time.

The parent process schedules (services/study/service.py: the tuning stage first, then which cell
next, the one retry, warm starts shared by a task's arms; the controllers run the same
scheduler) and each run, a tuning trial's too, trains in a child process of its own, as `gtr
train` would train it, logging to ``<data_dir>/studies/<id>/run-<run id>.log``; the children
are forked from a server that imported torch and the services once (``PRELOAD``). Stopping it
(Ctrl-C, or a kill) loses nothing: the next `gtr study run` of the same file resumes the study,
every unfinished run after its last trained update, and never reruns a finished one.

With a deadline (`--stop-by`), it starts only the runs it expects to finish by then (each run's
updates left times the seconds per update its task and arm took here so far, its arm's tuning
trials' before its first grid run, plus the warm start a seed's first run builds) and pauses the
study once none fits; a run still training at the deadline stops as on Ctrl-C, to resume
after its last trained update. A stopped study is `cancelled` until `gtr study run` resumes it.
A host booked until a given time, or a session that exports the study's finished runs before it
ends, stops at a run's end instead of in the middle of one.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path

from pydantic import ValidationError
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from services.study import service
from services.study.schemas import StudyConfig, tuned_task
from services.study.tuning import (
    mean_update_seconds,
    of_study,
    trial_runs,
    trial_update_seconds,
)
from shared.db.models import Run, Study, utcnow
from shared.db.session import session_scope
from shared.schemas import RunConfig
from shared.settings import get_settings

log = logging.getLogger("gtr.study")

TEAM = "default"  # the embedded default's team (gtr train launches its runs under it too)
STALE_S = 60.0  # a 'running' run whose heartbeat is older was left by a process that died
POLL_S = 1.0


# What a run imports (torch, transformers, the env, policy, trainer and corrector code): a
# fresh interpreter spends ~3-4 CPU-s on it, most of a short run's start. Each run's process is
# forked from a server that imported these once (multiprocessing's forkserver); the server only
# imports, never trains, so no torch thread pool or lock held by a running thread crosses a fork.
PRELOAD = [
    "services.controller.loop",
    "services.env",
    "services.policy.service",
    "services.trainer.runs",
    "services.corrector.service",
]


@dataclass
class Child:
    run_id: int
    proc: BaseProcess

    def exited(self) -> bool:
        return self.proc.exitcode is not None


Say = Callable[[str], None]


def open_study(cfg: StudyConfig) -> tuple[int, bool]:
    """The study of this name (resumed, its file taken if the primary metric is unchanged) or a
    new one; returns (id, whether it existed). Raises StudyRefused."""
    with session_scope() as s:
        study = service.find_study(s, cfg.name, TEAM)
        if study is None:
            return service.create_study(s, cfg, TEAM).id, False
        service.replace_spec(s, study, cfg)
        if study.status == "cancelled":
            service.resume_study(s, study)
        elif study.status in ("done", "failed"):
            study.status = "queued"  # new cells in the file run; advance says done otherwise
        # This process is the only driver of an embedded study: runs its predecessor left
        # 'running' (killed) have no driver; after STALE_S their heartbeat says so.
        service.requeue_orphans(s, study, STALE_S)
        return study.id, True


Fits = Callable[[Session, Run], bool]


def _claim(study_id: int, n: int, fits: Fits | None = None) -> list[int]:
    """Up to n queued runs of the study, marked running (compare-and-set: one driver each);
    with ``fits``, only the runs it accepts (a deadline's)."""
    if n <= 0:
        return []
    out: list[int] = []
    with session_scope() as s:
        queued = (Run.study_id == study_id) | of_study(study_id), Run.status == "queued"
        if fits is None:
            ids = s.scalars(select(Run.id).where(*queued).order_by(Run.id).limit(n)).all()
        else:
            runs = s.scalars(select(Run).where(*queued).order_by(Run.id)).all()
            ids = [r.id for r in runs if fits(s, r)][:n]
        for run_id in ids:
            claimed = s.execute(  # type: ignore[attr-defined]
                update(Run)
                .where(Run.id == run_id, Run.status == "queued")
                .values(status="running", heartbeat_at=utcnow())
            ).rowcount
            if claimed:
                out.append(int(run_id))
    return out


def _forkserver() -> ForkServerContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: this process's first run
    return ctx


def _spawn(study_id: int, run_id: int, threads: int) -> Child:
    folder = log_folder(study_id)
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("GTR_TORCH_THREADS", str(threads))
    log_path = str(folder / f"run-{run_id}.log")
    proc = _forkserver().Process(
        target=child_main, args=(run_id, log_path, env), name=f"gtr-run-{run_id}"
    )
    proc.start()
    return Child(run_id, proc)


def _reap(child: Child, say: Say) -> None:
    """A child that exited: a run it left 'running' (it crashed) is failed, with the reason."""
    code = child.proc.exitcode
    with session_scope() as s:
        run = s.get(Run, child.run_id)
        if run is None:
            return
        if run.status == "running":
            run.status, run.finished_at = "failed", utcnow()
            run.error = f"its training process exited with code {code} (see its log)"
        say(_line(run))
        if run.status == "completed" and (odd := service.other_starts(s, run)):
            say(split_start_line(run, odd))


def split_start_line(run: Run, odd: list[Run]) -> str:
    """What to do when a seed's runs started from different weights: this run started from the
    warm start the cache holds now (the next runs of the seed will too), so the others retrain."""
    ids = " ".join(str(r.id) for r in odd)
    return (
        f"run {run.id} started from other weights than run{'s' if len(odd) > 1 else ''} {ids} "
        f"of {run.study_task} seed {run.study_seed} (a warm start rebuilt differently): to "
        f'compare like for like, `gtr study rerun {run.study_id} {ids} --why "another start '
        f"than seed {run.study_seed}'s\"` trains them again from this one"
    )


def cell_text(run: Run) -> str:
    """'ezpoints / gtr / acc-1.0 seed 5': a study run's cell, as the terminal shows it (a
    tuning run: 'tuning gtr trial 1 seed 100')."""
    if run.study_id is None and (t := (run.info or {}).get("tuning")):
        return f"tuning {t['arm']} trial {t['trial']} seed {run.config.get('seed')}"
    cell = " / ".join(x for x in (run.study_task, run.study_arm, run.study_variant) if x)
    return f"{cell} seed {run.study_seed}"


def _line(run: Run) -> str:
    # A later attempt is a retry after a failure or a rerun after `gtr study rerun`.
    attempt = f" (attempt {run.study_attempt})" if (run.study_attempt or 1) > 1 else ""
    end = f": {run.error}" if run.status == "failed" and run.error else ""
    return f"run {run.id} {cell_text(run)}{attempt}: {run.status}{end}"


def _release(children: list[Child]) -> None:
    """Ctrl-C: stop the children, put their runs back in the queue for the next invocation."""
    for c in children:
        if not c.exited():
            c.proc.terminate()
    for c in children:
        c.proc.join(timeout=30)
        if not c.exited():
            c.proc.kill()
            c.proc.join()
    with session_scope() as s:
        s.execute(
            update(Run)
            .where(Run.id.in_([c.run_id for c in children]), Run.status == "running")
            .values(status="queued")
        )


class Paused(Exception):
    """The study stopped for its deadline with cells left; the message says what is left."""

    def __init__(self, study_id: int, message: str) -> None:
        super().__init__(message)
        self.study_id = study_id


def run_study(
    cfg: StudyConfig, jobs: int, say: Say = print, deadline: datetime | None = None
) -> int:
    """Run (or resume) the study to its end with ``jobs`` training processes; its id. With a
    ``deadline`` (aware), start only runs expected to finish by then; raises Paused when none
    does, or when the deadline comes with runs in flight (stopped, to resume)."""
    study_id, existed = open_study(cfg)
    fits: Fits | None = None
    too_long: list[str] = []  # why the last queued runs were not started (the deadline)
    memo = Estimates()  # what the deadline's estimates read from the store, this poll
    if deadline is not None:

        def fits(s: Session, run: Run) -> bool:
            need = seconds_needed(s, run, memo)
            left = (deadline - utcnow()).total_seconds()
            if need is not None and need > left:
                too_long.append(f"{cell_text(run)} needs about {duration_text(need)}")
                return False
            return left > 0

    with session_scope() as s:  # the runs in flight at once here: what the study's ETA divides by
        study = s.get(Study, study_id)
        assert study is not None
        study.concurrency = jobs
    say(f"study {study_id}: {cfg.name} ({'resumed' if existed else 'new'}), {_size(cfg)}")
    threads = max(1, (os.cpu_count() or 1) // jobs)
    children: list[Child] = []
    unreadable: str | None = None  # why this runner cannot go on with the study, once it cannot
    done, status = False, ""
    # A kill (SIGTERM) stops it as Ctrl-C does: the children's runs go back to the queue.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        while True:
            for c in [c for c in children if c.exited()]:
                children.remove(c)
                _reap(c, say)
            if unreadable is None:
                unreadable = _skew()
                if unreadable is not None:
                    say(
                        f"study {study_id}: {unreadable}; no new run starts, "
                        f"{len(children)} running finish"
                    )
                    continue
                try:
                    with session_scope() as s:
                        study = s.get(Study, study_id)
                        assert study is not None
                        # Under a deadline, the runs queued that did not fit stay queued and
                        # the next cells are queued beside them: a shorter run may fit.
                        limit = jobs + len(too_long)
                        queued = service.advance(s, study, limit=limit, say=say)
                        done, status = service.finished(study), study.status
                except ValidationError as e:
                    # Another process stored a study file this version cannot read (a newer
                    # version's): start nothing more, let the runs in flight finish.
                    unreadable = f"its stored file no longer validates here ({_first_error(e)})"
                    say(
                        f"study {study_id}: {unreadable}; no new run starts, "
                        f"{len(children)} running finish"
                    )
                    continue
                for run in queued:
                    log.info("study %s queued run %s", study_id, run.id)
                too_long.clear()
                memo.clear()
                for run_id in _claim(study_id, jobs - len(children), fits):
                    children.append(_spawn(study_id, run_id, threads))
                    say(_started(run_id))
                # Paused only once no cell is left to try: nothing new was queued though the
                # limit made room for one beside every run that did not fit.
                tried = not queued and limit >= jobs + len(too_long)
                if deadline is not None and (tried or not too_long):
                    _check_deadline(study_id, deadline, children, too_long, done)
            if unreadable is not None and not children:
                raise StudyUnreadable(
                    f"study {study_id} stopped: {unreadable}; go on with `gtr study run` from "
                    "the newer version"
                )
            if done and not children:
                say(f"study {study_id} {status}")
                return study_id
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        _release(children)
        _stopped(study_id)
        say(f"study {study_id} interrupted: `gtr study run` of the same file resumes it")
        raise
    except (Paused, StudyUnreadable):
        raise  # the deadline stopped the children already; the unreadable store has none
    except BaseException:
        # Any other way out (the store gone, a bug): the runs stop and go back to the queue,
        # rather than train on with no scheduler while this process waits for them at exit.
        _release(children)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check_deadline(
    study_id: int, deadline: datetime, children: list[Child], too_long: list[str], done: bool
) -> None:
    """Pause the study (raise Paused) once its deadline has come, or once nothing runs and the
    next queued run would not finish by it."""
    left = (deadline - utcnow()).total_seconds()
    if left <= 0 and children:
        _release(children)
        _stopped(study_id)
        ids = ", ".join(str(c.run_id) for c in children)
        raise Paused(
            study_id,
            f"study {study_id} paused at its deadline: run{'s' if len(children) > 1 else ''} "
            f"{ids} stopped and resume after their last trained update; "
            "`gtr study run` of the same file goes on",
        )
    if children or done or (left > 0 and not too_long):
        return  # still training, finished, or between two steps of the schedule
    _stopped(study_id)
    why = too_long[0] if too_long else "the deadline has passed"
    raise Paused(
        study_id,
        f"study {study_id} paused before its deadline ({duration_text(max(0.0, left))} left): "
        f"{why}; `gtr study run` of the same file goes on",
    )


def _stopped(study_id: int) -> None:
    """Nothing drives the study any more: its status says so (`cancelled`, as `gtr study cancel`
    and an import leave a study), so that its page and report do not show it running with an
    ETA, and no controller on the same store takes it up. `gtr study run` resumes it."""
    with session_scope() as s:
        study = s.get(Study, study_id)
        if study is not None and study.status in service.ACTIVE:
            service.cancel_study(s, study)


class Estimates:
    """What `--stop-by` reads from the store once a poll, not once a queued run: each task and
    arm's seconds per update, and each study's warm starts (which exist, what one costs)."""

    def __init__(self) -> None:
        self.per_update: dict[tuple, float | None] = {}
        self.warm: dict[tuple, tuple[set[str], float]] = {}

    def clear(self) -> None:
        self.per_update.clear()
        self.warm.clear()


def seconds_needed(session: Session, run: Run, memo: Estimates | None = None) -> float | None:
    """About how long ``run`` takes to finish on this host: its updates left times the mean
    seconds per update (each update's stored ``update_s``, its evaluations included) of the
    study's runs of the same task and arm (a trial: of its tuning arm), itself included; for an
    arm's first grid run, of its tuning trials on the task (here, or as their bundle carried
    it); plus the warm start it must build before its first update (``warm_start_seconds``).
    None before any of them has trained an update."""
    trial = (run.info or {}).get("tuning")
    key = (run.study_id, run.study_task, run.study_arm, str(trial and trial.get("arm")))
    memo = Estimates() if memo is None else memo
    if key not in memo.per_update:
        memo.per_update[key] = _seconds_per_update(session, run, trial)
    per_update = memo.per_update[key]
    if per_update is None:
        return None
    left = per_update * max(0, run.num_updates - (run.updates_done or 0))
    return left + warm_start_seconds(session, run, memo)


def _seconds_per_update(session: Session, run: Run, trial: object) -> float | None:
    if run.study_id is not None:
        same = select(Run.id).where(
            Run.study_id == run.study_id,
            Run.study_task == run.study_task,
            Run.study_arm == run.study_arm,
        )
        if (seconds := mean_update_seconds(session, same)) is not None:
            return seconds
        # The arm's first grid run: its tuning trials' seconds per update on the task (a
        # trial's settings differ from the choice, its updates do the same work), rather than
        # no estimate, which starts a run of an hour minutes before the deadline. Their runs
        # may have run in another store: then their bundle carried the figure.
        study = session.get(Study, run.study_id)
        cfg = service.config_of(study) if study is not None else None
        if cfg is not None and cfg.tuning is not None and run.study_task == tuned_task(cfg):
            per_trial = trial_update_seconds(session, cfg, run.study_id, str(run.study_arm))
            if per_trial:
                return sum(per_trial.values()) / len(per_trial)
        return None
    if isinstance(trial, dict):  # a tuning trial: the trials of its arm
        ids = [r.id for r in trial_runs(session, trial["study_id"], trial["arm"])]
        return mean_update_seconds(session, select(Run.id).where(Run.id.in_(ids)))
    return None


def warm_start_seconds(session: Session, run: Run, memo: Estimates | None = None) -> float:
    """The warm start ``run`` builds before its first update: the mean time its study's warm
    starts of the same task took to build (each run records it, ``built_seconds``), when no run
    of the study or of its tuning stage has one of its warm group yet (a sibling's is reused
    from the cache). 0 for a run that has trained an update, has no cached warm start, or when
    no warm start of the task has been timed yet. A warm start another study left in the cache
    is not seen: the estimate errs long, by one warm start."""
    if run.updates_done:
        return 0.0
    group = service.warm_group(RunConfig.model_validate(run.config))
    trial = (run.info or {}).get("tuning")
    study_id = run.study_id if run.study_id is not None else trial and trial.get("study_id")
    if group is None or study_id is None:
        return 0.0
    memo = Estimates() if memo is None else memo
    task = run.config.get("task")
    if (study_id, task) not in memo.warm:
        memo.warm[(study_id, task)] = _warm_starts(session, int(study_id), task)
    built, seconds = memo.warm[(study_id, task)]
    return 0.0 if group in built else seconds


def _warm_starts(session: Session, study_id: int, task: object) -> tuple[set[str], float]:
    """The warm groups of the study's (and its tuning stage's) runs of ``task`` that have a
    warm start, and the mean seconds one took to build (0 when none has been timed)."""
    runs = [*session.scalars(select(Run).where(Run.study_id == study_id))]
    runs += trial_runs(session, study_id)
    built: set[str] = set()
    timed: dict[str, float] = {}  # warm-start key -> its build seconds, each counted once
    for r in runs:
        warm = (r.info or {}).get("warm_start")
        if r.config.get("task") != task or not isinstance(warm, dict):
            continue
        group = service.warm_group(RunConfig.model_validate(r.config))
        if group is not None:
            built.add(group)
        if isinstance(warm.get("built_seconds"), int | float) and warm.get("key"):
            timed[str(warm["key"])] = float(warm["built_seconds"])
    return built, (sum(timed.values()) / len(timed) if timed else 0.0)


def duration_text(seconds: float) -> str:
    """'1 h 05 min', '12 min', '40 s'."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


# How far ahead a clock time already past today may point (to tomorrow's): far enough for an
# evening session's deadline after midnight, short enough that a mistyped hour is refused
# rather than read as nearly a day of training.
CLOCK_AHEAD = timedelta(hours=12)

_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")


def parse_deadline(when: str, now: datetime | None = None) -> datetime:
    """`--stop-by`'s WHEN as an aware time: a duration from now ('90m', '2h', '1h30m', '45s'), a
    clock time on this host ('18:40': the next time the clock shows it, so '00:30' at 22:30
    is tonight's, but only within `CLOCK_AHEAD`: '11:00' at noon is a slip, not tomorrow's),
    or an ISO 8601 date-time ('2026-12-06T18:40', this host's time zone unless it gives one).
    ValueError, in words, for anything else or a time already past."""
    now = now or datetime.now(UTC)
    text = when.strip().lower().replace(" ", "")
    if (m := _DURATION.fullmatch(text)) and any(m.groups()):
        h, mins, secs = (int(g or 0) for g in m.groups())
        if not h + mins + secs:
            raise ValueError(f"{when!r} is no time at all: give a duration above 0")
        return now + timedelta(hours=h, minutes=mins, seconds=secs)
    local = now.astimezone()
    try:
        if clock := re.fullmatch(r"\d{1,2}:\d{2}", text):
            hour, minute = (int(x) for x in text.split(":"))
            at = local.replace(hour=hour, minute=minute, second=0, microsecond=0)
            if at <= now and at + timedelta(days=1) - now <= CLOCK_AHEAD:
                at += timedelta(days=1)  # a deadline across midnight
        else:
            at = datetime.fromisoformat(when.strip())
            at = at if at.tzinfo else at.replace(tzinfo=local.tzinfo)
    except ValueError:
        raise ValueError(
            f"{when!r} is not a time: give a duration (90m, 2h, 1h30m), a clock time "
            "(18:40) or a date-time (2026-12-06T18:40)"
        ) from None
    if at <= now:
        later = " (for tomorrow's, give its date-time)" if clock else ""
        raise ValueError(f"{when!r} is already past (it is {local:%Y-%m-%d %H:%M} here){later}")
    return at


class StudyUnreadable(RuntimeError):
    """The study's stored file or the store's schema is a newer version's (version skew)."""


def _skew() -> str | None:
    """Why this version must not start another run in the store: a newer gtr-lab migrated it
    (its children would stop inside alembic, or write rows without the newer columns)."""
    from shared.db.migrate import unknown_revisions

    ahead = unknown_revisions()
    if ahead:
        return f"the database was migrated by a newer version (schema revision {ahead[0]})"
    return None


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"]) or "file"
    return f"{where}: {err['msg']}"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _size(cfg: StudyConfig) -> str:
    n = len(cfg.cells())
    steps = sum(cfg.run_config(c).total_env_steps for c in cfg.cells())
    return f"{n} runs, {steps:,} env steps, primary {cfg.primary.label()}"


def _started(run_id: int) -> str:
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run is not None
        line = _line(run).rsplit(":", 1)[0]
    return f"{line}: started"


def child_main(run_id: int, log_path: str, env: dict[str, str]) -> None:
    """A run's process, forked by the forkserver: the study runner's environment (the server
    kept the one it started with), stdout and stderr into the run's log, then the run driven as
    `gtr train` drives it; exit 0 when it completed."""
    from services.controller.loop import drive
    from shared.db.session import get_engine
    from shared.logs import setup_logging

    os.environ.clear()
    os.environ.update(env)
    get_settings.cache_clear()  # nothing the server imported may have read the old variables
    get_engine.cache_clear()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    setup_logging()
    sys.exit(0 if drive(run_id) == "completed" else 1)


def log_folder(study_id: int) -> Path:
    return get_settings().data_dir / "studies" / str(study_id)
