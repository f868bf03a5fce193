"""Generated tokens/s of the tiny policy at batch 1, 4, 16: in-process and through the service.

    .venv/bin/python bench/policy_bench.py [--size 10m] [--arch llava] [--new-tokens 64]

Service modes: one request holding the whole batch ("1 req"), and B concurrent 1-sample requests
gathered by dynamic batching ("B reqs"). ``--server thread`` serves the bench's own policy from a
thread of this process (the client's threads then share the server's interpreter);
``--server process`` starts ``gtr policy serve`` on the same model folder, as it is deployed.
``--repeats`` interleaved rounds, each timing every batch size in every mode once; a ratio is
the median of its per-round ratios. Prints a markdown table for docs/benchmarks.md.

Each round also times the decode step's matrix products alone (`linears_step`): every Linear of
the language model, LoRA's included, and the LM head, once each in model order on one new token
per row, as a decode step runs them. Batch 16 ÷ batch 1 of that is the most batching can buy
on this machine for this model before attention, cache growth and per-step overhead are counted.

And the prefill (`prefill`: the prompt's one forward, image tower included), whose work is
batch × prompt tokens, so batching buys it little: its milliseconds at batch 1 and 16, and its
share of the batch-16 generation of the same round.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import click
import numpy as np

BATCHES = (1, 4, 16)


def _timed(fn: Callable[[], int]) -> tuple[int, float]:
    """(tokens made, seconds) of one call of `fn` (which returns the tokens it made)."""
    t0 = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - t0


def linears_step(policy: object, batch: int) -> float:
    """Seconds of one decode step's matrix products at `batch` rows: each Linear of the language
    model (the adapters' too) and the LM head on a (batch, in_features) input, in model order, so
    each weight is read once per step as in decoding (the cache does not keep them all)."""
    from contextlib import nullcontext

    import torch

    layers = policy._decode_linears()  # type: ignore[attr-defined]
    linears = policy.transposed_linears  # type: ignore[attr-defined]
    inputs = [torch.randn(batch, m.in_features) for m in layers]
    with torch.no_grad(), linears.active() if linears is not None else nullcontext():
        t0 = time.perf_counter()
        for m, x in zip(layers, inputs, strict=True):
            m(x)
        return time.perf_counter() - t0


def prefill(policy: object, images: list[np.ndarray], prompts: list[str]) -> float:
    """Seconds of the prompt's forward pass (what `generate` runs before its first token)."""
    import torch

    with torch.no_grad():
        inputs = policy._inputs(images, prompts)  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        policy.model(**inputs, use_cache=True, logits_to_keep=1)  # type: ignore[attr-defined]
        return time.perf_counter() - t0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(policy: object) -> tuple[str, Callable[[], None]]:
    from services.policy.app import create_app

    return serve_in_thread(create_app(policy))


def serve_in_thread(app: object) -> tuple[str, Callable[[], None]]:
    """(url, stop) of uvicorn serving the ASGI `app` from a thread of this process."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{port}", stop


def _serve_process(model_dir: str) -> tuple[str, Callable[[], None]]:
    """`gtr policy serve` on `model_dir` in a child process (one torch thread, as the bench)."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "services.cli", "policy", "serve", "--model", model_dir]
    cmd += ["--lora-r", "16", "--port", str(port), "--device", "cpu"]
    env = os.environ | {"GTR_TORCH_THREADS": "1"}
    # Its log goes to a file, not a pipe: a pipe nobody reads fills up and stalls the server.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            log.seek(0)
            err = log.read().decode(errors="replace")[-2000:]
            raise SystemExit(f"gtr policy serve exited ({proc.returncode}): {err}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("gtr policy serve did not answer /healthz within 120 s")
        time.sleep(0.2)

    def stop() -> None:
        proc.terminate()
        proc.wait(10)
        log.close()

    return url, stop


@click.command()
@click.option("--arch", default="llava", show_default=True)
@click.option("--size", default="10m", show_default=True)
@click.option("--new-tokens", default=64, show_default=True)
@click.option("--repeats", default=3, show_default=True, help="interleaved rounds")
@click.option(
    "--server",
    type=click.Choice(["thread", "process"]),
    default="thread",
    show_default=True,
    help="the service in a thread of the bench, or `gtr policy serve` in its own process",
)
def main(arch: str, size: str, new_tokens: int, repeats: int, server: str) -> None:
    import torch

    from services.policy.client import PolicyClient
    from services.policy.service import Policy
    from services.policy.tiny import build_tiny

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny(tmp, arch, size)  # type: ignore[arg-type]
        policy = Policy.load(model_dir, lora_r=16)
        rng = np.random.default_rng(0)
        frames = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(max(BATCHES))]
        prompt = "You are playing number line. Move the current number toward the target."
        kw = {"max_new_tokens": new_tokens, "temperature": 1.0}
        url, stop = _serve(policy) if server == "thread" else _serve_process(str(model_dir))
        client = PolicyClient(url)
        # One call per (batch, mode) in each round, rounds interleaved: the machine's load drifts
        # over minutes, and a ratio of two figures taken seconds apart in one round is what holds.
        modes: dict[tuple[int, str], Callable[[], int]] = {}
        for b in BATCHES:
            imgs, prompts = frames[:b], [prompt] * b

            def local(imgs=imgs, prompts=prompts) -> int:
                return sum(len(g.token_ids) for g in policy.generate(imgs, prompts, **kw))

            def one_request(imgs=imgs, prompts=prompts) -> int:
                return sum(len(g.token_ids) for g in client.generate(imgs, prompts, **kw))

            def many_requests(imgs=imgs, b=b) -> int:
                with ThreadPoolExecutor(b) as pool:
                    res = pool.map(lambda im: client.generate([im], [prompt], **kw), imgs)
                    return sum(len(g.token_ids) for gens in res for g in gens)

            modes |= {(b, "local"): local, (b, "one"): one_request, (b, "many"): many_requests}
        for fn in modes.values():
            fn()  # warm-up
        rates: dict[tuple[int, str], list[float]] = {key: [] for key in modes}
        ceiling: list[float] = []  # batch-16 ÷ batch-1 token rate of the linears alone, per round
        prefills: list[tuple[float, float, float]] = []  # batch 1, batch 16, share of a generation
        top = max(BATCHES)
        for _ in range(repeats):
            seconds = {}
            for key, fn in modes.items():
                tokens, seconds[key] = _timed(fn)
                rates[key].append(tokens / seconds[key])
            one, many = (
                statistics.median(linears_step(policy, b) for _ in range(new_tokens))
                for b in (1, top)
            )
            ceiling.append(top * one / many)
            p1, p16 = (
                statistics.median(prefill(policy, frames[:b], [prompt] * b) for _ in range(5))
                for b in (1, top)
            )
            prefills.append((p1, p16, p16 / seconds[top, "local"]))
        stats = client.stats()
        stop()
    threads = torch.get_num_threads()
    click.echo(
        f"tiny {arch} {size}, {new_tokens} new tokens, {threads} torch threads, "
        f"median of {repeats} interleaved rounds, service in a {server}"
    )
    click.echo(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    click.echo("| batch | in-process tok/s | service, 1 req tok/s | service, B reqs tok/s |")
    click.echo("|---|---|---|---|")
    names = ("local", "one", "many")
    for b in BATCHES:
        # each mode against its own batch-1 figure of the same round: what batching buys there
        cells = []
        for mode in names:
            ratios = [r / r1 for r, r1 in zip(rates[b, mode], rates[1, mode], strict=True)]
            cells.append(
                f"{statistics.median(rates[b, mode]):.0f} ({statistics.median(ratios):.1f}×)"
            )
        click.echo(f"| {b} | " + " | ".join(cells) + " |")
    for mode in names:
        per_round = ", ".join(
            f"{r / r1:.1f}" for r, r1 in zip(rates[top, mode], rates[1, mode], strict=True)
        )
        click.echo(f"batch {top} ÷ batch 1, {mode}, by round: {per_round}")
    click.echo(
        f"batch {top} ÷ batch 1, the decode step's matrix products alone, by round: "
        + ", ".join(f"{c:.1f}" for c in ceiling)
        + f" (median {statistics.median(ceiling):.1f}×)"
    )
    click.echo(
        f"prefill ms at batch 1 / batch {top} (share of the batch-{top} generation), by round: "
        + ", ".join(f"{1e3 * a:.0f} / {1e3 * b:.0f} ({c:.0%})" for a, b, c in prefills)
    )
    click.echo(
        f"service counters: {stats['batches']} model calls for {stats['requests']} requests, "
        f"{stats.get('windows', 0)} batching windows opened"
    )


if __name__ == "__main__":
    main()
