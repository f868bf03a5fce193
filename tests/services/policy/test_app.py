"""The policy service over real HTTP (uvicorn in a thread): batching, limits, checkpoints."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import uvicorn

from services.policy.app import create_app
from services.policy.client import PolicyClient, PolicyServiceError
from services.policy.schemas import MAX_REQUEST_BYTES, MAX_SAMPLES, encode_frame, encode_png
from services.policy.service import Policy
from shared.service_auth import MAX_BODY_BYTES
from tests.conftest import live_server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def served(tiny_path: Callable[[str], Path]) -> Iterator[tuple[Policy, str]]:
    policy = Policy.load(tiny_path("llava"), lora_r=4)
    app = create_app(policy, max_batch=16, max_wait_ms=100, max_image_side=128)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    yield policy, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _inputs(k: int, n: int) -> tuple[list[np.ndarray], list[str]]:
    rng = np.random.default_rng(k)
    images = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(n)]
    return images, [f"Caller {k} sample {i}: current number {k % 14}." for i in range(n)]


def test_concurrent_requests_are_batched_and_each_caller_gets_its_own(
    served: tuple[Policy, str],
) -> None:
    policy, url = served
    client = PolicyClient(url)
    before = client.stats()
    barrier = threading.Barrier(8)

    def call(k: int) -> list:
        images, prompts = _inputs(k, 1 + k % 3)
        barrier.wait()
        return client.generate(images, prompts, temperature=0.8, max_new_tokens=12)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(8)))
    after = client.stats()
    assert after["requests"] - before["requests"] == 8
    assert after["samples"] - before["samples"] == sum(1 + k % 3 for k in range(8))
    assert after["batches"] - before["batches"] < 8  # some requests shared a model call
    assert after["largest_batch"] > 3  # more than any single request holds
    for k, gens in enumerate(results):
        images, prompts = _inputs(k, 1 + k % 3)
        assert len(gens) == len(prompts)
        # Scored in-process against this caller's own inputs, the log-probs match.
        out = policy.score(images, prompts, [g.token_ids for g in gens], temperature=0.8)
        for i, g in enumerate(gens):
            n = len(g.token_ids)
            assert torch.allclose(out.logprobs[i, :n], torch.tensor(g.logprobs), atol=1e-4)


def test_more_samples_than_a_request_takes_go_as_several(served: tuple[Policy, str]) -> None:
    """A run may have up to 256 envs and the service takes MAX_SAMPLES a request: the client
    sends the rest as concurrent requests, and every sample gets its own answer, in order."""
    policy, url = served
    n = MAX_SAMPLES + 6
    images, prompts = _inputs(99, n)
    body = {"images": [encode_png(im) for im in images], "prompts": prompts}
    refused = httpx.post(f"{url}/generate", json=body, timeout=60)
    assert refused.status_code == 422 and "64" in refused.text  # the service's limit stands
    client = PolicyClient(url)
    before = client.stats()
    gens = client.generate(images, prompts, temperature=0.8, max_new_tokens=6)
    after = client.stats()
    assert len(gens) == n
    assert after["requests"] - before["requests"] == 2
    assert after["samples"] - before["samples"] == n
    # Each sample's tokens, scored in-process on that sample's own inputs, give its log-probs.
    out = policy.score(images, prompts, [g.token_ids for g in gens], temperature=0.8)
    for i, g in enumerate(gens):
        k = len(g.token_ids)
        assert torch.allclose(out.logprobs[i, :k], torch.tensor(g.logprobs), atol=1e-4)
    with pytest.raises(ValueError, match="70 images for 69 prompts"):
        client.generate(images, prompts[:-1])  # as Policy.generate says it, nothing sent


def test_a_full_request_of_large_raw_frames_fits_the_policy_services_limit(
    served: tuple[Policy, str],
) -> None:
    """64 raw frames of 300 px (a GPU preset's 64-env rollout step) are ~23 MB of JSON: over
    the API's 8 MiB, which the policy service answered with 413; its own limit takes them."""
    policy, _ = served
    app = create_app(policy, max_batch=64, max_wait_ms=0, max_image_side=448)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (300, 300, 3), dtype=np.uint8) for _ in range(MAX_SAMPLES)]
    prompts = [f"frame {i}" for i in range(MAX_SAMPLES)]
    size = len(json.dumps({"images": [encode_frame(im, "raw") for im in images]}))
    assert MAX_BODY_BYTES < size < MAX_REQUEST_BYTES
    with live_server(app) as url, PolicyClient(url) as client:
        gens = client.generate(images, prompts, max_new_tokens=2, greedy=True)
        assert len(gens) == MAX_SAMPLES and all(g.token_ids for g in gens)
        # past the policy's own limit: still a clear 413, never a 500
        r = httpx.post(f"{url}/generate", content=b"{" * (MAX_REQUEST_BYTES + 10))
        assert r.status_code == 413, r.text


def test_a_lone_caller_never_waits_out_the_window(served: tuple[Policy, str]) -> None:
    policy, _ = served
    app = create_app(policy, max_batch=16, max_wait_ms=100, max_image_side=128)
    with live_server(app) as url:
        client = PolicyClient(url)
        for k in range(3):  # one whole batch per request, one request at a time
            client.generate(*_inputs(k, 4), max_new_tokens=2)
        lone = client.stats()
        barrier = threading.Barrier(4)

        def call(k: int) -> list:
            barrier.wait()
            return client.generate(*_inputs(k, 1), max_new_tokens=2)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(call, range(4)))
        after = client.stats()
    assert (lone["batches"], lone["windows"]) == (3, 0)
    assert after["windows"] > 0 and after["batches"] - lone["batches"] < 4


def test_score_over_http_agrees_with_generate(served: tuple[Policy, str]) -> None:
    _, url = served
    images, prompts = _inputs(42, 2)
    with PolicyClient(url) as client:
        gens = client.generate(images, prompts, max_new_tokens=10, seed=1)
        out = client.score(images, prompts, [g.token_ids for g in gens])
    for i, g in enumerate(gens):
        assert out.mask[i][: len(g.token_ids)] == [1] * len(g.token_ids)
        assert np.allclose(out.logprobs[i][: len(g.token_ids)], g.logprobs, atol=1e-4)
        assert out.values[i] == pytest.approx(g.value, abs=1e-5)


def test_limits_give_4xx_with_a_message(served: tuple[Policy, str]) -> None:
    _, url = served
    img = encode_png(np.zeros((64, 64, 3), dtype=np.uint8))
    big = encode_png(np.zeros((200, 64, 3), dtype=np.uint8))
    cases = [
        ({"images": [big], "prompts": ["x"]}, 422, "128px"),
        ({"images": [img], "prompts": ["x" * 9000]}, 413, "limit"),
        ({"images": [img] * 65, "prompts": ["x"] * 65}, 422, "images"),
        ({"images": [img, img], "prompts": ["x"]}, 422, "2 images for 1 prompts"),
        ({"images": [base64.b64encode(b"nope").decode()], "prompts": ["x"]}, 422, "not a base64"),
        ({"images": [img], "prompts": ["x"], "temperature": 0}, 422, "temperature"),
        # Raw frames (our own clients): a bad header, a short buffer, too large a side.
        ({"images": ["raw:64:AAAA"], "prompts": ["x"]}, 422, "raw:<height>x<width>:"),
        ({"images": ["raw:64x64:AAAA"], "prompts": ["x"]}, 422, "3 bytes for 64x64x3"),
        ({"images": ["raw:200x64:AAAA"], "prompts": ["x"]}, 422, "128px"),
    ]
    for body, status, text in cases:
        r = httpx.post(f"{url}/generate", json=body)
        assert r.status_code == status, (body.keys(), r.text)
        assert text in r.text
    r = httpx.post(
        f"{url}/score", json={"images": [img], "prompts": ["x"], "response_ids": [[10**6]]}
    )
    assert r.status_code == 422 and "response_ids" in r.text
    r = httpx.post(f"{url}/checkpoints/load", json={"path": "/nonexistent/ckpt"})
    assert r.status_code == 404 and "policy.json" in r.text


def test_checkpoint_load_changes_the_served_policy(
    served: tuple[Policy, str], tiny_path: Callable[[str], Path], tmp_path: Path
) -> None:
    _, url = served
    trained = Policy.load(tiny_path("llava"), lora_r=4, seed=9)
    with torch.no_grad():
        for p in trained.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    trained.save(tmp_path / "ckpt")
    images, prompts = _inputs(7, 2)
    ids = [trained.encode_response(json.dumps({"thoughts": "go", "action": "+"}))] * 2
    want = trained.score(images, prompts, ids)
    with PolicyClient(url) as client:
        client.load_weights(tmp_path / "ckpt")
        got = client.score(images, prompts, ids)
        assert client.weights()["checkpoint"] == str(tmp_path / "ckpt")
        with pytest.raises(PolicyServiceError, match="404"):
            client.load_weights(tmp_path / "missing")
    assert np.allclose(got.logprobs, want.logprobs.numpy(), atol=1e-5)
    assert np.allclose(got.values, want.values.numpy(), atol=1e-5)


def test_a_client_loads_its_checkpoint_again_when_the_service_lost_it(
    served: tuple[Policy, str], tiny_path: Callable[[str], Path], tmp_path: Path
) -> None:
    _, url = served
    saved = Policy.load(tiny_path("llava"), lora_r=4, seed=3)
    saved.save(tmp_path / "ours")
    saved.save(tmp_path / "other")
    with PolicyClient(url) as client, PolicyClient(url) as other:
        client.load_weights(tmp_path / "ours")
        assert not client.ensure_loaded()
        other.load_weights(tmp_path / "other")  # as a restart (base weights) would leave it
        assert client.ensure_loaded()
        assert client.weights()["checkpoint"] == str(tmp_path / "ours")


def test_a_window_stays_open_while_requests_keep_coming(served: tuple[Policy, str]) -> None:
    """Concurrent callers whose requests trickle in (each less than a window after the last,
    all of them over several windows) share one model call."""
    import asyncio

    from services.policy.batching import Batcher

    policy, _ = served

    async def scenario() -> tuple[int, int]:
        batcher = Batcher(policy, max_batch=16, max_wait_ms=400, max_hold_ms=20_000)
        batcher.start()
        kw = {"max_new_tokens": 2}
        try:
            # Two callers at once: the batcher learns that its callers are concurrent.
            await asyncio.gather(*(batcher.submit(*_inputs(k, 1), kw) for k in range(2)))
            before = batcher.stats.batches

            async def late(k: int) -> list:
                await asyncio.sleep(0.2 * k)  # 0, 0.2, ... 1.0 s: over 2.5 windows in all
                return await batcher.submit(*_inputs(k, 1), kw)

            gens = await asyncio.gather(*(late(k) for k in range(6)))
            assert [len(g) for g in gens] == [1] * 6
            return batcher.stats.batches - before, batcher.stats.largest_batch
        finally:
            await batcher.stop()

    calls, largest = asyncio.run(scenario())
    assert (calls, largest) == (1, 6)
