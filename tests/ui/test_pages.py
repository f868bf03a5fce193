"""The web UI in a real browser (Debian's Chromium) against the app on a seeded PostgreSQL."""

from __future__ import annotations

import re

import httpx

from services.env.display import DISPLAY_SIZE
from tests.ui.conftest import login, shot
from tests.ui.seed import IMAGE, Seeded


def test_login_required_and_bad_token_rejected(page, base_url: str) -> None:
    page.goto(f"{base_url}/runs/1")
    assert "/login" in page.url
    page.fill("#token", "gtr_not-a-real-token")
    page.click("button[type=submit]")
    assert page.locator(".error").inner_text() == "Unknown or revoked token."
    assert httpx.get(f"{base_url}/runs", follow_redirects=False).status_code == 303


def test_runs_list_shows_progress_success_and_alarm(page, base_url: str, seeded: Seeded) -> None:
    login(page, base_url, seeded.write_token)
    assert page.url.endswith("/runs")
    rows = page.locator("#runs-table tbody tr[data-run-id]")
    assert rows.count() == 3
    done = page.locator(f"tr[data-run-id='{seeded.run_id}']")
    assert "completed" in done.inner_text() and "12/12" in done.inner_text()
    assert re.search(r"\d+%", done.locator("[data-field=success]").inner_text())
    collapse = page.locator(f"tr[data-run-id='{seeded.collapse_run_id}']")
    assert "collapse" in collapse.locator("[data-field=alarm]").inner_text()
    assert "unreachable" in page.locator(f"tr[data-run-id='{seeded.failed_run_id}']").inner_text()
    shot(page, "runs")


def test_run_page_draws_curves_and_checkpoints(page, base_url: str, seeded: Seeded) -> None:
    login(page, base_url, seeded.read_token, f"/runs/{seeded.run_id}")
    page.wait_for_selector("#charts[data-points]")
    assert page.get_attribute("#charts", "data-points") == "12"
    titles = page.locator("#charts .chart").evaluate_all("els => els.map(e => e.dataset.title)")
    for expected in ("Success rate", "Episode return", "Losses", "Collapse · state relevance"):
        assert expected in titles
    # Every chart has a drawn canvas of a real size.
    sizes = page.locator("#charts canvas").evaluate_all("cs => cs.map(c => c.width * c.height)")
    assert len(sizes) == len(titles) and min(sizes) > 10_000
    assert page.locator("#alarm-banner").is_hidden()
    assert page.locator("table.grid tbody tr").count() == 4  # init + 3 checkpoints
    assert "numberline" in page.locator("pre.config").inner_text()
    shot(page, "run")
    assert not page.js_errors


def test_collapsing_run_shows_the_alarm(page, base_url: str, seeded: Seeded) -> None:
    login(page, base_url, seeded.write_token, f"/runs/{seeded.collapse_run_id}")
    page.wait_for_selector("#charts[data-points]")
    assert page.locator("#alarm-banner").is_visible()
    assert page.locator("#charts .collapse-chart").count() >= 3
    shot(page, "run-collapse")


def test_trace_browser_corrected_step_diff_image_and_keys(
    page, base_url: str, seeded: Seeded
) -> None:
    login(page, base_url, seeded.read_token, f"/runs/{seeded.run_id}/episodes?corrected=true")
    corrected = page.locator("table.episodes tbody tr .corr").count()
    assert corrected >= 1  # corrected_steps as record_correction counted them
    page.goto(f"{base_url}/runs/{seeded.run_id}/episodes?corrected=false")
    assert page.locator("table.episodes tbody tr").count() + corrected == 24
    page.goto(f"{base_url}/runs/{seeded.run_id}/episodes?update=5")
    assert page.locator("table.episodes tbody tr").count() == 8
    shot(page, "episodes")

    step_id = seeded.corrected_step_ids[0]
    page.goto(f"{base_url}/runs/{seeded.run_id}/steps/{step_id}")
    card = page.locator(".correction[data-verdict=incorrect]")
    assert card.locator(".verdict").inner_text().lower() == "corrected"  # the search's word
    diff = card.locator("pre.diff")
    assert diff.locator("del").count() >= 1 and diff.locator("ins").count() >= 1
    assert "expert" in card.locator(".reasoning").inner_text().lower()  # the real oracle's words
    page.wait_for_function("document.getElementById('observation').complete")
    # The picture for people is drawn from the step's stored state at the display size, not
    # the model's small input (the rollout stores no display frame for a card env).
    width = page.eval_on_selector("#observation", "img => img.naturalWidth")
    assert width == DISPLAY_SIZE and width != IMAGE
    shot(page, "step-corrected")

    next_href = page.get_attribute("#next-step", "href")
    assert next_href
    page.keyboard.press("j")
    page.wait_for_url(f"**{next_href}")
    page.keyboard.press("k")
    page.wait_for_url(f"**/steps/{step_id}")
    page.keyboard.press("J")
    page.wait_for_url(re.compile(r"/steps/\d+$"))
    assert page.locator(".timeline li.current .idx").inner_text() == "1"
    assert not page.js_errors


def test_read_only_token_cannot_cancel_or_launch(page, base_url: str, seeded: Seeded) -> None:
    login(page, base_url, seeded.read_token, f"/runs/{seeded.collapse_run_id}")
    assert page.locator("#cancel-run").is_disabled()
    shot(page, "run-read-only")
    page.goto(f"{base_url}/runs")
    assert page.locator("#launch-form").count() == 0
    api = httpx.post(
        f"{base_url}/api/runs/{seeded.collapse_run_id}/cancel",
        headers={"Authorization": f"Bearer {seeded.read_token}"},
    )
    assert api.status_code == 403
    form = httpx.post(
        f"{base_url}/runs/{seeded.collapse_run_id}/cancel",
        cookies={"gtr_token": seeded.read_token},
        follow_redirects=False,
    )
    assert form.status_code == 403
    run = httpx.get(
        f"{base_url}/api/runs/{seeded.collapse_run_id}",
        headers={"Authorization": f"Bearer {seeded.read_token}"},
    ).json()
    assert run["status"] == "running"


def test_launch_from_toml_then_cancel(page, base_url: str, seeded: Seeded) -> None:
    login(page, base_url, seeded.write_token)
    page.click(".launch summary")
    page.fill("#config", 'name = "ui-launched"\ntask = "numberline"\n[train]\nnum_envs = 0\n')
    page.click("#launch-form button[type=submit]")
    assert "train.num_envs" in page.locator("#config-errors").inner_text()
    page.fill("#config", 'name = "ui-launched"\ntask = "numberline"\n[train]\nnum_envs = 2\n')
    page.click("#launch-form button[type=submit]")
    page.wait_for_url(re.compile(r"/runs/\d+$"))
    assert page.locator("h1").inner_text().startswith("ui-launched")
    assert "queued" in page.locator("#run-status").inner_text()
    page.on("dialog", lambda d: d.accept())
    with page.expect_navigation():
        page.click("#cancel-run")
    # The run's state says it (no notice kept in the URL, where a reload would show it again).
    assert re.search(r"/runs/\d+$", page.url)
    assert "cancelled" in page.locator("#run-status").inner_text()
    assert page.locator(".notice:visible").count() == 0
    shot(page, "run-launched-cancelled")


def test_run_page_polls_new_updates(page, base_url: str, seeded: Seeded, pg_url: str) -> None:
    from shared.db.models import Run, Update
    from shared.db.session import session_scope

    login(page, base_url, seeded.read_token, f"/runs/{seeded.collapse_run_id}")
    page.wait_for_selector("#charts[data-points='18']")
    with session_scope(pg_url) as s:
        s.add(
            Update(
                run_id=seeded.collapse_run_id,
                idx=18,
                alarm=True,
                metrics={"success_rate": 0.11, "probe_relevance": 0.04},
            )
        )
        s.get(Run, seeded.collapse_run_id).updates_done = 19  # type: ignore[union-attr]
    page.wait_for_selector("#charts[data-points='19']", timeout=15_000)
    assert page.locator("#progress-block .progress span").inner_text() == "19/40"
    assert page.locator("[data-metric=success_rate]").inner_text() == "11%"


def test_compare_overlays_runs(page, base_url: str, seeded: Seeded) -> None:
    login(page, base_url, seeded.read_token)
    page.check(f"input[name=runs][value='{seeded.run_id}']")
    page.check(f"input[name=runs][value='{seeded.collapse_run_id}']")
    page.click("#compare-button")
    page.wait_for_selector("#compare-charts[data-charts]")
    titles = page.locator("#compare-charts .chart").evaluate_all(
        "els => els.map(e => e.dataset.title)"
    )
    assert "success_rate" in titles and "probe_relevance" in titles
    legend = page.locator("#compare-charts .chart").first.locator(".u-legend").inner_text()
    assert "numberline-gtr-tiny" in legend and "ezpoints-rl4vlm-collapse" in legend
    shot(page, "compare")
    assert not page.js_errors
