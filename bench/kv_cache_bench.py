"""Tokens/s of the tiny policy's decoding with HF's dynamic KV cache (a ``torch.cat`` of the whole
cache per layer and token) and with the cache that grows in place (services/policy/kv_cache.py),
alternated in one process, batch 1 and 16 (docs/benchmarks.md).

    GTR_TORCH_THREADS=1 .venv/bin/python bench/kv_cache_bench.py [--rounds 5] [--size 10m]
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import click
import numpy as np


@click.command()
@click.option("--rounds", default=5, show_default=True)
@click.option("--size", default="10m", show_default=True, type=click.Choice(["1m", "10m", "50m"]))
@click.option("--new-tokens", default=64, show_default=True)
def main(rounds: int, size: str, new_tokens: int) -> None:
    from services.policy.service import Policy
    from services.policy.tiny import build_tiny

    policy = Policy.load(build_tiny(tempfile.mkdtemp(), "llava", size), lora_r=16)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(16)]
    prompt = "You are playing number line. Move the current number toward the target."

    def rate(b: int, seed: int) -> float:
        t0 = time.perf_counter()
        gens = policy.generate(frames[:b], [prompt] * b, max_new_tokens=new_tokens, seed=seed)
        return sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0)

    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        for mode in ("dynamic", "growing"):
            policy.grow_kv_cache = mode == "growing"
            for b in (1, 16):
                rate(b, r)  # warm-up in this mode
                rates.setdefault((mode, b), []).append(rate(b, r))
    print(
        f"tiny llava {size}, {new_tokens} new tokens, "
        f"{os.environ.get('GTR_TORCH_THREADS', 'default')} torch threads, {rounds} rounds; "
        f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}"
    )
    print("| KV cache | batch | tok/s (rounds) | median | batch 16 ÷ batch 1, by round | median |")
    print("|---|---:|---|---:|---|---:|")
    for mode in ("dynamic", "growing"):
        ratios = [a / b for a, b in zip(rates[(mode, 16)], rates[(mode, 1)], strict=True)]
        for b in (1, 16):
            xs = rates[(mode, b)]
            by_round = ", ".join(f"{x:.1f}" for x in ratios) if b == 16 else ""
            med = f"**{statistics.median(ratios):.1f}×**" if b == 16 else ""
            print(
                f"| {mode} | {b} | {', '.join(f'{x:.0f}' for x in xs)} | "
                f"{statistics.median(xs):.0f} | {by_round} | {med} |"
            )


if __name__ == "__main__":
    main()
