"""The pages on a run the platform really trained (not seeded rows): curves, a corrected step's
diff and image, and the trace browser's filters on what the recorder wrote."""

from __future__ import annotations

from sqlalchemy import func, select

from shared.db.models import Episode
from shared.db.session import session_scope
from tests.conftest import RealRun
from tests.ui.conftest import login, shot


def test_real_run_pages(page, base_url: str, real_run: RealRun) -> None:  # type: ignore[no-untyped-def]
    run_id = real_run.run_id
    login(page, base_url, real_run.read_token, f"/runs/{run_id}")
    page.wait_for_selector("#charts[data-points]")
    assert page.get_attribute("#charts", "data-points") == "2"
    sizes = page.locator("#charts canvas").evaluate_all("cs => cs.map(c => c.width * c.height)")
    assert sizes and min(sizes) > 10_000
    # A GTR run's updates carry the thought-SFT term's share of the step, charted on its page.
    titles = page.locator("#charts .chart").evaluate_all("els => els.map(e => e.dataset.title)")
    assert "Thought guidance · SFT share of the step" in titles
    # Greedy evaluation success is a stat card of its own (the run evaluates after update 0).
    assert page.locator("[data-metric='eval/success_rate']").inner_text().endswith("%")
    shot(page, "real-run")
    page.goto(f"{base_url}/runs/{run_id}/steps/{real_run.corrected_step_ids[0]}")
    card = page.locator(".correction[data-verdict=incorrect]")
    assert card.count() == 1
    assert card.locator("pre.diff").locator("del, ins").count() >= 1
    page.wait_for_function("document.getElementById('observation').complete")
    assert page.eval_on_selector("#observation", "img => img.naturalWidth") == 320  # display frame
    shot(page, "real-step-corrected")
    assert not page.js_errors


def test_episodes_count_corrected_steps_and_mark_cut_off(  # type: ignore[no-untyped-def]
    page, base_url: str, real_run: RealRun
) -> None:
    """corrected_steps is written by record_correction; the run's end closes open episodes."""
    run_id = real_run.run_id
    with session_scope() as s:
        counted = s.scalar(
            select(func.sum(Episode.corrected_steps)).where(Episode.run_id == run_id)
        )
        open_left = s.scalar(
            select(func.count()).where(Episode.run_id == run_id, Episode.finished.is_(False))
        )
    assert counted == len(set(real_run.corrected_step_ids))
    assert open_left == 0
    login(page, base_url, real_run.read_token, f"/runs/{run_id}/episodes?corrected=true&update=1")
    assert "built-in" not in page.locator("#episode-filters").inner_html()
    assert page.input_value("#episode-filters input[name=update]") == "1"
    page.goto(f"{base_url}/runs/{run_id}/episodes?corrected=true")
    shown = page.locator("table.episodes tbody td .corr").all_inner_texts()
    assert shown and sum(int(x) for x in shown) == counted
    page.goto(f"{base_url}/runs/{run_id}/episodes")
    body = page.locator("table.episodes tbody").inner_text()
    assert "cut off" in body and "running" not in body
