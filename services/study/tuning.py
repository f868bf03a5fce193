"""A study's declared tuning stage: each arm's settings searched on tuning seeds before the grid.

The study file's `[tuning]` section names, per arm, the knobs to search (each a run-config
field: `KNOBS`), their ranges or choices, a trial budget, the tuning seeds (disjoint from every
evaluation seed), the selection metric and the rule, all validated before any run. `gtr study
run` tunes first (`tune`): Optuna asks for each trial's settings, the trial trains one run per
tuning seed in child processes as the grid's runs train, reports its running score after every
evaluation, and a pruner (median or successive halving) stops a hopeless trial through the
run's cancel flag. Trials live in Optuna's storage (SQLite beside the embedded store,
`tuning.sqlite3` in the data folder: Optuna's own `studies` table would collide with ours in
the platform database), keyed by the study's id, so a resumed study does not tune again. Each
arm's selected settings are merged into its overlay, and the grid runs with them.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from services.study.schemas import (
    KnobSpec,
    MetricSpec,
    StudyConfig,
    _nested,
    merge,
    trial_config,
    tuned_task,
)

if TYPE_CHECKING:
    import optuna

POLL_S = 1.0
Say = Callable[[str], None]


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


# --- the stage: Optuna over the platform's runs -------------------------------------------


def storage_url() -> str:
    from shared.settings import get_settings

    folder = get_settings().data_dir
    folder.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(folder / 'tuning.sqlite3').resolve()}"


def _optuna_study(cfg: StudyConfig, study_id: int, arm: str, create: bool) -> optuna.Study | None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t = cfg.tuning
    assert t is not None
    name = f"gtr-study-{study_id}/{arm}"
    storage = optuna.storages.RDBStorage(storage_url())
    if not create:
        try:
            return optuna.load_study(study_name=name, storage=storage)
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
        storage=storage,
        study_name=name,
        direction="maximize" if higher else "minimize",
        sampler=sampler,
        pruner=pruner,
        load_if_exists=True,
    )
    if t.sampler == "grid" and not study.get_trials(deepcopy=False):
        # The grid as enqueued trials, in order (Optuna's GridSampler stops the study when
        # exhausted, which ask-and-tell does not allow); trials past the grid: TPE.
        knobs = t.arms[arm]
        for values in itertools.product(*(s.choices or [] for s in knobs.values())):
            study.enqueue_trial(dict(zip(knobs, values, strict=True)))
    return study


def _suggest(trial: optuna.Trial, knob: str, s: KnobSpec) -> Any:
    if s.choices is not None:
        return trial.suggest_categorical(knob, s.choices)
    assert s.low is not None and s.high is not None
    if knob == "sft_epochs":
        return trial.suggest_int(knob, int(s.low), int(s.high), log=s.log)
    return trial.suggest_float(knob, s.low, s.high, log=s.log)


def tune(cfg: StudyConfig, study_id: int, jobs: int, say: Say = print) -> StudyConfig:
    """Run the tuning stage (trials already in the storage count: a resumed study goes on where
    it stopped, a finished stage is not run again); the study with each arm's selection."""
    from optuna.trial import TrialState

    t = cfg.tuning
    if t is None:
        return cfg
    selected: dict[str, dict[str, Any]] = {}
    for arm, knobs in t.arms.items():
        study = _optuna_study(cfg, study_id, arm, create=True)
        assert study is not None
        for tr in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study.tell(tr.number, state=TrialState.FAIL)  # left by an interrupted invocation
            study._storage.set_trial_user_attr(tr._trial_id, "interrupted", True)
        while _counted(study) < t.trials:
            trial = study.ask()
            params = {k: _suggest(trial, k, s) for k, s in knobs.items()}
            _run_trial(cfg, study_id, arm, trial, params, jobs, say)
        best = choose(study)
        if best is None:
            say(f"tuning {arm}: no trial completed; the arm keeps its own settings")
            continue
        selected[arm] = dict(best.params)
        study.set_user_attr("selected", {"trial": best.number, "params": best.params})
        say(f"tuning {arm}: selected trial {best.number} {best.params} (score {best.value:.4g})")
    return apply_selection(cfg, selected)


def _counted(study: optuna.Study) -> int:
    from optuna.trial import TrialState

    done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    return sum(
        not tr.user_attrs.get("interrupted") for tr in study.get_trials(deepcopy=False, states=done)
    )


def choose(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """Rule 'best': the completed trial with the best value, the earlier on a tie."""
    from optuna.study import StudyDirection
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not done:
        return None
    sign = 1.0 if study.direction == StudyDirection.MAXIMIZE else -1.0
    return max(done, key=lambda tr: (sign * float(tr.value or 0.0), -tr.number))


def _run_trial(
    cfg: StudyConfig,
    study_id: int,
    arm: str,
    trial: optuna.Trial,
    params: dict[str, Any],
    jobs: int,
    say: Say,
) -> None:
    """Train the trial's runs (one per tuning seed), report the mean running score after every
    evaluation all of them reached, stop them when the pruner says so, and tell Optuna."""
    from optuna.trial import TrialState
    from sqlalchemy import update

    from shared.db.models import Run
    from shared.db.session import session_scope

    t = cfg.tuning
    assert t is not None
    metric = t.selection(cfg.primary)
    ids: list[int] = []
    with session_scope() as s:
        for seed in t.seeds:
            rc = trial_config(cfg, arm, seed, params, trial.number)
            run = Run(
                name=rc.name,
                team="default",
                task=rc.task,
                algorithm=rc.algorithm,
                status="running",
                config=rc.model_dump(mode="json"),
                total_env_steps=rc.total_env_steps,
                num_updates=rc.train.num_updates,
                info={"tuning": {"study_id": study_id, "arm": arm, "trial": trial.number}},
            )
            s.add(run)
            s.flush()
            ids.append(run.id)
    trial.set_user_attr("runs", ids)
    say(f"tuning {arm} trial {trial.number} {params}: runs {', '.join(map(str, ids))}")
    threads = max(1, (os.cpu_count() or 1) // max(1, min(jobs, len(ids))))
    procs: dict[int, subprocess.Popen[bytes]] = {}
    waiting = list(ids)
    reported: set[int] = set()
    stopped_at: int | None = None
    try:
        while waiting or procs:
            while waiting and len(procs) < jobs:
                run_id = waiting.pop(0)
                procs[run_id] = _spawn(study_id, run_id, threads)
            for run_id in [r for r, p in procs.items() if p.poll() is not None]:
                procs.pop(run_id)
            curves = _curves(ids, metric.metric)
            for step, value in _running_scores(curves, metric, len(ids)):
                if step in reported or stopped_at is not None:
                    continue
                reported.add(step)
                trial.report(value, step)
                if trial.should_prune():
                    stopped_at = step
                    waiting.clear()
                    with session_scope() as s:
                        s.execute(update(Run).where(Run.id.in_(ids)).values(cancel_requested=True))
            time.sleep(POLL_S)
    except BaseException:
        for p in procs.values():
            p.terminate()
        raise
    statuses = _statuses(ids)
    if stopped_at is not None:
        trial.set_user_attr("stopped_at", stopped_at)
        study_tell(trial, TrialState.PRUNED, None)
        say(f"tuning {arm} trial {trial.number}: pruned at update {stopped_at}")
        return
    scores = [metric.score(c) for c in _curves(ids, metric.metric).values()]
    if any(st != "completed" for st in statuses) or any(v is None for v in scores):
        trial.set_user_attr("error", f"runs ended {', '.join(statuses)}")
        study_tell(trial, TrialState.FAIL, None)
        say(f"tuning {arm} trial {trial.number}: failed (runs ended {', '.join(statuses)})")
        return
    value = sum(v for v in scores if v is not None) / len(scores)
    study_tell(trial, TrialState.COMPLETE, value)
    say(f"tuning {arm} trial {trial.number}: score {value:.4g}")


def study_tell(trial: optuna.Trial, state: Any, value: float | None) -> None:
    trial.study.tell(trial, value, state=state)


def _spawn(study_id: int, run_id: int, threads: int) -> subprocess.Popen[bytes]:
    from shared.settings import get_settings

    folder = get_settings().data_dir / "studies" / str(study_id)  # the runner's log folder
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.setdefault("GTR_TORCH_THREADS", str(threads))
    with open(folder / f"tuning-run-{run_id}.log", "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "services.study.runner", str(run_id)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )


def _curves(ids: list[int], metric: str) -> dict[int, list[tuple[int, float]]]:
    from sqlalchemy import select

    from shared.db.models import Update
    from shared.db.session import session_scope

    out: dict[int, list[tuple[int, float]]] = {i: [] for i in ids}
    with session_scope() as s:
        rows = s.execute(
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


def _statuses(ids: list[int]) -> list[str]:
    from sqlalchemy import select

    from shared.db.models import Run
    from shared.db.session import session_scope

    with session_scope() as s:
        return [str(x) for x in s.scalars(select(Run.status).where(Run.id.in_(ids))).all()]


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
                        params=dict(tr.params),
                        state=tr.state.name.lower(),
                        score=tr.value,
                        stopped_at=tr.user_attrs.get("stopped_at"),
                        last_update=tr.last_step,
                        runs=list(tr.user_attrs.get("runs") or []),
                    )
                    for tr in trials
                ],
                selected=chosen.get("params"),
                selected_trial=chosen.get("trial"),
            )
        )
    return out


def trial_text(tr: TrialOut) -> str:
    """e.g. 'trial 1 {sft_coef: 2.0}: pruned at update 1' or '...: score 0.25'."""
    params = ", ".join(
        f"{k}: {v:g}" if isinstance(v, float) else f"{k}: {v}" for k, v in tr.params.items()
    )
    if tr.state == "complete":
        how = f"score {tr.score:.4g}" if tr.score is not None else "complete"
    elif tr.state == "pruned":
        how = f"pruned at update {tr.stopped_at if tr.stopped_at is not None else tr.last_update}"
    else:
        how = tr.state
    return f"trial {tr.number} {{{params}}}: {how}"


def report_lines(arms: list[ArmTuning]) -> list[str]:
    """The tuning stage as the terminal report and the Markdown section list it."""
    lines = []
    for a in arms:
        chosen = (
            f"selected trial {a.selected_trial} {a.selected}"
            if a.selected is not None
            else "nothing selected yet"
        )
        lines.append(f"tuning {a.arm} on {a.task} by {a.metric}: {chosen}")
        lines += [f"  {trial_text(tr)}" for tr in a.trials]
    return lines
