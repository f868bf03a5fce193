"""`gtr train` refuses a corrector it could never call before a run row exists: one that
nothing answers at, and one on loopback while GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS is off."""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.cli import main
from services.controller.preflight import PreflightError, preflight
from shared.schemas import RunConfig
from shared.settings import get_settings
from tests.services.controller.test_preflight import _runs_named
from tests.services.corrector.conftest import FakeOpenAI

INLINE = """name = "{name}"
task = "numberline"
[corrector]
kind = "openai"
base_url = "{url}"
model = "m"
"""


@pytest.fixture
def live() -> Iterator[FakeOpenAI]:
    fake = FakeOpenAI()
    threading.Thread(target=fake.server.serve_forever, args=(0.05,), daemon=True).start()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str) -> tuple[str, str]:
    name = f"preflight-{uuid.uuid4().hex[:8]}"
    (tmp_path / "run.toml").write_text(INLINE.format(name=name, url=url))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["train", "run.toml"])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: ") and "Traceback" not in result.output
    return name, result.output


def test_a_corrector_nothing_answers_at_is_refused_before_a_run_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str
) -> None:
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    name, output = _train(tmp_path, monkeypatch, url)
    assert f"corrector 'inline' at {url} cannot be reached (ConnectError" in output
    assert _runs_named(name) == 0


def test_a_loopback_corrector_needs_the_private_networks_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str, live: FakeOpenAI
) -> None:
    monkeypatch.setenv("GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS", "false")
    get_settings.cache_clear()
    try:
        name, output = _train(tmp_path, monkeypatch, live.url)
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
    assert "loopback, private, link-local or reserved" in output
    assert "GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS=true" in output
    assert _runs_named(name) == 0 and live.requests == []


def test_a_reachable_corrector_passes_registered_or_inline(pg_url: str, live: FakeOpenAI) -> None:
    from services.corrector.registry import create_corrector
    from services.corrector.schemas import CorrectorCreate
    from shared.db.session import session_scope

    inline = {"kind": "openai", "base_url": live.url, "model": "m"}
    preflight(RunConfig.model_validate({"task": "numberline", "corrector": inline}))
    name = f"reach-{uuid.uuid4().hex[:8]}"
    gone = f"http://127.0.0.1:{_closed_port()}/v1"
    with session_scope() as s:
        body = CorrectorCreate(name=name, kind="openai", base_url=gone, model="m")
        create_corrector(s, body, "default", get_settings())
    with pytest.raises(PreflightError, match=f"corrector '{name}' at {gone} cannot be reached"):
        preflight(RunConfig.model_validate({"task": "numberline", "corrector": {"name": name}}))
    # No corrector at all (RL4VLM): nothing to reach.
    preflight(RunConfig.model_validate({"task": "numberline", "algorithm": "rl4vlm"}))
