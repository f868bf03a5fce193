"""Security round 2 (issue #16) on the env, policy and corrector services: the service token,
the body limit, short error bodies, bounded env sessions, checkpoint loads confined to the store,
and the production check in every `serve` command. Real uvicorn servers and processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import uvicorn
from click.testing import CliRunner

from services.cli import main as cli
from services.controller.stack import stack_env
from services.corrector.app import create_app as corrector_app
from services.corrector.oracle import OracleCorrector
from services.env.app import create_app as env_app
from services.env.client import EnvClient
from services.env.service import EnvPool
from services.policy.app import create_app as policy_app
from services.policy.client import PolicyClient, PolicyServiceError
from services.policy.schemas import MAX_REQUEST_BYTES
from services.policy.service import Policy
from shared.paths import CHECKPOINT_NOT_FOUND
from shared.service_auth import MAX_BODY_BYTES
from shared.settings import Settings, get_settings
from tests.conftest import live_server

TOKEN = "svc-" + "k" * 40
WRONG = {"Authorization": "Bearer " + "w" * 44}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _settings(tmp: Path | None = None, **kw) -> Settings:  # type: ignore[no-untyped-def]
    return Settings(service_token=TOKEN, checkpoint_dir=tmp, checkpoint_roots=[], **kw)  # type: ignore[arg-type]


def _short_error(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, (r.status_code, r.text[:300])
    assert len(r.content) < 2000 and "Traceback" not in r.text, r.text[:300]


def test_the_env_service_requires_the_token_limits_bodies_and_sessions() -> None:
    settings = _settings(env_max_sessions=2, env_max_image_size=256)
    pool = EnvPool(max_sessions=2, ttl_s=60, max_image_size=256)
    with live_server(env_app(pool, settings)) as url:
        body = {"task": "numberline", "seed": 1, "config": {"image_size": 64}}
        assert httpx.get(f"{url}/healthz").status_code == 200  # probes need no token
        for headers in ({}, WRONG):
            r = httpx.post(f"{url}/envs", json=body, headers=headers)
            _short_error(r, 401)
        assert len(pool) == 0
        r = httpx.post(f"{url}/envs", json=body, headers=AUTH)
        assert r.status_code == 201, r.text
        _short_error(
            httpx.post(f"{url}/envs", content=b"x" * (MAX_BODY_BYTES + 1), headers=AUTH), 413
        )
        # A huge invalid field is named, never echoed back.
        huge = {"task": "numberline", "seed": "9" * 1_000_000}
        _short_error(httpx.post(f"{url}/envs", json=huge, headers=AUTH), 422)
        step = {"action": "x" * 900}
        _short_error(httpx.post(f"{url}/envs/{r.json()['id']}/step", json=step, headers=AUTH), 422)
        big = {**body, "config": {"image_size": 1024}}
        r = httpx.post(f"{url}/envs", json=big, headers=AUTH)
        _short_error(r, 422)
        assert "GTR_ENV_MAX_IMAGE_SIZE" in r.json()["detail"]
        deep = {
            **body,
            "config": {
                "options": {
                    "a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
                }
            },
        }
        _short_error(httpx.post(f"{url}/envs", json=deep, headers=AUTH), 422)
        with EnvClient(url, token=TOKEN) as client:  # the controller's client sends the token
            client.create("numberline", {"image_size": 64}, seed=2)
            with pytest.raises(Exception, match="429"):
                client.create("numberline", {"image_size": 64}, seed=3)
        with EnvClient(url, token="") as anonymous, pytest.raises(Exception, match="401"):
            anonymous.create("numberline", {"image_size": 64}, seed=4)


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path) -> Policy:
    return Policy.load(tiny_model_dir, lora_r=4)


def test_the_policy_service_loads_checkpoints_only_from_its_store(
    policy: Policy, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    policy.save(store / "run-7" / "update-0")
    policy.save(tmp_path / "elsewhere" / "ckpt")  # a real checkpoint outside the store
    app = policy_app(policy, settings=_settings(store))
    with live_server(app) as url:
        _short_error(httpx.post(f"{url}/checkpoints/load", json={"path": "run-7/update-0"}), 401)
        with PolicyClient(url, token=TOKEN) as client:
            client.load_weights("run-7/update-0")  # by id in the store
            assert client.weights()["checkpoint"] == str((store / "run-7" / "update-0").resolve())
            client.load_weights(store / "run-7" / "update-0")  # or by its path there
            answers = set()
            for path in [
                tmp_path / "elsewhere" / "ckpt",  # exists, not allowed
                tmp_path / "missing",
                "run-7/update-0/../../../elsewhere/ckpt",
                "/etc",
                "c" * 1000,  # was a 500 (file name too long)
            ]:
                with pytest.raises(PolicyServiceError) as e:
                    client.load_weights(path)
                assert e.value.status_code == 404
                answers.add(str(e.value).split("404: ", 1)[1])
            assert answers == {f'{{"detail":"{CHECKPOINT_NOT_FOUND}"}}'}  # one text for all
        r = httpx.post(f"{url}/checkpoints/load", json={"path": "p" * 100_000}, headers=AUTH)
        _short_error(r, 422)
        _short_error(
            httpx.post(f"{url}/generate", content=b"{" * (MAX_REQUEST_BYTES + 10), headers=AUTH),
            413,
        )


def test_the_corrector_service_requires_the_token_and_refuses_partial_states() -> None:
    with live_server(corrector_app(OracleCorrector(), "oracle", settings=_settings())) as url:
        req = {"task": "points24", "prompt": "p", "output": "{}", "state": {"target": 24}}
        _short_error(httpx.post(f"{url}/v1/correct", json=req), 401)
        r = httpx.post(f"{url}/v1/correct", json=req, headers=AUTH)  # was a 500 (KeyError)
        _short_error(r, 422)
        assert r.json()["detail"]["kind"] == "input" and "points24" in r.json()["detail"]["reason"]
        _short_error(httpx.post(f"{url}/v1/correct", json={**req, "prompt": 5}, headers=AUTH), 422)


def test_gtr_up_hands_every_part_one_service_token() -> None:
    urls = {"env": "http://127.0.0.1:1", "policy": "http://127.0.0.1:2"}
    fresh = stack_env(urls, Settings())
    assert len(fresh["GTR_SERVICE_TOKEN"]) >= 32
    assert stack_env(urls, Settings())["GTR_SERVICE_TOKEN"] != fresh["GTR_SERVICE_TOKEN"]
    assert stack_env(urls, _settings())["GTR_SERVICE_TOKEN"] == TOKEN  # the operator's wins


@pytest.mark.parametrize(
    "args",
    [
        ["serve"],
        ["env", "serve"],
        ["policy", "serve", "--model", "."],
        ["corrector", "serve"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_every_serve_command_refuses_production_without_secrets(
    args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[object] = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: started.append(a))  # never listen here
    for name in [n for n in os.environ if n.startswith("GTR_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("GTR_ENVIRONMENT", "Production")  # any spelling counts
    monkeypatch.setenv("GTR_SECRET_KEY", "short")
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(cli, args)
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()
    assert result.exit_code != 0 and not started, result.output
    assert "GTR_SECRET_KEY must be set" in result.output, result.output
    assert not isinstance(result.exception, ValueError), result.exception  # a message, no trace


@pytest.mark.parametrize(
    "args",
    [["up"], ["train", "configs/numberline-tiny.toml"], ["policy", "serve", "--model", "."]],
    ids=lambda a: " ".join(a[:2]),
)
def test_a_setting_that_does_not_parse_is_named_not_traced(args: list[str]) -> None:
    """A GTR_ variable the settings cannot read stops any command with its name and why."""
    env = {**os.environ, "GTR_POLICY_HOSTS_ENVS": "maybe", "GTR_ENV_MAX_SESSIONS": "lots"}
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "GTR_POLICY_HOSTS_ENVS: Input should be a valid boolean" in done.stderr, done.stderr
    assert "GTR_ENV_MAX_SESSIONS: Input should be a valid integer" in done.stderr, done.stderr
