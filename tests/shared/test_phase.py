"""The ETA's stage seconds (shared/phase.py): what an update's stages took, from the metrics the
controller records with each update (rollout_s, train_s, eval_s, update_s, time/generate_s)."""

from __future__ import annotations

import pytest

from shared.phase import run_left_s, stage_over_s, stage_seconds


def update(generate: float, evaluated: float | None = None) -> dict:
    """An update's recorded seconds: a rollout of 1 s more than its generation, 2 s of
    training, 0.5 s of the rest, and an evaluation where ``evaluated``."""
    m = {"rollout_s": generate + 1, "train_s": 2.0, "time/generate_s": generate}
    if evaluated is not None:
        m |= {"eval_s": evaluated, "eval/success_rate": 0.5}
    return m | {"update_s": m["rollout_s"] + 2.0 + (evaluated or 0.0) + 0.5}


def test_an_evaluation_costs_what_generating_costs_now() -> None:
    # Evaluated after update 0 (4 s, its rollout generating 1 s); since then the outputs grew to
    # the token cap and the latest rollout generated for 3 s: the next evaluation takes ~12 s.
    rows = [update(3.0), update(2.0), update(1.0, evaluated=4.0)]
    stages = stage_seconds(rows)
    assert stages is not None
    assert stages["eval"] == pytest.approx(12.0)
    assert stages["rollout"] == pytest.approx(3.0) and stages["train"] == pytest.approx(2.0)
    assert stages["other"] == pytest.approx(0.5)
    # Without generation seconds (rows recorded before them), the evaluations' mean.
    bare = [{k: v for k, v in r.items() if k != "time/generate_s"} for r in rows]
    assert stage_seconds(bare)["eval"] == pytest.approx(4.0)  # type: ignore[index]


def test_the_evaluations_come_from_the_evaluated_updates_however_far_back() -> None:
    # Evaluated every 10th update: the last five updates hold no evaluation, and an ETA that
    # read them alone counted the next one as free.
    recent = [update(1.0) for _ in range(5)]
    evaluated = [update(2.0, evaluated=6.0), update(1.0, evaluated=2.0)]
    stages = stage_seconds(recent, evaluated)
    assert stages is not None
    assert stages["eval"] == pytest.approx((3.0 + 2.0) / 2 * 1.0)
    # Update 9 of 10 ends with the run's last evaluation: 2.5 s of it are in what is left.
    left = run_left_s(stages, "training", 0.0, 9, 10, 10, 32)
    assert left == pytest.approx(2.0 + stages["eval"] + 0.5)


def test_the_stage_under_way_counts_down() -> None:
    stages = stage_seconds([update(1.0, evaluated=4.0)])
    assert stages is not None
    at = run_left_s(stages, "evaluating", 0.0, 0, 2, 1, 8)
    later = run_left_s(stages, "evaluating", 3.0, 0, 2, 1, 8)
    assert at - later == pytest.approx(3.0)
    # Past its measured seconds the stage counts as done, never below zero: the ETA is then a
    # floor, and stage_over_s says by how much the stage overran.
    assert run_left_s(stages, "evaluating", 60.0, 0, 2, 1, 8) == pytest.approx(
        run_left_s(stages, "rollout", 0.0, 1, 2, 1, 8)
    )
    assert stage_over_s(stages, "evaluating", 3.0, 0, 2, 1, 8) == 0.0
    assert stage_over_s(stages, "evaluating", 60.0, 0, 2, 1, 8) == pytest.approx(60.0 - 4.5)


def test_a_stage_overruns_by_its_own_measured_seconds() -> None:
    stages = stage_seconds([update(1.0, evaluated=4.0)])
    assert stages is not None
    # Rollout 2 s, training 2 s; update 1 of 3, evaluated every 3rd: update 1 has no evaluation.
    assert stage_over_s(stages, "rollout", 5.0, 1, 3, 3, 8) == pytest.approx(3.0)
    assert stage_over_s(stages, "training", 1.0, 1, 3, 3, 8) == 0.0
    # An update without an evaluation finishes in its other seconds alone (0.5 s).
    assert stage_over_s(stages, "evaluating", 2.0, 1, 3, 3, 8) == pytest.approx(1.5)
    # Waiting for corrections and the phases before the first update have no measured seconds.
    assert stage_over_s(stages, "corrections", 99.0, 1, 3, 3, 8) == 0.0
    assert stage_over_s(stages, None, 99.0, 1, 3, 3, 8) == 0.0
