"""A run whose corrections mostly failed ends ``degraded``: the status and its reason, as the run
driver writes them, through the REST API, ``gtr run watch`` and the run page."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from click.testing import CliRunner

from services.api.app import create_app
from services.api.auth import create_token
from services.api.service import create_run
from services.controller import correction_stats as CS
from services.controller import store
from services.controller.backends import ThreadCorrections, record_missing_as_failed
from services.controller.cli import run as run_cli
from services.controller.recorder import add_step, open_episode
from shared.db.session import session_scope
from shared.schemas import RunConfig
from shared.settings import Settings
from shared.storage import blob_store
from tests.conftest import live_server

AGENT = '{"current number": 2, "target number": 4, "thoughts": "2 < 4", "action": "+"}'


def _run_with_corrections(done: int, failed: int, share: float = 0.5) -> tuple[int, RunConfig]:
    """A run whose steps the oracle corrected (``done``) or that timed out (``failed``), each
    written by the product's own writers."""
    cfg = RunConfig.model_validate({"task": "numberline", "corrector": {"degraded_share": share}})
    with session_scope() as s:
        run_id = create_run(s, cfg, "default").id
        ep = open_episode(s, run_id, 0, 0, 0)
        ids = []
        for i in range(done + failed):
            step = add_step(
                s,
                blob_store(),
                run_id=run_id,
                episode_id=ep.episode_id,
                idx=i,
                update_idx=0,
                rollout_pos=i,
                prompt="p",
                output=AGENT,
                format_valid=True,
                action_valid=True,
                reward=0.0,
                done=False,
                state={"current": 2, "target": 4},
            )
            s.flush()
            ids.append(step.id)
    pool = ThreadCorrections("oracle", 0.0, 0, Settings())
    pool.submit(run_id, ids[:done])
    pool.close()
    record_missing_as_failed(run_id, ids[done:], "oracle", 60.0)
    return run_id, cfg


def _end(run_id: int, cfg: RunConfig) -> str:
    """What the run driver does when the loop ends: the final status, then the row."""
    with session_scope() as s:
        status, error = CS.final_status(s, run_id, cfg, "completed", None)
        store.end_run(s, run_id, status, error)
    return status


def test_most_corrections_failed_means_degraded_and_the_threshold_is_a_setting(
    pg_url: str,
) -> None:
    run_id, cfg = _run_with_corrections(done=1, failed=3)
    assert _end(run_id, cfg) == "degraded"
    with session_scope() as s:
        error = store.run_row(s, run_id).error
    assert error == (
        "degraded: 3 of 4 requested corrections failed (over "
        "corrector.degraded_share = 0.5): timeout: no answer within 60 s (3)"
    )
    lenient, cfg = _run_with_corrections(done=1, failed=3, share=0.8)
    assert _end(lenient, cfg) == "completed"
    half, cfg = _run_with_corrections(done=2, failed=2)
    assert _end(half, cfg) == "completed"  # half is not over half


@pytest.fixture(scope="module")
def api(pg_url: str) -> Iterator[tuple[str, str]]:
    with session_scope() as s:
        token = create_token(s, "degraded-test", "write", "default")[1]
    with live_server(create_app()) as url:
        yield url, token


def test_rest_watch_and_the_run_page_show_degraded(api: tuple[str, str]) -> None:
    url, token = api
    run_id, cfg = _run_with_corrections(done=0, failed=2)
    assert _end(run_id, cfg) == "degraded"
    auth = {"Authorization": f"Bearer {token}"}
    got = httpx.get(f"{url}/api/runs/{run_id}", headers=auth).json()
    assert got["status"] == "degraded" and got["error"].startswith("degraded: 2 of 2")
    listed = httpx.get(f"{url}/api/runs", params={"status": "degraded"}, headers=auth).json()
    assert run_id in [r["id"] for r in listed["items"]]
    watched = CliRunner().invoke(run_cli, ["watch", str(run_id), "--url", url, "--token", token])
    assert watched.exit_code == 1
    assert watched.output.splitlines()[-2:] == [f"error: {got['error']}", "degraded"]
    page = httpx.get(f"{url}/runs/{run_id}", headers=auth)
    assert page.status_code == 200
    assert '<span class="status status-degraded">degraded</span>' in page.text
    assert "degraded: 2 of 2 requested corrections failed" in page.text
    assert "timeout: no answer within 60 s (2)" in page.text  # the reason, on the page


def test_min_coverage_holds_an_update_back_and_degrades_a_run_that_ends_below_it(
    pg_url: str,
) -> None:
    """corrector.min_coverage: an update waits while fewer than that share of the requested
    corrections are done and some are still to come; a run that ends below it is degraded
    (skipped and late corrections are no failures, but they are no coverage either)."""
    from services.controller.correction_book import behind

    run_id, cfg = _run_with_corrections(done=1, failed=0)
    with session_scope() as s:  # three more well-formed steps, their corrections not in yet
        ep = open_episode(s, run_id, 1, 0, 0)
        more = []
        for i in range(3):
            step = add_step(
                s,
                blob_store(),
                run_id=run_id,
                episode_id=ep.episode_id,
                idx=i,
                update_idx=0,
                rollout_pos=1 + i,
                prompt="p",
                output=AGENT,
                format_valid=True,
                action_valid=True,
                reward=0.0,
                done=False,
                state={"current": 2, "target": 4},
            )
            s.flush()
            more.append(step.id)
    why = behind(run_id, 0, 0.9, None)
    assert why == "1 of 4 corrections done, under corrector.min_coverage = 0.9"
    assert behind(run_id, 0, 0.2, None) is None  # 25 % done is enough for 0.2
    assert (
        behind(run_id, 0, 0.0, 0)
        == "3 corrections older than corrector.max_lag_updates = 0 missing"
    )
    record_missing_as_failed(run_id, more, "oracle", 60.0, set(more), "late: the run ended")
    assert behind(run_id, 0, 0.9, 0) is None  # nothing left to wait for
    strict = RunConfig.model_validate(
        {"task": "numberline", "corrector": {"min_coverage": 0.9, "degraded_share": 0.5}}
    )
    with session_scope() as s:
        status, error = CS.final_status(s, run_id, strict, "completed", None)
    assert status == "degraded"
    assert error == (
        "degraded: 1 of 4 requested corrections done (25%, under corrector.min_coverage = 0.9)"
    )
    assert _end(run_id, cfg) == "completed"  # no min_coverage: 3 late are no failures
