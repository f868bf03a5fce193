"""Generated tokens/s of the tiny policy at batch 1, 4, 16: in-process and through the service.

    .venv/bin/python bench/policy_bench.py [--size 10m] [--arch llava] [--new-tokens 64]

Service modes: one request holding the whole batch ("1 req"), and B concurrent 1-sample requests
gathered by dynamic batching ("B reqs"). Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import click
import numpy as np

BATCHES = (1, 4, 16)


def _timed(fn: Callable[[], int], repeats: int) -> float:
    """Median generated tokens/s over `repeats` calls of `fn` (which returns tokens made)."""
    fn()  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        tokens = fn()
        rates.append(tokens / (time.perf_counter() - t0))
    return statistics.median(rates)


def _serve(policy: object) -> tuple[str, Callable[[], None]]:
    import uvicorn

    from services.policy.app import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(policy), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join(10)

    return f"http://127.0.0.1:{port}", stop


@click.command()
@click.option("--arch", default="llava", show_default=True)
@click.option("--size", default="10m", show_default=True)
@click.option("--new-tokens", default=64, show_default=True)
@click.option("--repeats", default=3, show_default=True)
def main(arch: str, size: str, new_tokens: int, repeats: int) -> None:
    import torch

    from services.policy.client import PolicyClient
    from services.policy.service import Policy
    from services.policy.tiny import build_tiny

    with tempfile.TemporaryDirectory() as tmp:
        policy = Policy.load(build_tiny(tmp, arch, size), lora_r=16)  # type: ignore[arg-type]
        rng = np.random.default_rng(0)
        frames = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(max(BATCHES))]
        prompt = "You are playing number line. Move the current number toward the target."
        kw = {"max_new_tokens": new_tokens, "temperature": 1.0}
        url, stop = _serve(policy)
        client = PolicyClient(url)
        rows = []
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

            rows.append(
                (
                    b,
                    _timed(local, repeats),
                    _timed(one_request, repeats),
                    _timed(many_requests, repeats),
                )
            )
        stats = client.stats()
        stop()
    threads = torch.get_num_threads()
    click.echo(
        f"tiny {arch} {size}, {new_tokens} new tokens, {threads} torch threads, median of {repeats}"
    )
    click.echo(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}")
    click.echo("| batch | in-process tok/s | service, 1 req tok/s | service, B reqs tok/s |")
    click.echo("|---|---|---|---|")
    base = rows[0]
    for b, a, c, d in rows:
        # each mode against its own batch-1 figure: what batching buys in that mode
        click.echo(
            f"| {b} | {a:.0f} ({a / base[1]:.1f}×) | {c:.0f} ({c / base[2]:.1f}×) "
            f"| {d:.0f} ({d / base[3]:.1f}×) |"
        )
    click.echo(
        f"service counters: {stats['batches']} model calls for {stats['requests']} requests, "
        f"{stats.get('windows', 0)} batching windows opened"
    )


if __name__ == "__main__":
    main()
