"""A run's phase and clock, worded alike by its three writers: the server's page (_macros.html
``phase``), the page's own refresh (``gtr.phaseText`` and ``gtr.timingText``, common.js) and
``gtr run watch`` (``phase_text``). A stage past its measured time makes the ETA a floor, and
each of them says so."""

from __future__ import annotations

import re
from typing import Any

import pytest

from services.api.routes.ui import templates
from services.controller.cli import phase_text

# What run_timing and the run API give for a running run, in the cases the wording differs.
CASES: list[dict[str, Any]] = [
    {"phase": "warm_start", "phase_step": 3, "phase_total": 10, "elapsed_s": 12.0,
     "eta_s": 40.0, "eta_of": "warm start", "eta_over_s": 0.0},
    {"phase": "warm_start", "phase_step": 10, "phase_total": 10, "elapsed_s": 95.0,
     "eta_s": 0.0, "eta_of": "warm start", "eta_over_s": 8.4},
    {"phase": "rollout", "phase_step": 2, "phase_total": 4, "elapsed_s": 3725.0,
     "eta_s": 125.0, "eta_of": "run", "eta_over_s": 0.4},
    {"phase": "training", "phase_step": None, "phase_total": None, "elapsed_s": 61.0,
     "eta_s": 3600.0, "eta_of": "run", "eta_over_s": 75.0},
    {"phase": "corrections", "phase_step": None, "phase_total": None, "elapsed_s": 5.0,
     "eta_s": None, "eta_of": None, "eta_over_s": 0.0},
]  # fmt: skip


def _server(run: dict[str, Any]) -> str:
    macros = templates.env.get_template("_macros.html").module
    html = str(macros.phase(run, run))  # type: ignore[attr-defined]
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).strip()


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_the_three_writers_agree(page, base_url: str, case: dict[str, Any]) -> None:  # type: ignore[no-untyped-def]
    run = {"status": "running", **case}
    page.goto(f"{base_url}/login")
    refreshed = page.evaluate("r => gtr.phaseText(r) + ' ' + gtr.timingText(r)", run)
    refreshed = re.sub(r"\s+", " ", refreshed).strip()
    assert _server(run) == refreshed
    assert phase_text(run) == refreshed
    assert not page.js_errors


def test_an_overrun_stage_makes_the_eta_a_floor() -> None:
    warm, rollout, training = (_server({"status": "running", **c}) for c in CASES[1:4])
    assert "ETA ≥ 0s (warm start; this stage 8s past its usual)" in warm
    # Under a second past a mean is no overrun worth a word.
    assert "ETA 2m 05s" in rollout and "≥" not in rollout and "past" not in rollout
    assert "ETA ≥ 1h 00m (this stage 1m 15s past its usual)" in training
