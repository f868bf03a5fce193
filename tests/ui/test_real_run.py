"""The pages on a run the platform really trained (not seeded rows): curves, a corrected step's
diff and image."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from sqlalchemy import select

from services.api.auth import create_token
from services.api.service import create_run
from services.controller.backends import InProcessPolicy, InProcessTrainer, ThreadCorrections
from services.controller.service import RunDriver
from services.env import EnvPool
from shared.db.models import Correction
from shared.db.session import session_scope
from shared.schemas import RunConfig
from shared.settings import get_settings
from tests.e2e.helpers import tiny_config
from tests.ui.conftest import login, shot

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained_run(pg_url: str, warm_checkpoint: Path) -> dict:
    cfg = RunConfig.model_validate(
        tomllib.loads(tiny_config(warm_checkpoint, envs=4, steps=4, updates=2))
    )
    cfg = cfg.model_copy(update={"corrector": cfg.corrector.model_copy(update={"noise": 0.5})})
    with session_scope() as s:
        run_id = create_run(s, cfg, "real-ui").id
        token = create_token(s, "real-ui", "read", "real-ui")[1]
    corrections = ThreadCorrections("oracle", 0.5, 0, get_settings())
    driver = RunDriver(
        run_id, EnvPool(), InProcessPolicy(cfg.model), corrections, InProcessTrainer()
    )
    assert driver.run() == "completed"
    with session_scope() as s:
        corrected = s.scalars(
            select(Correction.step_id).where(
                Correction.run_id == run_id, Correction.verdict == "incorrect"
            )
        ).all()
    assert corrected, "a noisy oracle corrects some steps"
    return {"run_id": run_id, "token": token, "step_id": corrected[0]}


def test_real_run_pages(page, base_url: str, trained_run: dict) -> None:  # type: ignore[no-untyped-def]
    run_id = trained_run["run_id"]
    login(page, base_url, trained_run["token"], f"/runs/{run_id}")
    page.wait_for_selector("#charts[data-points]")
    assert page.get_attribute("#charts", "data-points") == "2"
    sizes = page.locator("#charts canvas").evaluate_all("cs => cs.map(c => c.width * c.height)")
    assert sizes and min(sizes) > 10_000
    shot(page, "real-run")
    page.goto(f"{base_url}/runs/{run_id}/steps/{trained_run['step_id']}")
    card = page.locator(".correction[data-verdict=incorrect]")
    assert card.count() == 1
    assert card.locator("pre.diff").locator("del, ins").count() >= 1
    page.wait_for_function("document.getElementById('observation').complete")
    assert page.eval_on_selector("#observation", "img => img.naturalWidth") == 320  # display frame
    shot(page, "real-step-corrected")
    assert not page.js_errors
