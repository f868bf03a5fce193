"""Every step corrected at a real corrector's latency (issue 53): ``gtr train`` of the tiny
NumberLine preset's rollout (16 envs x 8 steps an update) against a real HTTP corrector that
answers in 2 s gets its steps corrected and exits 0, and the run page shows the coverage and the
lag while the run goes; against an endpoint that answers 503 to everything the run ends
degraded, exits 1 and says why."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from services.api.app import create_app
from services.api.auth import create_token
from shared.db.models import Run
from shared.db.session import session_scope
from tests.conftest import live_server
from tests.e2e.helpers import ROOT

PRESET = ROOT / "configs" / "numberline-tiny.toml"


@contextmanager
def corrector(delay_s: float, status: int = 200) -> Iterator[str]:
    """A real `POST /v1/correct` server on loopback: 'correct' after ``delay_s``, or ``status``."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.post("/v1/correct")
    async def correct(body: dict) -> JSONResponse:  # type: ignore[type-arg]
        await asyncio.sleep(delay_s)
        if status != 200:
            return JSONResponse({"detail": "overloaded"}, status_code=status)
        answer = {"verdict": "correct", "corrected_thought": None, "extras": {}, "reasoning": ""}
        return JSONResponse(answer)

    with live_server(app) as url:
        yield url


def preset(checkpoint: Path, url: str, name: str, updates: int, **corrector: object) -> str:
    """The preset's run, from the suite's warm checkpoint (its own warm start takes minutes),
    with few evaluation episodes and probe states, against the corrector at ``url``."""
    cfg = tomllib.loads(PRESET.read_text())
    assert cfg["train"]["num_envs"] == 16 and cfg["train"]["num_steps"] == 8
    lines = [
        f'name = "{name}"\ntask = "numberline"\nalgorithm = "gtr"\nseed = 0',
        "[env]\nimage_size = 64",
        '[model]\nimage_size = 64\nfinetune = "full"',
        "[generation]\ntemperature = 1.0\nmax_new_tokens = 48",
        f'[init]\nkind = "checkpoint"\ncheckpoint = "{checkpoint}"',
        "[train]\n"
        + "\n".join(f"{k} = {v!r}" for k, v in cfg["train"].items() if k != "lr_schedule"),
        f'[corrector]\nname = "slow"\nkind = "http"\nbase_url = "{url}"\nwait = "none"',
        "\n".join(f"{k} = {v!r}" for k, v in corrector.items()),
        "[metrics]\nprobe_states = 4\neval_episodes = 0",
    ]
    text = "\n".join(lines).replace("'", '"')
    return re.sub(r"num_updates = \d+", f"num_updates = {updates}", text)


def _train(config: Path, tmp_path: Path, db: str) -> subprocess.Popen[str]:
    """`gtr train`, every part in its process, on the test database (so the API reads it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    env |= {
        "GTR_DATA_DIR": str(tmp_path / "gtr-data"),
        "GTR_DATABASE_URL": db,
        "GTR_TORCH_THREADS": "1",
        "GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS": "true",  # the corrector is on 127.0.0.1
    }
    return subprocess.Popen(
        [sys.executable, "-m", "services.cli", "train", str(config)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _train_here(config: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    """`gtr train` through the CLI's own group, in this process, embedded (no Redis) with its
    files beside ``config``, as ``_train``'s process: its exit code and output. The pytest
    worker has torch and transformers loaded already, which a fresh process spends most of a
    short run importing."""
    from click.testing import CliRunner

    from services.cli import main
    from shared.settings import get_settings

    monkeypatch.delenv("GTR_REDIS_URL", raising=False)
    monkeypatch.setenv("GTR_DATA_DIR", str(config.parent / "gtr-data"))
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(main, ["train", str(config)])
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def _run(name: str) -> Run | None:
    with session_scope() as s:
        return s.scalar(select(Run).where(Run.name == name))


@pytest.mark.slow
def test_a_2_s_corrector_corrects_the_preset_and_the_page_shows_coverage_live(
    pg_url: str, tmp_path: Path, warm_checkpoint: Path
) -> None:
    name = f"keeping-up-{uuid.uuid4().hex[:8]}"
    with session_scope() as s:
        token = create_token(s, "keeping-up", "read", "default")[1]
    with corrector(2.0) as url, live_server(create_app()) as api:
        (tmp_path / "run.toml").write_text(preset(warm_checkpoint, url, name, updates=6))
        proc = _train(tmp_path / "run.toml", tmp_path, pg_url)
        live: list[tuple[int, str]] = []  # (updates done, the coverage card) while it runs
        try:
            while proc.poll() is None:
                run = _run(name)
                if run is not None and run.status == "running" and run.updates_done >= 1:
                    page = httpx.get(
                        f"{api}/runs/{run.id}", headers={"Authorization": f"Bearer {token}"}
                    )
                    card = re.search(r'id="corrections-coverage".*?</div></div>', page.text, re.S)
                    if card and _run(name).status == "running":  # type: ignore[union-attr]
                        text = " ".join(re.sub(r"<[^>]+>", " ", card.group(0)).split())
                        live.append((run.updates_done, text))
                time.sleep(1.0)
            out = proc.communicate(timeout=60)[0]
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out[-4000:]
    run = _run(name)
    assert run is not None and run.status == "completed"
    got = run.info["corrections"]  # the coverage the run trained with, on its record
    asked = got["corrections"]
    assert asked >= 6 * 16 * 8 * 0.5  # most steps are well-formed: each one asked for
    assert got["corrections_done"] >= 0.95 * asked, got
    assert got["corrections_failed"] == 0 and "corrections_lag" in got
    assert re.search(r"corrections: \d+ done, 0 failed.*; coverage (9[5-9]|100)%", out), out[-3000:]
    # The page showed it while the run went: done of requested, and the lag in updates.
    assert live, "the run page never showed the coverage card while the run was running"
    early = [text for done, text in live if done < 6]
    assert early, live  # before the last update: while the run goes
    assert re.search(r"Corrections done \d+% \d+ of \d+ requested · \d+ pending", early[0])
    assert re.search(r"lag \d\.\d updates \(max \d\)", early[-1]), early


def test_an_endpoint_answering_503_to_everything_ends_the_run_degraded(
    pg_url: str, tmp_path: Path, warm_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = f"all-503-{uuid.uuid4().hex[:8]}"
    with corrector(0.0, status=503) as url:
        cfg = preset(warm_checkpoint, url, name, updates=1, drain_s=30)
        cfg = cfg.replace("num_envs = 16", "num_envs = 2").replace("num_steps = 8", "num_steps = 3")
        cfg = cfg.replace("[metrics]", "[corrector.params]\nmax_retries = 1\n[metrics]")
        (tmp_path / "run.toml").write_text(cfg)
        code, out = _train_here(tmp_path / "run.toml", monkeypatch)
    assert code == 1, out[-4000:]
    run = _run(name)
    assert run is not None and run.status == "degraded"
    assert run.error is not None and re.match(
        r"degraded: (\d+) of \1 requested corrections failed", run.error
    )
    assert "HTTP 503" in run.error  # why: the endpoint's answer, in the reason
    assert "HTTP 503" in out and "degraded" in out


def test_max_lag_0_makes_each_update_wait_for_its_own_corrections_and_watch_shows_them(
    pg_url: str, tmp_path: Path, warm_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounded staleness: with ``max_lag_updates = 0`` and a 1 s corrector under ``wait =
    "none"``, no update trains before its steps' corrections are in (lag 0 everywhere), and it
    says how long it waited; ``gtr run watch`` prints each update's coverage and lag."""
    from click.testing import CliRunner

    from services.controller.cli import run as run_cli
    from shared.db.models import Update

    name = f"lag-0-{uuid.uuid4().hex[:8]}"
    with corrector(1.0) as url:
        cfg = preset(warm_checkpoint, url, name, updates=2, max_lag_updates=0)
        cfg = cfg.replace("num_envs = 16", "num_envs = 4").replace("num_steps = 8", "num_steps = 3")
        (tmp_path / "run.toml").write_text(cfg)
        code, out = _train_here(tmp_path / "run.toml", monkeypatch)
    assert code == 0, out[-4000:]
    run = _run(name)
    assert run is not None
    with session_scope() as s:
        rows = s.scalars(select(Update).where(Update.run_id == run.id).order_by(Update.idx))
        metrics = [u.metrics for u in rows]
    assert len(metrics) == 2
    for m in metrics:
        assert m["corrections"] > 0 and m["corrections_done"] == m["corrections"], m
        assert m["corrections_lag_max"] == 0 and m["corrections_in_time"] == 1.0, m
        assert m["corrector_wait_s"] > 0.5, m  # the last step's corrections take 1 s
    with session_scope() as s:
        token = create_token(s, "lag-0", "read", "default")[1]
    with live_server(create_app()) as api:
        watched = CliRunner().invoke(
            run_cli, ["watch", str(run.id), "--url", api, "--token", token]
        )
    assert watched.exit_code == 0, watched.output
    n = int(metrics[0]["corrections"])
    assert f"corrections {n} of {n} (100%), lag 0.0" in watched.output, watched.output
