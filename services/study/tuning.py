"""A study's declared tuning stage: each arm's settings searched on tuning seeds before the grid.

The study file's `[tuning]` section names, per arm, the knobs to search (each a run-config
field: `KNOBS`), their ranges or choices, a trial budget, the tuning seeds (disjoint from every
evaluation seed), the selection metric and the rule, all validated before any run.

The stage is a state machine polled by the study's scheduler (`service.advance`: every poll of
`gtr controller` on the full stack, every second of `gtr study run` embedded), so it needs no
process of its own and survives one killed. Each poll, per tuned arm: a running trial whose runs
are missing gets them (one per tuning seed, queued, `info.tuning` naming study, arm and trial,
no grid cell), so any controller trains them; its running score (the mean over its runs of each
one's selection score so far) is reported to Optuna at every evaluation all its runs reached,
and when the pruner (median or successive halving) says stop, its runs are cancelled (queued
ones here, running ones through their cancel flag); once they all ended Optuna is told
(complete with the score, pruned, or failed). With no trial running and fewer than the budget
counted, Optuna is asked for the next. When every arm has its choice (the rule over completed
trials) the grid starts, each arm's overlay carrying its selected settings; a finished stage is
never tuned again.

Optuna's storage (`storage`): on PostgreSQL the platform's own database, Optuna's tables in
their own schema (`optuna`, created if missing; the engine's search_path points there), since
Optuna's `studies` and `alembic_version` tables would collide with ours in the default schema.
On the embedded SQLite default, a file beside the store (`tuning.sqlite3`): SQLite has no
schemas, and attaching a second database per connection would buy nothing over a file. Optuna
commits on its own connection: every step above is written so that a poll whose transaction
rolls back is repaired by the next (missing runs queued again, a decided stop applied again).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field
from sqlalchemy import ColumnElement, Select, select
from sqlalchemy.orm import Session

from services.controller.launch import queued_run
from services.study.schemas import (
    Cell,
    KnobSpec,
    MetricSpec,
    StudyConfig,
    _nested,
    merge,
    trial_config,
    tuned_task,
)
from shared.db.models import Run, Study, Update, utcnow

if TYPE_CHECKING:
    import optuna

log = logging.getLogger("gtr.study")

Say = Callable[[str], None]
SCHEMA = "optuna"  # Optuna's tables on PostgreSQL
SQLITE_FILE = "tuning.sqlite3"  # Optuna's tables beside an embedded SQLite store


def apply_selection(cfg: StudyConfig, selected: dict[str, dict[str, Any]]) -> StudyConfig:
    """The study with each tuned arm's overlay carrying its selected settings."""
    arms = {a: merge(o, _nested(selected.get(a, {}))) for a, o in cfg.arms.items()}
    return cfg.model_copy(update={"arms": arms})


def plan_lines(cfg: StudyConfig) -> tuple[list[str], int]:
    """`gtr study plan`'s lines for the tuning stage, and its env steps at most (no pruning)."""
    t = cfg.tuning
    if t is None:
        return [], 0
    steps = 0
    lines = [
        f"tuning on task {tuned_task(cfg)}, seeds {', '.join(map(str, t.seeds))} (none an "
        f"evaluation seed), selection {t.selection(cfg.primary).label()}, rule {t.rule}, "
        f"sampler {t.sampler}, pruner {t.pruner}:"
    ]
    for arm, knobs in t.arms.items():
        per_run = trial_config(cfg, arm, t.seeds[0], {}, 0).total_env_steps
        steps += per_run * t.trials * len(t.seeds)
        space = "; ".join(f"{k} {_space_text(s)}" for k, s in knobs.items())
        lines.append(
            f"  {arm}: {t.trials} trials x {len(t.seeds)} seed(s), {per_run:,} env steps a "
            f"run; {space}"
        )
    lines.append(f"  tuning at most {steps:,} env steps (the pruner stops hopeless trials early)")
    return lines, steps


def _space_text(s: KnobSpec) -> str:
    if s.choices is not None:
        return "{" + ", ".join(str(c) for c in s.choices) + "}"
    return f"[{s.low:g}, {s.high:g}]{' log' if s.log else ''}"


# --- the stage: a state machine over Optuna and the platform's runs -------------------------


def storage() -> optuna.storages.RDBStorage:
    """Optuna's storage for this store: see the module doc."""
    from shared.settings import get_settings

    return _storage(get_settings().db_url)


@functools.cache
def _storage(db_url: str) -> optuna.storages.RDBStorage:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if db_url.startswith("sqlite"):
        path = db_url.removeprefix("sqlite:///")
        from shared.settings import get_settings

        folder = Path(path).parent if path and path != ":memory:" else get_settings().data_dir
        folder.mkdir(parents=True, exist_ok=True)
        return optuna.storages.RDBStorage(f"sqlite:///{(folder / SQLITE_FILE).resolve()}")
    from sqlalchemy import text
    from sqlalchemy.exc import DBAPIError

    from shared.db.session import get_engine

    for attempt in range(3):  # two processes creating the schema or its tables at once: retry
        try:
            with get_engine(db_url).begin() as conn:
                conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
            return optuna.storages.RDBStorage(
                db_url,
                engine_kwargs={
                    "pool_pre_ping": True,
                    "connect_args": {"options": f"-c search_path={SCHEMA}"},
                },
            )
        except DBAPIError:
            if attempt == 2:
                raise
            time.sleep(0.5 + attempt)
    raise AssertionError("unreachable")


def _optuna_study(
    cfg: StudyConfig,
    study_id: int,
    arm: str,
    create: bool,
    db_url: str | None = None,
    enqueue: bool = True,
) -> optuna.Study | None:
    """The arm's Optuna study in the storage of ``db_url`` (default: the settings' store);
    created with the grid's points enqueued unless ``enqueue`` is false (a carried stage
    enqueues only the points its trials did not finish: tuning_carry.py)."""
    import optuna

    store = _storage(db_url) if db_url else storage()
    t = cfg.tuning
    assert t is not None
    name = f"gtr-study-{study_id}/{arm}"
    if not create:
        try:
            return optuna.load_study(study_name=name, storage=store)
        except KeyError:
            return None
    sampler = optuna.samplers.TPESampler(seed=t.sampler_seed)
    pruner: optuna.pruners.BasePruner = {
        "median": lambda: optuna.pruners.MedianPruner(
            n_startup_trials=t.startup_trials, n_warmup_steps=t.warmup
        ),
        "halving": lambda: optuna.pruners.SuccessiveHalvingPruner(),
        "none": lambda: optuna.pruners.NopPruner(),
    }[t.pruner]()
    higher = t.selection(cfg.primary).higher_is_better
    study = optuna.create_study(
        storage=store,
        study_name=name,
        direction="maximize" if higher else "minimize",
        sampler=sampler,
        pruner=pruner,
        load_if_exists=True,
    )
    if enqueue and t.sampler == "grid" and not study.user_attrs.get("grid_enqueued"):
        # The grid as enqueued trials, in order (Optuna's GridSampler stops the study when
        # exhausted, which ask-and-tell does not allow); trials past the grid: TPE.
        for point in grid_points(t.arms[arm]):
            study.enqueue_trial(point)
        study.set_user_attr("grid_enqueued", True)
    return study


def grid_points(knobs: dict[str, KnobSpec]) -> list[dict[str, Any]]:
    """The grid sampler's points, in order: every combination of the knobs' choices."""
    names = list(knobs)
    return [
        dict(zip(names, values, strict=True))
        for values in itertools.product(*(knobs[k].choices or [] for k in names))
    ]


def distribution(knob: str, s: KnobSpec) -> optuna.distributions.BaseDistribution:
    """The knob's search space as Optuna's distribution (what ``_suggest`` asks for)."""
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    if s.choices is not None:
        return CategoricalDistribution(s.choices)
    assert s.low is not None and s.high is not None
    if knob == "sft_epochs":
        return IntDistribution(int(s.low), int(s.high), log=s.log)
    return FloatDistribution(s.low, s.high, log=s.log)


def _suggest(trial: optuna.Trial, knob: str, s: KnobSpec) -> Any:
    if s.choices is not None:
        return trial.suggest_categorical(knob, s.choices)
    assert s.low is not None and s.high is not None
    if knob == "sft_epochs":
        return trial.suggest_int(knob, int(s.low), int(s.high), log=s.log)
    return trial.suggest_float(knob, s.low, s.high, log=s.log)


_SELECTED: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}  # a finished stage's choices


def advance(session: Session, study: Study, cfg: StudyConfig, say: Say | None = None) -> Stage:
    """One poll of the study's tuning stage (see the module doc); never commits. Its `selected`
    is each tuned arm's choice once every arm has one (an arm none of whose trials completed
    keeps its own settings: {}), None while the stage runs."""
    from optuna.trial import TrialState

    say = say or _log
    t = cfg.tuning
    if t is None:
        return Stage({}, [])
    url = session.get_bind().engine.url.render_as_string(hide_password=False)
    key = (url, study.id)
    if key in _SELECTED:
        return Stage(_SELECTED[key], [])
    selected: dict[str, dict[str, Any]] = {}
    queued: list[Run] = []
    busy = False
    for arm, knobs in t.arms.items():
        ostudy = _optuna_study(cfg, study.id, arm, create=True, db_url=url)
        assert ostudy is not None
        chosen = ostudy.user_attrs.get("selected")
        if chosen is not None:
            selected[arm] = dict(chosen["params"] or {})
            continue
        running = ostudy.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        for tr in running:
            queued += _step(session, study, cfg, arm, ostudy, tr, say)
        if ostudy.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            busy = True
        elif _counted(ostudy) < t.trials:
            trial = ostudy.ask()
            params = {k: _suggest(trial, k, s) for k, s in knobs.items()}
            queued += _queue(session, study, cfg, arm, ostudy, trial.number, params, say)
            busy = True
        else:
            best = choose(ostudy)
            chosen = {"trial": best.number, "params": best.params} if best else {"trial": None}
            ostudy.set_user_attr("selected", {"params": {}, **chosen})
            selected[arm] = dict(chosen.get("params") or {})
            say(
                f"tuning {arm}: selected trial {best.number} {best.params} (score {best.value:.4g})"
                if best
                else f"tuning {arm}: no trial completed; the arm keeps its own settings"
            )
    if busy:
        return Stage(None, queued)
    _SELECTED[key] = selected
    return Stage(selected, queued)


@dataclass
class Stage:
    selected: dict[str, dict[str, Any]] | None  # None: still tuning
    queued: list[Run]  # the trial runs this poll queued


def tuning_cells(cfg: StudyConfig, arms: list[str] | None = None) -> list[Cell]:
    """The tuning stage's runs as cells (the tuned task, no variant, a tuning seed): what their
    warm starts depend on, as a grid cell's (``trial_config`` builds on ``run_config``)."""
    t = cfg.tuning
    if t is None:
        return []
    return [
        Cell(tuned_task(cfg), a, s) for a in (t.arms if arms is None else arms) for s in t.seeds
    ]


def unfinished_arms(cfg: StudyConfig, study_id: int) -> list[str]:
    """The tuned arms with no choice yet in this store (their stage not begun counts)."""
    if cfg.tuning is None:
        return []
    out = []
    for arm in cfg.tuning.arms:
        ostudy = _optuna_study(cfg, study_id, arm, create=False)
        if ostudy is None or ostudy.user_attrs.get("selected") is None:
            out.append(arm)
    return out


def of_study(study_id: int) -> ColumnElement[bool]:
    """The SQL condition for a run of the study's tuning stage."""
    return Run.study_id.is_(None) & (Run.info[("tuning", "study_id")].as_integer() == study_id)


def trial_runs(session: Session, study_id: int, arm: str | None = None) -> list[Run]:
    """The study's trial runs (all, or one arm's): runs of no grid cell, tagged in info."""
    query = select(Run).where(of_study(study_id)).order_by(Run.id)
    runs = list(session.scalars(query))
    return [r for r in runs if arm is None or r.info["tuning"].get("arm") == arm]


def trial_update_seconds(
    session: Session, cfg: StudyConfig, study_id: int, arm: str
) -> dict[int, float]:
    """Trial number -> the mean seconds per update (evaluations included) of its runs: their
    stored ``update_s`` where they ran in this store, else the figure its bundle carried (a
    carried trial's runs stay where they ran). What `--stop-by` estimates the arm's first grid
    run from; a trial with neither is left out."""
    out: dict[int, float] = {}
    ostudy = _optuna_study(cfg, study_id, arm, create=False)
    if ostudy is not None:
        for tr in ostudy.get_trials(deepcopy=False):
            carried = tr.user_attrs.get("update_s")
            if isinstance(carried, int | float):
                out[tr.number] = float(carried)
    by_trial: dict[int, list[int]] = {}
    for run in trial_runs(session, study_id, arm):
        by_trial.setdefault(int(run.info["tuning"]["trial"]), []).append(run.id)
    for number, ids in by_trial.items():
        seconds = mean_update_seconds(session, select(Run.id).where(Run.id.in_(ids)))
        if seconds is not None:
            out[number] = seconds
    return out


def mean_update_seconds(session: Session, runs: Select[int]) -> float | None:
    """The mean ``update_s`` over every stored update of ``runs``; None when none has one."""
    seconds = [
        m["update_s"]
        for m in session.scalars(select(Update.metrics).where(Update.run_id.in_(runs)))
        if isinstance(m, dict) and isinstance(m.get("update_s"), int | float)
    ]
    return sum(seconds) / len(seconds) if seconds else None


def _queue(
    session: Session,
    study: Study,
    cfg: StudyConfig,
    arm: str,
    ostudy: optuna.Study,
    number: int,
    params: dict[str, Any],
    say: Say,
) -> list[Run]:
    """The trial's runs, one per tuning seed, queued for any controller (or the runner)."""
    from optuna.trial import TrialState

    t = cfg.tuning
    assert t is not None
    runs = []
    for seed in t.seeds:
        try:
            rc = trial_config(cfg, arm, seed, params, number)
        except ValueError as e:  # a knob value no run config takes: the trial fails, once
            _attr(ostudy, number, "error", str(e))
            ostudy.tell(number, state=TrialState.FAIL)
            say(f"tuning {arm} trial {number}: failed ({e})")
            return []
        tag = {"tuning": {"study_id": study.id, "arm": arm, "trial": number}}
        run = queued_run(rc, study.team, info=tag)
        session.add(run)
        runs.append(run)
    session.flush()
    say(f"tuning {arm} trial {number} {params}: runs {', '.join(str(r.id) for r in runs)}")
    return runs


def _step(
    session: Session,
    study: Study,
    cfg: StudyConfig,
    arm: str,
    ostudy: optuna.Study,
    tr: optuna.trial.FrozenTrial,
    say: Say,
) -> list[Run]:
    """A running trial: queue its runs if none exist (a poll that asked for it did not
    commit), report its running score at each evaluation all its runs reached, stop its runs
    when the pruner says so, requeue runs a cancelled study left, tell Optuna when they end."""
    import optuna
    from optuna.trial import TrialState

    t = cfg.tuning
    assert t is not None
    runs = [r for r in trial_runs(session, study.id, arm) if r.info["tuning"]["trial"] == tr.number]
    if not runs:
        return _queue(session, study, cfg, arm, ostudy, tr.number, dict(tr.params), say)
    ids = [r.id for r in runs]
    if tr.user_attrs.get("runs") != ids:
        _attr(ostudy, tr.number, "runs", ids)
    metric = t.selection(cfg.primary)
    stopped = tr.user_attrs.get("stopped_at")
    if stopped is None:
        trial = optuna.trial.Trial(ostudy, tr._trial_id)
        for step, value in _running_scores(_curves(session, ids, metric.metric), metric, len(ids)):
            if step in tr.intermediate_values:
                continue
            trial.report(value, step)
            if trial.should_prune():
                stopped = step
                trial.set_user_attr("stopped_at", step)
                break
    now = utcnow()
    for run in runs:
        if stopped is not None and run.status == "queued":
            run.status, run.finished_at, run.cancel_requested = "cancelled", now, True
        elif stopped is not None and run.status == "running":
            run.cancel_requested = True
        elif stopped is None and run.status == "cancelled":
            # Only a cancelled study stops a trial's runs otherwise: it was resumed.
            run.status, run.finished_at, run.cancel_requested = "queued", None, False
    if any(r.status in ("queued", "running") for r in runs):
        return []
    head = f"tuning {arm} trial {tr.number}"
    if stopped is not None:
        ostudy.tell(tr.number, state=TrialState.PRUNED)
        say(f"{head}: pruned at update {stopped}")
        return []
    scores = [metric.score(c) for c in _curves(session, ids, metric.metric).values()]
    if any(r.status != "completed" for r in runs) or any(v is None for v in scores):
        error = f"runs ended {', '.join(r.status for r in runs)}"
        _attr(ostudy, tr.number, "error", error)
        ostudy.tell(tr.number, state=TrialState.FAIL)
        say(f"{head}: failed ({error})")
        return []
    value = sum(v for v in scores if v is not None) / len(scores)
    ostudy.tell(tr.number, value)
    say(f"{head}: score {value:.4g}")
    return []


def _log(line: str) -> None:
    log.info("%s", line)


def _attr(ostudy: optuna.Study, number: int, key: str, value: Any) -> None:
    trial_id = ostudy._storage.get_trial_id_from_study_id_trial_number(ostudy._study_id, number)
    ostudy._storage.set_trial_user_attr(trial_id, key, value)


def _counted(study: optuna.Study) -> int:
    from optuna.trial import TrialState

    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return len(study.get_trials(deepcopy=False, states=done))


def choose(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """Rule 'best': the completed trial with the best value, the earlier on a tie."""
    from optuna.study import StudyDirection
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not done:
        return None
    sign = 1.0 if study.direction == StudyDirection.MAXIMIZE else -1.0
    return max(done, key=lambda tr: (sign * float(tr.value or 0.0), -tr.number))


def _curves(session: Session, ids: list[int], metric: str) -> dict[int, list[tuple[int, float]]]:
    out: dict[int, list[tuple[int, float]]] = {i: [] for i in ids}
    rows = session.execute(
        select(Update.run_id, Update.idx, Update.metrics)
        .where(Update.run_id.in_(ids))
        .order_by(Update.idx)
    )
    for run_id, idx, metrics in rows:
        value = (metrics or {}).get(metric)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[run_id].append((idx, float(value)))
    return out


def _running_scores(
    curves: dict[int, list[tuple[int, float]]], metric: MetricSpec, n: int
) -> list[tuple[int, float]]:
    """(update, the mean over the trial's runs of each one's score so far) at every evaluated
    update all its runs reached."""
    if len(curves) < n or any(not c for c in curves.values()):
        return []
    steps = sorted(set.intersection(*(set(u for u, _ in c) for c in curves.values())))
    out = []
    for step in steps:
        scores = [metric.score([p for p in c if p[0] <= step]) for c in curves.values()]
        if all(v is not None for v in scores):
            out.append((step, sum(v for v in scores if v is not None) / n))
    return out


# --- the record, for the report -----------------------------------------------------------


class TrialOut(BaseModel):
    number: int = Field(description="Optuna's trial number, per arm")
    params: dict[str, Any] = Field(description="The trial's settings (knob -> value)")
    state: str = Field(description="complete, pruned, fail or running")
    score: float | None = Field(description="Its selection score (complete trials)")
    stopped_at: int | None = Field(description="The update where the pruner stopped it")
    last_update: int | None = Field(description="The last update it reported")
    runs: list[int] = Field(default_factory=list, description="Its runs (one per tuning seed)")


class ArmTuning(BaseModel):
    arm: str
    task: str
    metric: str = Field(description="The selection metric's label")
    trials: list[TrialOut]
    selected: dict[str, Any] | None = Field(description="The chosen settings; None: none yet")
    selected_trial: int | None
    edges: list[str] = Field(
        default_factory=list,
        description="The chosen settings that sit at an end of a searched grid of 3 or more "
        "values, in words: the arm's best may lie beyond what was searched",
    )


def tuning_report(spec: StudyConfig | None, study_id: int) -> list[ArmTuning]:
    """Every trial of the study's tuning stage and the choice per arm, from Optuna's storage."""
    if spec is None or spec.tuning is None:
        return []
    out = []
    for arm in spec.tuning.arms:
        study = _optuna_study(spec, study_id, arm, create=False)
        trials = study.get_trials(deepcopy=False) if study is not None else []
        chosen = (study.user_attrs.get("selected") if study is not None else None) or {}
        out.append(
            ArmTuning(
                arm=arm,
                task=tuned_task(spec),
                metric=spec.tuning.selection(spec.primary).label(),
                trials=[
                    TrialOut(
                        number=tr.number,
                        # a grid point enqueued but not yet asked holds its settings as
                        # Optuna's fixed_params until a trial runs it
                        params=dict(tr.params or tr.system_attrs.get("fixed_params") or {}),
                        state=tr.state.name.lower(),
                        score=tr.value if tr.state.name == "COMPLETE" else None,
                        stopped_at=tr.user_attrs.get("stopped_at"),
                        last_update=tr.last_step,
                        runs=list(tr.user_attrs.get("runs") or []),
                    )
                    for tr in trials
                ],
                selected=chosen.get("params"),
                selected_trial=chosen.get("trial"),
                edges=grid_edges(spec.tuning.arms[arm], chosen.get("params") or {}),
            )
        )
    return out


def grid_edges(knobs: dict[str, KnobSpec], chosen: dict[str, Any]) -> list[str]:
    """The chosen values at the smallest or largest of 3 or more numeric choices, e.g. 'lr 0.001
    is the largest of the 4 values searched'. A grid that could have found an interior best and
    did not leaves the arm's best possibly beyond it, which a reader of "each arm at its best"
    must know. Two-value and bool knobs are always at an end (nothing to say), and a range's
    sampled value is not a grid point."""
    out = []
    for knob, value in chosen.items():
        spec = knobs.get(knob)
        if spec is None or spec.choices is None or isinstance(value, bool):
            continue
        grid = sorted({float(c) for c in spec.choices if not isinstance(c, bool)})
        if len(grid) < 3 or float(value) not in (grid[0], grid[-1]):
            continue
        end = "largest" if float(value) == grid[-1] else "smallest"
        out.append(f"{knob} {value:g} is the {end} of the {len(grid)} values searched")
    return out


def trial_text(tr: TrialOut) -> str:
    """e.g. 'trial 1 {sft_coef: 2.0}: pruned at update 1' or '...: score 0.25'."""
    return f"trial {tr.number} {{{params_text(tr.params)}}}: {outcome_text(tr)}"


def params_text(params: dict[str, Any]) -> str:
    """'sft_coef: 2, lr: 0.0001'."""
    return ", ".join(
        f"{k}: {v:g}" if isinstance(v, float) else f"{k}: {v}" for k, v in params.items()
    )


def outcome_text(tr: TrialOut) -> str:
    """'score 0.25', 'pruned at update 1', or the trial's state (running, waiting, fail)."""
    if tr.state == "complete":
        return f"score {tr.score:.4g}" if tr.score is not None else "complete"
    if tr.state == "pruned":
        return f"pruned at update {tr.stopped_at if tr.stopped_at is not None else tr.last_update}"
    return tr.state


def report_lines(arms: list[ArmTuning]) -> list[str]:
    """The tuning stage as the terminal report and the Markdown section list it."""
    lines = []
    for a in arms:
        lines.append(f"tuning {a.arm} on {a.task} by {a.metric}: {choice_text(a)}")
        lines += [f"  at the grid's edge: {e}: its best may lie beyond" for e in a.edges]
        lines += [f"  {trial_text(tr)}" for tr in a.trials]
    return lines


def choice_text(a: ArmTuning) -> str:
    """What the arm trains with after its stage, in words."""
    if a.selected is None:
        return "nothing selected yet"
    if a.selected_trial is None:
        return "no trial completed: the arm keeps its own settings"
    return f"selected trial {a.selected_trial} {a.selected}"
