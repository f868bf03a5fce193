"""bench/run_profile.py's accounting: a stage's CPU seconds exclude the timed calls inside it,
a stage is charged to the phase that encloses it, and a short run scales to 60 updates by each
phase's number of calls there."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_profile", ROOT / "bench" / "run_profile.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["run_profile"] = mod
    spec.loader.exec_module(mod)
    return mod


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_nested_stages_are_exclusive_and_charged_to_their_phase() -> None:
    rp = _bench()
    generate = rp._timed(lambda: _burn(0.05), "generate", False)

    def evaluate() -> None:
        _burn(0.02)
        generate()
        generate()

    rp._timed(evaluate, "eval", True)()
    generate()  # outside any phase
    t = rp.TOTALS
    assert set(t) == {("eval", "eval"), ("eval", "generate"), ("(unphased)", "generate")}
    assert 0.1 <= t[("eval", "generate")] < 0.15
    assert 0.02 <= t[("eval", "eval")] < 0.05  # its own work, not its two generate calls
    assert rp.CALLS == {"eval": 1}


def test_a_short_run_scales_to_sixty_updates_by_calls() -> None:
    rp = _bench()
    prof = {"updates": 2, "eval_every": 5, "calls": {"eval": 2, "probe": 3, "train": 2}}
    scale = rp.full_run_scale(prof)
    # updates 1, 5, 10, ..., 60: 13 evaluations; a probe per update and one before the first
    assert scale["eval"] == 13 / 2 and scale["probe"] == 61 / 3 and scale["train"] == 30


def test_a_phase_calling_its_own_kind_counts_once() -> None:
    rp = _bench()
    inner = rp._timed(lambda: _burn(0.01), "eval", True)  # evaluate() calling evaluate_deals()
    rp._timed(lambda: inner(), "eval", True)()
    assert rp.CALLS == {"eval": 1} and set(rp.TOTALS) == {("eval", "eval")}
