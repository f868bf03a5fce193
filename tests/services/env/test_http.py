"""The env service over real HTTP (uvicorn in a thread): same episodes as EnvPool, clean 4xx."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from services.env import EnvPool
from services.env.app import create_app
from services.env.client import EnvClient
from services.env.expert import expert_output, format_output
from services.env.service import EnvError, PoolFull, SessionNotFound
from tests.conftest import live_server


@pytest.fixture(scope="module")
def base_url():  # noqa: ANN201 - a generator fixture
    with live_server(create_app(EnvPool(max_sessions=6))) as url:
        yield url


def _same(a, b) -> None:  # noqa: ANN001 - two StepResults
    assert (a.reward, a.terminated, a.truncated, a.done, a.action) == (
        b.reward,
        b.terminated,
        b.truncated,
        b.done,
        b.action,
    )
    assert (a.episode_return, a.episode_length, a.success, a.final_state) == (
        b.episode_return,
        b.episode_length,
        b.success,
        b.final_state,
    )
    assert a.parsed == b.parsed
    assert (
        a.observation.prompt == b.observation.prompt and a.observation.state == b.observation.state
    )
    assert np.array_equal(a.observation.image, b.observation.image)


@pytest.mark.parametrize("task", ["points24", "blackjack"])
def test_rest_episode_equals_pool_episode(base_url: str, task: str) -> None:
    pool = EnvPool()
    with EnvClient(base_url) as client:
        cfg = {"image_size": 64}
        ids = client.create(task, cfg, seed=21), pool.create(task, cfg, seed=21)
        obs_c, obs_p = client.reset(ids[0]), pool.reset(ids[1])
        assert obs_c.state == obs_p.state and obs_c.prompt == obs_p.prompt
        assert np.array_equal(obs_c.image, obs_p.image) and obs_c.image.dtype == np.uint8
        done_seen = 0
        for i in range(14):
            # Expert outputs, with junk every third step (a seeded random action on both sides).
            text = "junk" if i % 3 == 2 else format_output(expert_output(task, obs_p.state))
            rc, rp = client.step(ids[0], text), pool.step(ids[1], text)
            _same(rc, rp)
            done_seen += rp.done
            obs_p = rp.observation
        assert done_seen >= 1
        batch_c = client.step_batch([(ids[0], "junk")])
        _same(batch_c[0], pool.step_batch([(ids[1], "junk")])[0])
        client.close(ids[0])
        with pytest.raises(SessionNotFound):
            client.step(ids[0], "junk")


def test_raw_and_png_frames_carry_the_same_pixels(base_url: str) -> None:
    with EnvClient(base_url, frames="raw") as raw, EnvClient(base_url, frames="png") as png:
        cfg = {"image_size": 64}
        ids = raw.create("points24", cfg, seed=5), png.create("points24", cfg, seed=5)
        assert np.array_equal(raw.reset(ids[0]).image, png.reset(ids[1]).image)
        a, b = raw.step_batch([(ids[0], "junk")])[0], png.step_batch([(ids[1], "junk")])[0]
        assert a.observation.image.dtype == np.uint8 and a.observation.image.shape == (64, 64, 3)
        assert np.array_equal(a.observation.image, b.observation.image)
    r = httpx.post(f"{base_url}/envs", json={"task": "numberline"}, headers={"X-GTR-Frames": "raw"})
    assert r.status_code == 201
    obs = r.json()["observation"]
    assert obs["image_png_b64"] is None and obs["image_raw"].startswith("raw:")


def test_client_errors_match_the_pool(base_url: str) -> None:
    with EnvClient(base_url) as client:
        with pytest.raises(EnvError):
            client.create("numberline", {"image_size": 5})
        with pytest.raises(SessionNotFound):
            client.reset("nope")
        sid = client.create("ezpoints", seed=1)
        with pytest.raises(EnvError):
            client.reset(sid, options={"cards": ["H4"]})
        assert client.reset(sid, options={"cards": ["H4", "S3"]}).state["numbers"] == [4, 3]
        client.set_target_formula(sid, "4*3")
        assert client.describe(sid)["task"] == "ezpoints"
        client.close(sid)


def test_status_codes(base_url: str) -> None:
    with httpx.Client(base_url=base_url) as http:
        assert http.get("/healthz").json()["status"] == "ok"
        assert http.post("/envs", json={"task": "chess"}).status_code == 422
        assert (
            http.post(
                "/envs", json={"task": "numberline", "config": {"invalid_action": "x"}}
            ).status_code
            == 422
        )
        assert http.post("/envs", json={"task": "numberline", "seed": -3}).status_code == 422
        assert (
            http.post(
                "/envs", content=b"{not json", headers={"content-type": "application/json"}
            ).status_code
            == 422
        )
        assert http.post("/envs/nope/step", json={"output": "x"}).status_code == 404
        assert http.delete("/envs/nope").status_code == 404
        created = http.post("/envs", json={"task": "numberline", "seed": 2})
        assert created.status_code == 201
        sid = created.json()["id"]
        assert created.json()["action_names"] == ["-", "+"]
        assert http.post(f"/envs/{sid}/step", json={"action": "jump"}).status_code == 422
        assert http.post(f"/envs/{sid}/step", json={}).status_code == 422
        assert http.post(f"/envs/{sid}/step", json={"action": "+"}).status_code == 200
        assert (
            http.post(
                "/envs/step",
                json={"steps": [{"id": sid, "output": "+"}, {"id": "nope", "output": "+"}]},
            ).status_code
            == 404
        )
        assert http.put(f"/envs/{sid}/target_formula", json={"formula": "x"}).status_code == 422
        assert http.delete(f"/envs/{sid}").status_code == 204


def test_full_pool_is_429() -> None:
    with live_server(create_app(EnvPool(max_sessions=1))) as url, EnvClient(url) as client:
        client.create("numberline")
        with pytest.raises(PoolFull, match="GTR_ENV_MAX_SESSIONS"):
            client.create("numberline")
        full = httpx.post(f"{url}/envs", json={"task": "numberline"})
        assert full.status_code == 429 and "1 sessions" in full.json()["detail"]
