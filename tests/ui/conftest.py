"""Browser fixtures: the seeded database, the app under uvicorn, and Debian's Chromium (the
really trained run, ``real_run``, is a session fixture of tests/conftest.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import RealRun as RealRun  # kept importable from here
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


# One browser per test file, not per session: Playwright's sync API keeps an asyncio loop
# running in this thread while it is started, and under pytest-xdist a later file of the same
# worker (tests/services/policy/test_app.py) calls asyncio.run, which refuses a running loop.
@pytest.fixture(scope="module")
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


@pytest.fixture(scope="session")
def v3_study(pg_url: str) -> tuple[int, str]:
    """The v3 study (docs/results/v3/study.json.gz: 63 finished runs) imported with the
    product's importer into a team of its own, and a read token of that team."""
    from services.api.auth import create_token
    from services.study.bundle import import_study, read_bundle
    from shared.db.session import session_scope

    bundle = read_bundle(Path(__file__).resolve().parents[2] / "docs/results/v3/study.json.gz")
    with session_scope(pg_url) as s:
        study_id = import_study(s, bundle, team="v3-ui").study_id
        token = create_token(s, "v3-ui-read", "read", "v3-ui")[1]
    return study_id, token


@pytest.fixture(scope="session")
def v4_study(pg_url: str) -> tuple[int, str]:
    """The v4 study (docs/results/v4/study.json.gz: its tuning stage and the grid's finished
    runs) imported as `gtr study import` does (the study, then its stage into this store's
    Optuna storage) into a team of its own, and a read token of that team."""
    from services.api.auth import create_token
    from services.study.bundle import import_study, read_bundle
    from services.study.tuning_carry import install_stage
    from shared.db.session import session_scope

    bundle = read_bundle(Path(__file__).resolve().parents[2] / "docs/results/v4/study.json.gz")
    with session_scope(pg_url) as s:
        got = import_study(s, bundle, team="v4-ui")
        token = create_token(s, "v4-ui-read", "read", "v4-ui")[1]
    assert got.spec is not None
    install_stage(got.spec, got.study_id, got.tuning)
    return got.study_id, token
