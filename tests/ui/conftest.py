"""Browser fixtures: the seeded database, the app under uvicorn, and Debian's Chromium."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import live_server, need
from tests.ui.seed import Seeded, seed_demo

CHROMIUM = Path(os.environ.get("GTR_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(__file__).parent / "artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]


@pytest.fixture(scope="session")
def seeded(pg_url: str) -> Seeded:
    """The demo runs, written once for the whole UI session."""
    from shared.db.session import session_scope

    with session_scope(pg_url) as session:
        return seed_demo(session)


@pytest.fixture(scope="session")
def base_url(seeded: Seeded) -> Iterator[str]:
    from services.api.app import create_app

    with live_server(create_app()) as url:
        yield url


@pytest.fixture(scope="session")
def browser() -> Iterator:
    need(CHROMIUM.exists(), f"Chromium is not installed at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser) -> Iterator:  # type: ignore[no-untyped-def]
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.js_errors = errors
    yield page
    context.close()


def login(page, base_url: str, token: str, next_path: str = "/runs") -> None:  # type: ignore[no-untyped-def]
    """Log in through the form, as a person would."""
    page.goto(f"{base_url}{next_path}")
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_load_state("networkidle")


def shot(page, name: str) -> Path:  # type: ignore[no-untyped-def]
    """Save a full-page screenshot as a test artefact."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


@dataclass
class RealRun:
    """A short run the platform really trained (embedded: envs, policy, trainer, a noisy
    oracle), shared by the UI tests that need what a run writes."""

    run_id: int
    read_token: str
    write_token: str
    corrected_step_ids: list[int]
    episodes: int


@pytest.fixture(scope="session")
def real_run(pg_url: str, warm_checkpoint: Path) -> RealRun:
    """Two updates of 4 envs x 4 steps from the session's warm checkpoint (a few seconds)."""
    import tomllib

    from sqlalchemy import func, select

    from services.api.auth import create_token
    from services.api.service import create_run
    from services.controller.backends import (
        InProcessPolicy,
        InProcessTrainer,
        ThreadCorrections,
    )
    from services.controller.service import RunDriver
    from services.env import EnvPool
    from shared.db.models import Correction, Episode
    from shared.db.session import session_scope
    from shared.schemas import RunConfig
    from shared.settings import get_settings
    from tests.e2e.helpers import tiny_config

    cfg = RunConfig.model_validate(
        tomllib.loads(tiny_config(warm_checkpoint, envs=4, steps=4, updates=2))
    )
    cfg = cfg.model_copy(
        update={
            "name": "real-tiny-run",
            "corrector": cfg.corrector.model_copy(update={"noise": 0.5}),
            "metrics": cfg.metrics.model_copy(update={"eval_episodes": 2}),
        }
    )
    with session_scope() as s:
        run_id = create_run(s, cfg, "real-ui").id
        read = create_token(s, "real-ui-read", "read", "real-ui")[1]
        write = create_token(s, "real-ui-write", "write", "real-ui")[1]
    corrections = ThreadCorrections("oracle", 0.5, 0, get_settings())
    driver = RunDriver(
        run_id, EnvPool(), InProcessPolicy(cfg.model), corrections, InProcessTrainer()
    )
    assert driver.run() == "completed"
    with session_scope() as s:
        corrected = s.scalars(
            select(Correction.step_id)
            .where(Correction.run_id == run_id, Correction.verdict == "incorrect")
            .order_by(Correction.step_id)
        ).all()
        episodes = s.scalar(select(func.count()).where(Episode.run_id == run_id)) or 0
    assert corrected, "a noisy oracle corrects some steps"
    return RealRun(run_id, read, write, list(corrected), int(episodes))
