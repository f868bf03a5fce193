"""Trace browser v2 on a really trained run: step search, a chart point to its steps, exports,
clone-and-edit from TOML, the phase of a warm start and a pending cancel, a 25k-char thought."""

from __future__ import annotations

import csv
import io
import re
import threading
import time
import tomllib

import httpx
from playwright.sync_api import expect
from sqlalchemy import select

from shared.db.models import Step
from shared.db.session import session_scope
from tests.conftest import RealRun
from tests.ui.conftest import login, shot


def test_corrected_filter_and_text_search(page, base_url: str, real_run: RealRun) -> None:  # type: ignore[no-untyped-def]
    run_id, corrected = real_run.run_id, set(real_run.corrected_step_ids)
    login(page, base_url, real_run.read_token, f"/runs/{run_id}/steps?verdict=corrected")
    hits = page.locator("#step-hits tbody tr[data-step-id]")
    found = {int(x) for x in hits.evaluate_all("rs => rs.map(r => r.dataset.stepId)")}
    assert found == corrected  # 32 steps in all: one page holds them
    shot(page, "step-search-corrected")
    # A word of a known thought finds its step; one no thought has finds nothing.
    with session_scope() as s:
        step = s.get(Step, min(corrected))
        assert step is not None and step.thought
        values = re.sub(r'"[^"]*"\s*:', " ", step.thought)  # the search leaves JSON keys out
        word = max(re.findall(r"[A-Za-z]{4,}", values), key=len)
    page.fill("#step-filters input[name=q]", word)
    page.select_option("#step-filters select[name=verdict]", "")
    page.click("#step-filters button[type=submit]")
    page.wait_for_url(re.compile(r"q=" + word))
    ids = page.locator("#step-hits tbody tr[data-step-id]").evaluate_all(
        "rs => rs.map(r => Number(r.dataset.stepId))"
    )
    assert min(corrected) in ids
    # The permalink is the URL; a result opens its step page.
    page.goto(f"{base_url}/runs/{run_id}/steps?q=zzyzxqwv")
    assert "No step matches" in page.locator("#step-hits").inner_text()
    page.goto(f"{base_url}/runs/{run_id}/steps?verdict=corrected")
    page.locator("#step-hits tbody tr[data-step-id] td a").first.click()
    page.wait_for_url(re.compile(rf"/runs/{run_id}/steps/\d+$"))
    assert page.locator(".correction[data-verdict=incorrect]").count() == 1
    assert not page.js_errors


def test_chart_point_opens_that_updates_steps(page, base_url: str, real_run: RealRun) -> None:  # type: ignore[no-untyped-def]
    run_id = real_run.run_id
    login(page, base_url, real_run.read_token, f"/runs/{run_id}")
    page.wait_for_selector("#charts[data-points='2']")
    chart = page.locator(".chart[data-title='Corrector disagreement & validity'] .u-over")
    box = chart.bounding_box()
    assert box is not None
    # Update 0, the first point: the warm-started policy writes valid JSON, so the corrector
    # judged its steps (a tiny model may lose the format in its first PPO update, and then
    # update 1 has nothing to correct).
    page.mouse.move(box["x"] + 3, box["y"] + box["height"] / 2)
    page.mouse.click(box["x"] + 3, box["y"] + box["height"] / 2)
    page.wait_for_url(re.compile(r"/steps\?"))
    assert "update=0" in page.url and "verdict=corrected" in page.url
    rows = page.locator("#step-hits tbody tr[data-step-id]")
    assert rows.count() >= 1
    assert set(rows.evaluate_all("rs => rs.map(r => r.dataset.verdict)")) == {"corrected"}
    with session_scope() as s:
        updates = set(
            s.scalars(
                select(Step.update_idx).where(
                    Step.id.in_(
                        [int(i) for i in rows.evaluate_all("rs => rs.map(r => r.dataset.stepId)")]
                    )
                )
            )
        )
    assert updates == {0}


def test_exports_parse(base_url: str, real_run: RealRun) -> None:
    auth = {"Authorization": f"Bearer {real_run.read_token}"}
    api = f"{base_url}/api/runs/{real_run.run_id}"
    rows = list(
        csv.DictReader(
            io.StringIO(
                httpx.get(f"{api}/steps/export?verdict=corrected&format=csv", headers=auth).text
            )
        )
    )
    assert {int(r["step_id"]) for r in rows} == set(real_run.corrected_step_ids)
    assert all(r["verdict"] == "corrected" and r["corrected_thought"] for r in rows)
    as_json = httpx.get(f"{api}/steps/export?verdict=corrected&format=json", headers=auth).json()
    assert [r["step_id"] for r in as_json] == [int(r["step_id"]) for r in rows]
    metrics = list(
        csv.DictReader(
            io.StringIO(httpx.get(f"{api}/updates/export?format=csv", headers=auth).text)
        )
    )
    assert [m["update"] for m in metrics] == ["0", "1"]
    assert all(0 <= float(m["success_rate"]) <= 1 for m in metrics)
    page = httpx.get(f"{api}/steps?verdict=corrected&limit=5", headers=auth).json()
    assert page["total"] == len(set(real_run.corrected_step_ids)) and len(page["items"]) <= 5
    bad = httpx.get(f"{api}/steps?verdict=maybe", headers=auth)
    assert bad.status_code == 422 and "verdict" in bad.text


def test_clone_and_edit_relaunches_from_toml(page, base_url: str, real_run: RealRun) -> None:  # type: ignore[no-untyped-def]
    login(page, base_url, real_run.write_token, f"/runs/{real_run.run_id}")
    shown = tomllib.loads(page.locator("#config-toml").inner_text())
    assert shown["train"]["num_envs"] == 4 and shown["name"] == "real-tiny-run"
    page.click("#clone-run")
    text = page.input_value("#config")
    cfg = tomllib.loads(text)
    assert cfg["name"] == "real-tiny-run (copy)" and cfg["train"]["num_updates"] == 2
    page.fill(
        "#config",
        text.replace("num_updates = 2", "num_updates = 3").replace(
            'name = "real-tiny-run (copy)"', 'name = "relaunched"'
        ),
    )
    page.click("#launch-form button[type=submit]")
    page.wait_for_url(re.compile(r"/runs/\d+$"))
    assert page.locator("h1").inner_text().startswith("relaunched")
    relaunched = tomllib.loads(page.locator("#config-toml").inner_text())
    assert relaunched["train"]["num_updates"] == 3
    assert relaunched["init"] == shown["init"] and relaunched["model"] == shown["model"]
    # A corrector nobody registered is refused at launch, naming the field.
    page.goto(f"{base_url}/runs?clone={real_run.run_id}")
    page.fill(
        "#config",
        page.input_value("#config").replace('name = "oracle"', 'name = "no-such-corrector"'),
    )
    page.click("#launch-form button[type=submit]")
    assert "corrector.name" in page.locator("#config-errors").inner_text()
    api = httpx.post(
        f"{base_url}/api/runs",
        json={**cfg, "corrector": {"name": "no-such-corrector"}},
        headers={"Authorization": f"Bearer {real_run.write_token}"},
    )
    assert api.status_code == 422
    assert api.json()["detail"][0]["loc"] == ["body", "corrector", "name"]


def test_warm_start_phase_then_cancel_pending_then_cancelled(  # type: ignore[no-untyped-def]
    page, base_url: str, real_run: RealRun
) -> None:
    from services.api.service import create_run
    from services.controller.backends import InProcessPolicy, InProcessTrainer
    from services.controller.service import RunDriver
    from services.env import EnvPool
    from shared.schemas import RunConfig

    cfg = RunConfig.model_validate({
        "name": "warm-start-cancel", "task": "numberline",
        "env": {"image_size": 64}, "model": {"image_size": 64, "finetune": "full"},
        "init": {"kind": "warm_start", "vision_steps": 2000, "sft_samples": 32,
                 "sft_steps": 2000},
        "train": {"num_envs": 2, "num_steps": 2, "num_updates": 1},
        "metrics": {"probe_states": 0, "eval_episodes": 0},
    })  # fmt: skip
    with session_scope() as s:
        run_id = create_run(s, cfg, "real-ui").id
    driver = RunDriver(run_id, EnvPool(), InProcessPolicy(cfg.model), None, InProcessTrainer())
    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(driver.run()), daemon=True)
    thread.start()
    try:
        login(page, base_url, real_run.write_token, f"/runs/{run_id}")
        # The CSP forbids eval, so waits use locators, not wait_for_function strings.
        phase = page.locator("#run-phase [data-field=phase]")
        phase.filter(has_text=re.compile(r"warm start \d+ of 4000")).wait_for(timeout=60_000)
        assert re.fullmatch(r"warm start \d+ of 4000", phase.inner_text())
        shot(page, "run-warm-start")
        # Pushed by polling: the count moves on without a reload, here and in the runs list.
        expect(phase).not_to_have_text(phase.inner_text(), timeout=30_000)
        runs = page.context.new_page()
        runs.goto(f"{base_url}/runs")
        cell = runs.locator(f"#runs-table tr[data-run-id='{run_id}'] [data-field=phase]")
        shown = cell.inner_text()
        assert re.fullmatch(r"warm start \d+ of 4000", shown)
        expect(cell).not_to_have_text(shown, timeout=30_000)
        runs.close()
        page.on("dialog", lambda d: d.accept())
        # The page the cancel lands on, as the server rendered it: a warm-start chunk can end
        # (and the run with it) before the browser draws it, so read that one response.
        with page.expect_response(
            lambda r: r.url.endswith(f"/runs/{run_id}") and r.request.is_navigation_request()
        ) as landed:
            page.click("#cancel-run")
        html = landed.value.text()
        pending = re.search(r'<p [^>]*id="cancel-pending"[^>]*>', html)
        assert pending is not None
        if 'id="cancel-run"' in html:  # not yet terminal when rendered: the cancel is pending
            assert "hidden" not in pending.group(0)
            assert re.search(r'<button id="cancel-run"[^>]*\bdisabled\b', html)
        else:  # the driver stopped first: the page shows the run cancelled, nothing pending
            assert "hidden" in pending.group(0)
        started = time.monotonic()
        thread.join(timeout=30)
        assert result == ["cancelled"], result
        assert time.monotonic() - started < 30  # within a warm-start chunk, not the whole stage
        page.locator("#run-status .status", has_text="cancelled").wait_for(timeout=10_000)
        assert page.locator("#cancel-pending").is_hidden()
    finally:
        with session_scope() as s:
            from shared.db.models import Run

            run = s.get(Run, run_id)
            if run is not None:
                run.cancel_requested = True
        thread.join(timeout=60)


def test_long_thought_step_page_is_fast(base_url: str, real_run: RealRun) -> None:
    """A 25k-character thought beside a 20k-character corrected one: the capped diff answers
    at once (it used to take minutes, and hang the server's shutdown)."""
    from services.api.service import create_run
    from services.controller.recorder import add_step, open_episode
    from shared.db.models import Correction, Run
    from shared.schemas import RunConfig
    from shared.storage import blob_store

    words = "the current number is three and the target is five so I go up".split()
    thought = " ".join(words[i % len(words)] + str(i % 97) for i in range(4000))[:25_000]
    corrected = " ".join(words[(i * 7) % len(words)] + str(i % 89) for i in range(4000))[:20_000]
    with session_scope() as s:
        first = s.get(Step, real_run.corrected_step_ids[0])
        real = s.get(Run, real_run.run_id)
        assert first is not None and real is not None
        # A run of its own (same team, same config): the shared run's corrected steps are
        # counted by other tests, which must not see this one.
        run = create_run(s, RunConfig.model_validate(real.config), real.team)
        episode = open_episode(s, run.id, env_index=0, seq=0, update_idx=0)
        step = add_step(
            s, blob_store(), run_id=run.id, episode_id=episode.episode_id, idx=0, update_idx=0,
            rollout_pos=0, prompt=first.prompt, output=thought, thought=thought,
            action_text="+", parsed_action="+", format_valid=True, action_valid=True,
            reward=0.0, done=False, value=0.0, logprob=-1.0, state=first.state,
        )  # fmt: skip
        s.flush()
        s.add(Correction(step_id=step.id, run_id=run.id, update_idx=0, corrector="long-text",
                         status="done", verdict="incorrect",
                         corrected_thought=corrected))  # fmt: skip
        step_id, run_id = step.id, run.id
    cookies = {"gtr_token": real_run.read_token}
    url = f"{base_url}/runs/{run_id}/steps/{step_id}"
    # The old diff never finished on this text: an answer at all (within the client's
    # timeout) is the behaviour; bench/ui_bench.py measures the speed (docs/benchmarks.md).
    response = httpx.get(url, cookies=cookies, timeout=30)
    assert response.status_code == 200 and "<del>" in response.text and "<ins>" in response.text


def test_docs_served_locally_under_a_strict_csp(page, base_url: str) -> None:  # type: ignore[no-untyped-def]
    response = httpx.get(f"{base_url}/docs")
    csp = response.headers["content-security-policy"]
    script_src = next(p for p in csp.split(";") if p.strip().startswith("script-src"))
    assert "unsafe-inline" not in script_src and "http" not in response.text.split("<body>")[0]
    page.goto(f"{base_url}/docs")
    page.wait_for_selector(".swagger-ui .info .title", timeout=20_000)
    assert "gtr-lab" in page.locator(".swagger-ui .info .title").inner_text()
    assert page.locator(".opblock").count() > 10
    assert not page.js_errors


def test_login_hint_names_a_real_option(page, base_url: str) -> None:  # type: ignore[no-untyped-def]
    page.goto(f"{base_url}/login")
    hint = page.locator(".login p.muted").inner_text()
    assert "--scope" not in hint and "gtr token create NAME" in hint
