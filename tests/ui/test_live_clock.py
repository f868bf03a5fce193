"""A person watching one real run from before its start to its end (issue 58, items 1, 3, 4
and 6): the eval card keeps the latest evaluation and names its update between evaluations, the
ETA of each stage counts down and is within a sane factor of the time the run really took, the
progress count and the charts agree while an update is half done, and the running run heads the
runs list."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.api.auth import COOKIE_NAME
from shared.db.session import session_scope
from tests.ui.conftest import login, shot
from tests.ui.seed import Seeded
from tests.ui.test_live_run import _drive, _watch

TEAM = "live-clock"
TERMINAL = ("completed", "degraded", "failed", "cancelled")
STALL_S = 3.0  # seconds a loaded host may stall a stage that its ETA could not foresee
# What the open page shows, read in one go (one poll's rendering).
PAGE = """() => ({
  progress: document.querySelector('#progress-block .progress span')?.textContent,
  points: document.getElementById('charts').dataset.points || null,
  eval: document.querySelector("[data-metric='eval/success_rate']")?.innerText,
  evalUpdate: document.querySelector('[data-field=eval-update]')?.innerText || null,
  timing: document.querySelector('#run-phase [data-field=timing]')?.innerText,
})"""


@dataclass
class Clocked:
    run_id: int
    samples: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # (t, API run)
    page: list[dict[str, Any]] = field(default_factory=list)  # what the open page showed
    first_row: list[str | None] = field(default_factory=list)  # /runs' first row while running
    watch: str = ""
    js_errors: list[str] = field(default_factory=list)
    scrapes: list[tuple[str, str]] = field(default_factory=list)  # (open /metrics, admin's)


@pytest.fixture(scope="module")
def clocked(browser, base_url: str, seeded: Seeded, warm_checkpoint: Path, tmp_path_factory):  # type: ignore[no-untyped-def]
    from services.api.auth import create_token
    from services.api.service import create_run
    from services.policy.service import policy_for_checkpoint
    from services.trainer.warmstart import save_hf_model
    from shared.schemas import RunConfig

    base = save_hf_model(
        policy_for_checkpoint(None, warm_checkpoint), tmp_path_factory.mktemp("clock") / "base"
    )
    cfg = RunConfig.model_validate({
        "name": "live-clock", "task": "numberline", "seed": 5,
        "env": {"image_size": 64},
        "model": {"path": str(base), "image_size": 64, "finetune": "full"},
        "generation": {"max_new_tokens": 40},
        "init": {"kind": "warm_start", "vision_steps": 0, "sft_samples": 16, "sft_steps": 60,
                 "batch_size": 8, "cache": False},
        # A gentle lr: the default 1e-3 broke this weak start's format by update 2 (every output
        # ran to its 40-token cap), which tripled the cost of its last evaluation, a change of
        # rate that no ETA at measured rates foresees (measured: 13 s against 4 s).
        "train": {"num_envs": 4, "num_steps": 4, "num_updates": 3, "minibatch_size": 8,
                  "ppo_epochs": 1, "lr": 1e-4},
        "corrector": {"wait": "update", "wait_timeout_s": 60},
        # Evaluated after update 0 and after the last: update 1 has no evaluation of its own.
        "metrics": {"probe_states": 4, "eval_episodes": 32, "eval_every": 3},
    })  # fmt: skip
    with session_scope() as s:
        run_id = create_run(s, cfg, TEAM).id
        read = create_token(s, "clock-read", "read", TEAM)[1]
    c = Clocked(run_id)
    api = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {read}"}, timeout=30)
    admin = httpx.Client(base_url=base_url, cookies={COOKIE_NAME: seeded.admin_token}, timeout=30)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.on("pageerror", lambda e: c.js_errors.append(str(e)))
    try:
        login(page, base_url, read, f"/runs/{run_id}")
        watch = _watch(base_url, read, run_id)
        thread, result = _drive(run_id, str(base))
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            run = api.get(f"/api/runs/{run_id}").json()
            c.samples.append((time.monotonic(), run))
            c.page.append({**page.evaluate(PAGE), "api_done": run["updates_done"]})
            if run["status"] == "running" and run["updates_done"] >= 1 and len(c.first_row) < 3:
                listed = admin.get("/runs").text
                found = re.search(r'<tr (?:class="study-row" )?data-(run|study)-id="(\d+)"', listed)
                c.first_row.append(f"{found.group(1)} {found.group(2)}" if found else None)
                # Issue 57 item 5, while a run is running: the open scrape and the admin's.
                detailed = httpx.get(
                    f"{base_url}/api/metrics",
                    headers={"Authorization": f"Bearer {seeded.admin_token}"},
                    timeout=30,
                ).text
                c.scrapes.append((httpx.get(f"{base_url}/metrics", timeout=30).text, detailed))
            if run["status"] in TERMINAL:
                break
            time.sleep(0.25)
        thread.join(timeout=300)
        assert result == ["completed"], result
        c.watch = watch.communicate(timeout=60)[0]
        page.locator("#charts[data-state=final]").wait_for(timeout=30_000)
        c.page.append({**page.evaluate(PAGE), "api_done": 3})
        shot(page, "live-clock-end")
        yield c
    finally:
        with session_scope() as s:
            from shared.db.models import Run

            row = s.get(Run, run_id)
            if row is not None and row.status not in TERMINAL:
                row.cancel_requested = True
        context.close()
        api.close()
        admin.close()


def test_eval_card_keeps_the_latest_evaluation(clocked: Clocked) -> None:
    """Item 1: from the first evaluation on, the card shows a figure and the update it came
    from, never "–", also during update 1 and 2, which have no evaluation yet."""
    shown = [p for p in clocked.page if p["evalUpdate"]]
    assert shown, clocked.page[-5:]
    first = clocked.page.index(shown[0])
    for p in clocked.page[first:]:
        assert re.fullmatch(r"\d+%", p["eval"] or ""), p
        assert p["evalUpdate"] in ("after update 0", "after update 2"), p
    between = [p for p in clocked.page[first:] if p["progress"] in ("1/3", "2/3")]
    assert between and all(p["evalUpdate"] == "after update 0" for p in between)
    assert clocked.page[-1]["evalUpdate"] == "after update 2"
    assert not clocked.js_errors


def test_progress_count_and_charts_agree(clocked: Clocked) -> None:
    """Item 6: whenever the page was read, its charts drew as many updates as its progress
    bar counted, half-done updates included."""
    read = [p for p in clocked.page if p["progress"] and p["points"] is not None]
    assert len(read) > 5
    for p in read:
        assert p["progress"] == f"{p['points']}/3", p
    assert read[-1]["points"] == "3"


def _countdown(samples: list[tuple[float, dict[str, Any]]], key) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    """Consecutive samples of one measurement: (seconds between, ETA change)."""
    out = []
    for (t0, a), (t1, b) in zip(samples, samples[1:], strict=False):
        if a["eta_s"] is not None and b["eta_s"] is not None and key(a) == key(b):
            out.append((t1 - t0, b["eta_s"] - a["eta_s"]))
    return out


def test_eta_counts_down_and_holds_to_the_real_time(clocked: Clocked) -> None:
    """Item 3: each stage's ETA counts down between samples of one measurement (a warm-start
    report, an update) and stays within a factor of 3 of the time the stage really took."""
    samples = clocked.samples
    warm = [(t, r) for t, r in samples if r["phase"] == "warm_start"]
    run = [(t, r) for t, r in samples if r["status"] == "running" and r["updates_done"] >= 1]
    warm_end = next(t for t, r in samples if warm and t > warm[-1][0])
    run_end = next(t for t, r in samples if r["status"] in TERMINAL)
    assert any(r["eta_s"] is not None for _, r in warm), warm
    assert all(r["eta_of"] == "warm start" for _, r in warm if r["eta_s"] is not None)
    assert all(r["eta_of"] == "run" for _, r in run if r["eta_s"] is not None)
    for stage, end, key in (
        (warm, warm_end, lambda r: r["phase_step"]),
        (run, run_end, lambda r: r["updates_done"]),
    ):
        steps = _countdown(stage, key)
        assert steps, stage
        # Between two samples of one measurement the ETA only falls, by about the time between.
        for dt, change in steps:
            assert change <= 0.05, (dt, change)
        assert any(change < -0.1 for _, change in steps), steps
        checked = 0
        for t, r in stage:
            real = end - t
            # Seconds left of a stage's steps (after a warm start's last step its checkpoint is
            # written; after a run's last update, it closes): far enough from the end that a
            # fixed tail of a second or two does not make the factor.
            steps = r["phase"] != "warm_start" or (r["phase_step"] or 0) < (r["phase_total"] or 0)
            if r["eta_s"] is not None and real >= 6 and steps:
                # Less STALL_S: a loaded host can stall the stage for seconds after the rate
                # it was measured at (a warm start's 2.4 s ETA once took 7.8 s beside two
                # trainings), which no ETA foresees; a stage's own rate is still held to 3x.
                low = (real - STALL_S) / 3
                assert low <= r["eta_s"] <= real * 3, (r["phase"], r["eta_s"], real)
                checked += 1
        # A fast host may finish the stage in a few seconds, all of them inside the tail the
        # factor ignores: the factor is then checked on the stages that last long enough.
        assert checked or end - stage[0][0] < 12, [(end - t, r["eta_s"]) for t, r in stage]


def test_watch_counts_down_and_the_running_run_heads_the_list(clocked: Clocked) -> None:
    """Items 3 and 4: `gtr run watch` gives the ETA with each phase line, counting down through
    the warm start; the runs list (an admin's: every team's runs) shows the running run first."""

    def seconds(text: str) -> int:
        m, _, sec = text.rpartition("m ")
        return int(m or 0) * 60 + int(sec.rstrip("s"))

    etas = [seconds(e) for e in re.findall(r"ETA (\d+m \d+s|\d+s)", clocked.watch)]
    assert len(etas) >= 2, clocked.watch
    line = r"warm start \d+ of \d+ .*?ETA (\d+m \d+s|\d+s)"
    warm = [seconds(e) for e in re.findall(line, clocked.watch)]
    assert warm and warm[-1] < warm[0], clocked.watch  # counting down through the warm start
    assert clocked.first_row and all(r == f"run {clocked.run_id}" for r in clocked.first_row)


def test_open_metrics_give_a_running_runs_figures_only_as_a_mean(clocked: Clocked) -> None:
    """Issue 57 item 5: scraped while the run was running, the open /metrics has the running
    runs' figures without a run id; the admin's /api/metrics has them by this run's id."""
    assert clocked.scrapes
    label = f'run_id="{clocked.run_id}"'
    for open_text, detailed in clocked.scrapes:
        assert "run_id=" not in open_text
        mean = re.search(r"^gtr_run_env_steps_per_s [0-9.e+-]+$", open_text, re.M)
        assert mean, open_text[-2000:]
        assert f"gtr_run_env_steps_per_s{{{label}}}" in detailed, detailed[-2000:]
