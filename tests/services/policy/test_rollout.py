"""``POST /rollout``: the policy service runs the rollout loop against a real env service (both
served by uvicorn), and its steps are the ones the controller's own loop takes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from services.controller.outages import is_interruption
from services.env import EnvPool
from services.env.app import create_app as env_app
from services.env.client import EnvClient, EnvServiceError
from services.env.service import EnvError, SessionNotFound
from services.policy.app import create_app as policy_app
from services.policy.client import PolicyClient, PolicyServiceError, ndjson_lines
from services.policy.rollout import RolloutStep, roll
from services.policy.routes import _step_line
from services.policy.schemas import Generation
from services.policy.service import Policy
from shared.settings import Settings
from tests.conftest import free_port, live_server

GREEDY = {"greedy": True, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def policy(tiny_path: Callable[[str], Path]) -> Policy:
    return Policy.load(tiny_path("llava"), lora_r=4)


@pytest.fixture(scope="module")
def services(policy: Policy) -> Iterator[dict[str, str]]:
    """An env service, and a policy service that steps it."""
    with live_server(env_app(EnvPool(), settings=Settings())) as env_url:
        app = policy_app(policy, settings=Settings(env_service_url=env_url))
        with live_server(app) as policy_url:
            yield {"env": env_url, "policy": policy_url}


def _open(envs: EnvClient | EnvPool, n: int, seed: int = 7) -> tuple[list[str], list, list[str]]:
    sids = [envs.create("numberline", {"image_size": 64}, seed=seed + i) for i in range(n)]
    obs = [envs.reset(s) for s in sids]
    return sids, [o.image for o in obs], [o.prompt for o in obs]


def test_the_service_takes_the_steps_the_controllers_loop_takes(
    services: dict[str, str], policy: Policy
) -> None:
    """Greedy decoding: the same deals give the same outputs, rewards and next observations
    through POST /rollout as through ``roll`` in this process over a local EnvPool."""
    with EnvClient(services["env"]) as envs, PolicyClient(services["policy"]) as client:
        assert client.stats()["env_service"] == envs.base_url
        sids, images, prompts = _open(envs, 3)
        remote = list(client.rollout(sids, images, prompts, 4, GREEDY))
    pool = EnvPool()
    local_sids, local_images, local_prompts = _open(pool, 3)
    local = list(roll(policy, pool, local_sids, local_images, local_prompts, 4, GREEDY))
    assert len(remote) == len(local) == 4
    for r, lo in zip(remote, local, strict=True):
        assert [g.text for g in r.generations] == [g.text for g in lo.generations]
        assert [g.token_ids for g in r.generations] == [g.token_ids for g in lo.generations]
        assert [x.reward for x in r.results] == [x.reward for x in lo.results]
        assert [x.parsed.thought for x in r.results] == [x.parsed.thought for x in lo.results]
        for a, b in zip(r.results, lo.results, strict=True):
            assert a.observation.prompt == b.observation.prompt
            assert np.array_equal(a.observation.image, b.observation.image)
            assert a.observation.state == b.observation.state
        assert r.generate_s > 0 and r.env_s > 0


def test_a_step_that_fails_raises_what_the_call_would_have(services: dict[str, str]) -> None:
    with EnvClient(services["env"]) as envs, PolicyClient(services["policy"]) as client:
        sids, images, prompts = _open(envs, 2)
        with pytest.raises(SessionNotFound, match="unknown session"):
            list(client.rollout([sids[0], "no-such-session"], images, prompts, 3, GREEDY))
        # A bad request is refused before anything is stepped.
        with pytest.raises(PolicyServiceError, match="1 sessions for 2 prompts") as e:
            list(client.rollout(sids[:1], images, prompts, 3, GREEDY))
        assert e.value.status_code == 422
        for body, text in [
            ({"steps": 0}, "steps"),
            ({"steps": 10**6}, "steps"),
            ({"temperature": 0}, "temperature"),
        ]:
            with pytest.raises(PolicyServiceError, match=text):
                list(client.rollout(sids, images, prompts, body.pop("steps", 2), body))
        # The service still serves, and the sessions are where they were.
        assert len(list(client.rollout(sids, images, prompts, 1, GREEDY))) == 1


def test_without_an_env_service_or_with_one_down(policy: Policy) -> None:
    images, prompts = [np.zeros((64, 64, 3), np.uint8)], ["current number 3, target 5"]
    with live_server(policy_app(policy, settings=Settings())) as url, PolicyClient(url) as client:
        assert client.stats()["env_service"] is None
        with pytest.raises(PolicyServiceError, match="GTR_ENV_SERVICE_URL") as e:
            list(client.rollout(["s"], images, prompts, 1, GREEDY))
        assert e.value.status_code == 409
    dead = f"http://127.0.0.1:{free_port()}"
    app = policy_app(policy, settings=Settings(env_service_url=dead))
    with live_server(app) as url, PolicyClient(url) as client:
        with pytest.raises(EnvServiceError, match="does not answer") as down:
            list(client.rollout(["s"], images, prompts, 1, GREEDY))
        assert down.value.status_code == 503
        assert is_interruption(down.value)  # the run waits for the env service to come back


def test_a_seeded_rollout_samples_step_t_with_seed_plus_t(
    services: dict[str, str], policy: Policy
) -> None:
    """Sampled, not greedy: each step of a seeded rollout is what ``generate`` samples on that
    step's observations with ``seed + t`` (the same seed every step would repeat its draws)."""
    params = {"max_new_tokens": 12, "temperature": 1.0, "seed": 1234}
    with EnvClient(services["env"]) as envs, PolicyClient(services["policy"]) as client:
        sids, images, prompts = _open(envs, 2)
        steps = list(client.rollout(sids, images, prompts, 3, params))
    for t, step in enumerate(steps):
        alone = policy.generate(images, prompts, **{**params, "seed": 1234 + t})
        assert [g.token_ids for g in step.generations] == [g.token_ids for g in alone]
        images = [r.observation.image for r in step.results]
        prompts = [r.observation.prompt for r in step.results]


def test_leaving_the_stream_stops_the_services_loop(services: dict[str, str]) -> None:
    stats = f"{services['policy']}/stats"
    with EnvClient(services["env"]) as envs, PolicyClient(services["policy"]) as client:
        sids, images, prompts = _open(envs, 2)
        before = httpx.get(stats).json()["samples"]
        steps = client.rollout(sids, images, prompts, 200, {"max_new_tokens": 8})
        next(steps)
        steps.close()
        time.sleep(1.0)
        settled = httpx.get(stats).json()["samples"]
        time.sleep(1.0)
        after = httpx.get(stats).json()["samples"]
    assert after == settled  # nothing generates any more
    assert (after - before) // 2 < 10  # a step or two past the one taken, not 200


def test_a_generated_text_with_line_separators_stays_on_its_line() -> None:
    """JSON leaves U+2028, U+0085, \\x0b... unescaped in a string; a model may write them."""
    pool = EnvPool()
    sid = pool.create("numberline", {"image_size": 64}, 1)
    pool.reset(sid)
    text = 'a\u2028b\x85c\rd\x0be\x1cf"<script>'
    gen = Generation(text, [1, 2], [-0.1, -0.2], 0.5, [True, False], [False, True], [1.0, 1.0])
    step = RolloutStep([gen], pool.step_batch([(sid, text)]), 0.1, 0.01)
    body = (_step_line(step) * 3).encode()
    for size in (1, 7, 4096, len(body)):
        chunks = [body[i : i + size] for i in range(0, len(body), size)]
        lines = [json.loads(line) for line in ndjson_lines(chunks)]
        assert [x["generations"][0]["text"] for x in lines] == [text] * 3
        assert lines[0]["results"][0]["parsed"]["thought"] is None  # not JSON: no thought


def test_a_service_that_hosts_envs_steps_them_in_process(policy: Policy) -> None:
    """GTR_POLICY_HOSTS_ENVS: the env routes under /env of the policy service, and a rollout
    that steps its sessions there takes the steps ``roll`` takes in this process."""
    app = policy_app(policy, settings=Settings(policy_hosts_envs=True))
    with live_server(app) as url, PolicyClient(url) as client:
        with EnvClient(f"{url}/env") as envs:
            hosted = client.stats()
            assert hosted["env_pool"] == envs.pool_id() and hosted["env_service"] is None
            assert client.steps_envs_of(envs)
            sids, images, prompts = _open(envs, 2)
            remote = list(client.rollout(sids, images, prompts, 3, GREEDY))
            # The env routes answer bad input as the env service does, through this service.
            with pytest.raises(EnvError, match="422: .*Input should be 'numberline'"):
                envs.create("nope")
            with pytest.raises(SessionNotFound, match="unknown session"):
                list(client.rollout([sids[0], "no-such"], images, prompts, 1, GREEDY))
        # Another env service's sessions are not this pool's: the controller keeps its own loop.
        with live_server(env_app(EnvPool(), settings=Settings())) as other:
            with EnvClient(other) as elsewhere:
                assert not client.steps_envs_of(elsewhere)
    pool = EnvPool()
    local = list(roll(policy, pool, *_open(pool, 2), 3, GREEDY))
    for r, lo in zip(remote, local, strict=True):
        assert [g.token_ids for g in r.generations] == [g.token_ids for g in lo.generations]
        assert [x.reward for x in r.results] == [x.reward for x in lo.results]
        for a, b in zip(r.results, lo.results, strict=True):
            assert np.array_equal(a.observation.image, b.observation.image)
        assert r.env_s > 0


def test_hosted_envs_take_the_service_token_and_leave_the_probe_open(policy: Policy) -> None:
    settings = Settings(policy_hosts_envs=True, service_token="s3cret-token")
    with live_server(policy_app(policy, settings=settings)) as url:
        assert httpx.get(f"{url}/env/healthz").status_code == 200  # a pod's probe
        refused = httpx.post(f"{url}/env/envs", json={"task": "numberline"})
        assert refused.status_code == 401 and "GTR_SERVICE_TOKEN" in refused.json()["detail"]
        with EnvClient(f"{url}/env", token="s3cret-token") as envs:
            sid = envs.create("numberline", {"image_size": 64}, seed=1)
            # A crafted task name is refused as any other unknown one: a JSON detail, a 422.
            with pytest.raises(EnvError, match="422: .*Input should be 'numberline'"):
                envs.create('"><script>alert(1)</script>')
            assert envs.describe(sid)["task"] == "numberline"  # what was open stays open
        docs = httpx.get(f"{url}/openapi.json", headers={"Authorization": "Bearer s3cret-token"})
        assert "/env/envs/step" in docs.json()["paths"]
