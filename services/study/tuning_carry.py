"""A study's tuning stage in its bundle (services/study/bundle.py): what `gtr study export`
writes and `gtr study import` files in this store's Optuna storage.

Without it, a study imported into a fresh store would tune again (its Optuna studies are keyed
by the study's id in the store that ran them) and could choose other settings than the ones its
finished grid runs trained with: one arm, two settings, in one comparison. The bundle carries
each tuned arm's finished trials (settings, state, score, the running scores it reported, where
it was stopped, its seconds per update) and its choice. The import adds them to a new Optuna
study per arm, numbered in order; a trial still running at the export is not carried, and its
grid point is asked again here. A store whose stage for the study already has trials keeps its
own (importing twice changes nothing). Trial runs stay where they ran: a carried trial lists no
runs.

The carried stage is untrusted input: every arm, knob and value must be the study file's, every
number finite, or the bundle is refused in one line before anything is written.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy.orm import Session

from services.study.schemas import StudyConfig
from services.study.tuning import (
    _optuna_study,
    distribution,
    grid_points,
    trial_update_seconds,
)

STATES = ("complete", "pruned", "fail")  # the finished trials; a running one is asked again


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CarriedTrial(_Strict):
    number: int = Field(ge=0, le=10_000, description="The trial's number where it ran")
    state: Literal["complete", "pruned", "fail"]
    params: dict[str, float | int | bool] = Field(max_length=20, description="knob -> value")
    value: float | None = Field(None, description="Its selection score (complete trials)")
    reported: dict[int, float] = Field(
        default_factory=dict, max_length=10_000, description="update -> running score reported"
    )
    stopped_at: int | None = Field(None, ge=0, description="Where the pruner stopped it")
    error: str | None = Field(None, max_length=2_000, description="Why it failed")
    update_s: float | None = Field(
        None,
        gt=0,
        le=86_400,
        description="Mean seconds per update of its runs where they ran (evaluations "
        "included): `--stop-by`'s estimate of the arm's first grid run after an import",
    )


class CarriedArm(_Strict):
    arm: str = Field(max_length=200)
    trials: list[CarriedTrial] = Field(max_length=10_000)
    selected: dict[str, Any] | None = Field(
        None, description="{'trial': number or None, 'params': {...}}: the arm's choice"
    )


class CarryError(ValueError):
    """The bundle's tuning stage cannot be this study's."""


def export_stage(session: Session, cfg: StudyConfig, study_id: int) -> list[dict[str, Any]]:
    """Each tuned arm's finished trials and choice, as the bundle carries them."""
    from optuna.trial import TrialState

    if cfg.tuning is None:
        return []
    out = []
    for arm in cfg.tuning.arms:
        ostudy = _optuna_study(cfg, study_id, arm, create=False)
        if ostudy is None:
            continue
        seconds = trial_update_seconds(session, cfg, study_id, arm)
        finished = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        trials = [
            CarriedTrial(
                number=tr.number,
                state=tr.state.name.lower(),  # type: ignore[arg-type]
                params=dict(tr.params),
                value=tr.value if tr.state == TrialState.COMPLETE else None,
                reported=dict(tr.intermediate_values),
                stopped_at=tr.user_attrs.get("stopped_at"),
                error=tr.user_attrs.get("error"),
                update_s=seconds.get(tr.number),
            )
            for tr in ostudy.get_trials(deepcopy=False, states=finished)
        ]
        selected = ostudy.user_attrs.get("selected")
        out.append(CarriedArm(arm=arm, trials=trials, selected=selected).model_dump(mode="json"))
    return out


def check_stage(cfg: StudyConfig, carried: Any) -> list[CarriedArm]:
    """The bundle's stage, validated against the study file; CarryError in one line."""
    t = cfg.tuning
    if carried in (None, []):
        return []
    if t is None:
        raise CarryError("it carries a tuning stage but its study file declares none")
    if not isinstance(carried, list):
        raise CarryError("its tuning stage is not a list of arms")
    arms = []
    for i, item in enumerate(carried):
        try:
            arm = CarriedArm.model_validate(item)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise CarryError(f"tuning arm {i + 1}: {where}: {err['msg']}") from None
        knobs = t.arms.get(arm.arm)
        if knobs is None:
            raise CarryError(f"tuning arm {arm.arm!r} is not tuned by the study file")
        numbers = [tr.number for tr in arm.trials]
        if len(set(numbers)) != len(numbers):
            raise CarryError(f"tuning {arm.arm}: a trial number appears twice")
        for tr in arm.trials:
            head = f"tuning {arm.arm} trial {tr.number}"
            if set(tr.params) != set(knobs):
                raise CarryError(f"{head}: its knobs are not the study file's")
            for knob, value in tr.params.items():
                if not _within(value, knobs[knob]):
                    raise CarryError(f"{head}: {knob} = {value!r} is outside its search space")
            numbers_in = [tr.value, *tr.reported.values()]
            if any(v is not None and not math.isfinite(v) for v in numbers_in):
                raise CarryError(f"{head}: a score that is not a finite number")
            if (tr.state == "complete") != (tr.value is not None):
                raise CarryError(f"{head}: a complete trial has a score, no other")
        if arm.selected is not None:
            chosen = arm.selected.get("trial")
            params = arm.selected.get("params") or {}
            match = [tr for tr in arm.trials if tr.number == chosen and tr.state == "complete"]
            if chosen is not None and (not match or match[0].params != params):
                raise CarryError(f"tuning {arm.arm}: its choice is none of its complete trials")
            if chosen is None and params:
                raise CarryError(f"tuning {arm.arm}: a choice of settings with no trial")
        arms.append(arm)
    return arms


def _within(value: float | int | bool, spec: Any) -> bool:
    """Whether a carried value is one the knob's search space could have given."""
    if spec.choices is not None:
        return any(
            isinstance(value, bool) == isinstance(c, bool) and value == c for c in spec.choices
        )
    if isinstance(value, bool) or not math.isfinite(float(value)):
        return False
    return bool(spec.low <= value <= spec.high)


def install_stage(cfg: StudyConfig, study_id: int, arms: list[CarriedArm]) -> list[str]:
    """File the checked stage in this store's Optuna storage (after the import committed the
    study); one line per arm saying what it did."""
    from optuna.trial import TrialState, create_trial

    t = cfg.tuning
    lines: list[str] = []
    if t is None:
        return lines
    for arm in arms:
        knobs = t.arms[arm.arm]
        existing = _optuna_study(cfg, study_id, arm.arm, create=False)
        if existing is not None and (existing.trials or existing.user_attrs.get("selected")):
            lines.append(f"tuning {arm.arm}: this store's own stage kept (not the bundle's)")
            continue
        ostudy = _optuna_study(cfg, study_id, arm.arm, create=True, enqueue=False)
        assert ostudy is not None
        renumbered: dict[int, int] = {}
        for new, tr in enumerate(sorted(arm.trials, key=lambda x: x.number)):
            attrs: dict[str, Any] = {"carried_from": tr.number}
            if tr.stopped_at is not None:
                attrs["stopped_at"] = tr.stopped_at
            if tr.error is not None:
                attrs["error"] = tr.error
            if tr.update_s is not None:
                attrs["update_s"] = tr.update_s
            ostudy.add_trial(
                create_trial(
                    state=TrialState[tr.state.upper()],
                    value=tr.value,
                    params=tr.params,
                    distributions={k: distribution(k, knobs[k]) for k in tr.params},
                    intermediate_values=tr.reported,
                    user_attrs=attrs,
                )
            )
            renumbered[tr.number] = new
        if t.sampler == "grid":
            # The grid points no carried trial finished (one running at the export): asked here.
            done = [tr.params for tr in arm.trials]
            for point in grid_points(knobs):
                if point not in done:
                    ostudy.enqueue_trial(point)
            ostudy.set_user_attr("grid_enqueued", True)
        if arm.selected is not None:
            chosen = arm.selected.get("trial")
            trial = renumbered.get(chosen) if chosen is not None else None
            ostudy.set_user_attr(
                "selected", {"params": arm.selected.get("params") or {}, "trial": trial}
            )
        state = "its choice" if arm.selected is not None else "no choice yet"
        lines.append(f"tuning {arm.arm}: {len(arm.trials)} finished trials carried, {state}")
    return lines
