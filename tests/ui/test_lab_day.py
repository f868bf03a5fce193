"""A lab's day, round 2 (issue 58), on data the product wrote: the v3 study as its importer
files it, the session's really trained run, and a run launched from the runs page. The runs list
keeps a new run in sight; the step search suggests what finds and takes the correction's own
word; every page's filter follows one rule; an unknown address answers a browser with a page;
imported runs offer no empty pages; the eval card names its update; axis labels, latencies and a
loopback corrector read as what they are."""

from __future__ import annotations

import re

import httpx
from sqlalchemy import select

from services.api.auth import COOKIE_NAME, create_token
from shared.db.models import Run, Update
from shared.db.session import session_scope
from tests.conftest import RealRun, live_server
from tests.ui.conftest import login, shot
from tests.ui.seed import Seeded

LONG_NAME = "lab-day launched a minute ago " + "with-a-long-descriptive-name-" * 4


def _lines(page, selector: str) -> list[float]:  # type: ignore[no-untyped-def]
    """How many text lines each matching element takes."""
    return page.locator(selector).evaluate_all(
        "els => els.map(e => e.getBoundingClientRect().height"
        " / parseFloat(getComputedStyle(e).lineHeight))"
    )


def test_runs_list_keeps_new_runs_in_sight(page, base_url: str, v3_study: tuple[int, str]) -> None:  # type: ignore[no-untyped-def]
    """Item 4: after importing a 63-run study, a run launched a minute later is at the top, the
    study is one row, the filters find runs by status, study and name, and names take two lines
    at most."""
    sid, _ = v3_study
    with session_scope() as s:
        write = create_token(s, "lab-day-write", "write", "v3-ui")[1]
    login(page, base_url, write, "/runs")
    page.click("#launch summary")
    page.fill("#config", f'name = "{LONG_NAME}"\ntask = "numberline"\n[train]\nnum_envs = 2\n')
    page.click("#launch-form button[type=submit]")
    page.wait_for_url(re.compile(r"/runs/\d+$"))
    run_id = int(page.url.rsplit("/", 1)[1])
    try:
        page.goto(f"{base_url}/runs")
        rows = page.locator("#runs-table tbody tr")
        assert rows.count() == 2  # the new run, then the study's 63 runs as one row
        assert rows.nth(0).get_attribute("data-run-id") == str(run_id)
        study_row = rows.nth(1)
        assert study_row.get_attribute("data-study-id") == str(sid)
        assert "its 63 runs" in study_row.inner_text() and "completed 63" in study_row.inner_text()
        assert max(_lines(page, "#runs-table td.name > a")) <= 2.05
        shot(page, "runs-folded")
        # The study's runs, unfolded: two pages, names on two lines at most.
        study_row.locator("a.study-runs").click()
        page.wait_for_load_state("networkidle")
        assert page.locator("#runs-table tbody tr[data-run-id]").count() == 50
        assert "page 1 of 2 · 63 in all" in page.inner_text(".pager")
        assert max(_lines(page, "#runs-table td.name > a")) <= 2.05
        assert page.input_value("#run-filters select[name=study]") == str(sid)
        # By name, and by status.
        page.goto(f"{base_url}/runs")
        page.fill("#run-filters input[name=name]", "LAB-DAY launched")
        with page.expect_navigation():
            page.click("#run-filters button[type=submit]")
        ids = page.locator("#runs-table tbody tr[data-run-id]").evaluate_all(
            "rs => rs.map(r => r.dataset.runId)"
        )
        assert ids == [str(run_id)]
        page.goto(f"{base_url}/runs?status=queued")
        assert page.locator("#runs-table tbody tr").count() == 1  # the study has none queued
        # A status the list cannot hold: the form says so (422), as every page's filter does.
        got = page.goto(f"{base_url}/runs?status=maybe")
        assert got is not None and got.status == 422
        assert "status: one of" in page.inner_text("#form-errors")
        assert page.locator("#run-filters").count() == 1
    finally:
        page.goto(f"{base_url}/runs/{run_id}")
        page.on("dialog", lambda d: d.accept())
        with page.expect_navigation():
            page.click("#cancel-run")
    assert not page.js_errors


def test_step_search_suggests_what_finds(page, base_url: str, real_run: RealRun) -> None:  # type: ignore[no-untyped-def]
    """Item 5: the placeholder's word finds steps; `incorrect` (the correction record's word)
    finds what `corrected` finds."""
    run = real_run.run_id
    login(page, base_url, real_run.read_token, f"/runs/{run}/steps")
    hint = page.get_attribute("#step-filters input[name=q]", "placeholder") or ""
    found = re.match(r"e\.g\. (\w+) ", hint)
    assert found, hint
    page.fill("#step-filters input[name=q]", found.group(1))
    with page.expect_navigation():
        page.click("#step-filters button[type=submit]")
    assert page.locator("#step-hits tbody tr[data-step-id]").count() >= 1
    ids = {}
    for word in ("corrected", "incorrect"):
        page.goto(f"{base_url}/runs/{run}/steps?verdict={word}")
        assert page.input_value("#step-filters select[name=verdict]") == "corrected"
        ids[word] = page.locator("#step-hits tbody tr[data-step-id]").evaluate_all(
            "rs => rs.map(r => Number(r.dataset.stepId))"
        )
    assert ids["incorrect"] == ids["corrected"] == real_run.corrected_step_ids[:50]
    auth = {"Authorization": f"Bearer {real_run.read_token}"}
    api = f"{base_url}/api/runs/{run}/steps"
    by_record = httpx.get(f"{api}?verdict=incorrect&limit=500", headers=auth)
    assert by_record.status_code == 200
    assert [h["id"] for h in by_record.json()["items"]] == real_run.corrected_step_ids


def test_one_rule_for_filters_and_unknown_addresses(page, base_url: str, real_run: RealRun) -> None:  # type: ignore[no-untyped-def]
    """Item 5: a filter value a page cannot hold is named in that page's form (422), on the
    episodes page as on the step search; an unknown address is a page for a browser and JSON
    for an API client."""
    run = real_run.run_id
    login(page, base_url, real_run.read_token, f"/runs/{run}")
    for path, field, form in (
        (f"/runs/{run}/episodes?success=maybe", "success", "#episode-filters"),
        (f"/runs/{run}/episodes?corrected=maybe", "corrected", "#episode-filters"),
        (f"/runs/{run}/steps?format_valid=maybe", "format_valid", "#step-filters"),
    ):
        got = page.goto(f"{base_url}{path}")
        assert got is not None and got.status == 422, path
        assert page.locator(form).count() == 1
        assert page.inner_text("#form-errors").count(f"{field}:") == 1, path
    got = page.goto(f"{base_url}/no/such/page")
    assert got is not None and got.status == 404
    assert page.inner_text("#page-message h1") == "Not found"
    assert "/no/such/page" in page.inner_text("#page-message")
    assert page.locator("nav a[href='/runs']").count() >= 1  # the app around it
    as_api = httpx.get(f"{base_url}/no/such/page", headers={"Accept": "application/json"})
    assert as_api.status_code == 404 and as_api.json() == {"detail": "Not Found"}
    api_path = httpx.get(f"{base_url}/api/no-such", headers={"Accept": "text/html"})
    assert api_path.status_code == 404 and api_path.json() == {"detail": "Not Found"}


def test_imported_run_page_offers_what_it_has(  # type: ignore[no-untyped-def]
    page, base_url: str, v3_study: tuple[int, str]
) -> None:
    """Items 1 and 6: an imported run has no steps here, so no step links; its eval card names
    the update of the latest evaluation; no axis repeats a label."""
    sid, token = v3_study
    with session_scope() as s:
        run = s.scalar(select(Run).where(Run.study_id == sid).order_by(Run.id))
        assert run is not None
        evals = [
            (u.idx, u.metrics["eval/success_rate"])
            for u in s.scalars(select(Update).where(Update.run_id == run.id).order_by(Update.idx))
            if "eval/success_rate" in u.metrics
        ]
        run_id = run.id
    login(page, base_url, token, f"/runs/{run_id}")
    assert page.locator("#imported").count() == 1
    for link in ("#search-steps", "#latest-corrections", "a[href$='/episodes']"):
        assert page.locator(f"#run-actions {link}").count() == 0, link
    idx, value = evals[-1]
    assert page.inner_text("[data-metric='eval/success_rate']") == f"{value * 100:.0f}%"
    assert page.inner_text("[data-field=eval-update]") == f"after update {idx}"
    page.locator("#charts[data-state=final]").wait_for()
    assert page.locator("#charts .u-over.clickable").count() == 0
    _distinct_ticks(page)
    assert not page.js_errors


def _distinct_ticks(page) -> None:  # type: ignore[no-untyped-def]
    ticks = page.locator("#charts .chart[data-y-ticks]").evaluate_all(
        "els => els.map(e => [e.dataset.title, e.dataset.yTicks.split('|')])"
    )
    assert ticks
    for title, labels in ticks:
        assert len(set(labels)) == len(labels), (title, labels)


def test_real_run_axes_and_eval_card(page, base_url: str, real_run: RealRun) -> None:  # type: ignore[no-untyped-def]
    """Item 6: a really trained run's nearly flat curves (thought length) keep distinct axis
    labels; item 1: its eval card names the update."""
    login(page, base_url, real_run.read_token, f"/runs/{real_run.run_id}")
    page.locator("#charts[data-state=final]").wait_for()
    page.evaluate("document.querySelectorAll('#charts details').forEach(d => { d.open = true; })")
    _distinct_ticks(page)
    assert page.inner_text("[data-field=eval-update]") == "after update 1"


def test_oracle_latency_and_loopback_corrector(  # type: ignore[no-untyped-def]
    page, base_url: str, real_run: RealRun, seeded: Seeded
) -> None:
    """Item 6: the oracle's latency reads p95 then mean with the digits a sub-millisecond
    figure needs (never "p95 0 ms" for calls that took time); a loopback corrector is refused
    at registration where every call to it would be refused."""
    from services.corrector.registry import corrector_stats
    from services.corrector.service import ORACLE

    with session_scope() as s:
        stats = corrector_stats(s, ORACLE, "real-ui")
    assert stats.latency_p95_ms is not None and stats.latency_p95_ms > 0
    login(page, base_url, real_run.read_token, "/correctors")
    cell = page.inner_text("tr[data-corrector=oracle] [data-field=latency]")
    shown = re.fullmatch(r"([\d.e-]+) · ([\d.e-]+) ms", cell)
    assert shown, cell
    p95, mean = (float(x) for x in shown.groups())
    assert p95 > 0 and mean > 0
    assert abs(p95 - stats.latency_p95_ms) <= 0.06 * stats.latency_p95_ms + 0.05
    from services.api.app import create_app
    from shared.settings import Settings, get_settings

    app = create_app()
    app.dependency_overrides[get_settings] = lambda: Settings(
        corrector_allow_private_networks=False
    )
    with live_server(app) as strict:
        page.context.clear_cookies()  # cookies ignore ports: log in anew, as the admin
        login(page, strict, seeded.admin_token, "/correctors")
        page.fill("input[name=name]", "lab-day-loopback")
        page.select_option("select[name=kind]", "openai")
        page.fill("input[name=base_url]", "http://127.0.0.1:9/v1")
        page.fill("input[name=model]", "m")
        page.click("#register-form button[type=submit]")
        status = page.locator("#register-status.bad")
        status.wait_for()
        assert "loopback" in status.inner_text()
        assert page.locator("tr[data-corrector='lab-day-loopback']").count() == 0
        with httpx.Client(base_url=strict, cookies={COOKIE_NAME: seeded.admin_token}) as c:
            names = [x["name"] for x in c.get("/api/correctors").json()]
        assert "lab-day-loopback" not in names
