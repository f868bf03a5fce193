"""Tokens/s of the tiny policy's decoding with one of its speed switches off and on, alternated in
one process, batch 1 and 16 (docs/benchmarks.md).

    GTR_TORCH_THREADS=1 .venv/bin/python bench/decode_switch_bench.py --switch kv_cache [--rounds 5]
    GTR_TORCH_THREADS=1 .venv/bin/python bench/decode_switch_bench.py --switch transposed_linears
    GTR_TORCH_THREADS=1 .venv/bin/python bench/decode_switch_bench.py --switch sampler

``kv_cache``: HF's dynamic KV cache (a ``torch.cat`` of the whole cache per layer and token)
against the cache that grows in place (services/policy/kv_cache.py). ``transposed_linears``:
nn.Linear's own product against the weights stored transposed
(services/policy/transposed_linears.py). ``sampler``: HF's ``torch.multinomial`` against one uniform
per row against the CDF (services/policy/sampling.py).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable

import click
import numpy as np


def _switches(policy: object) -> dict[str, tuple[tuple[str, str], Callable[[bool], None]]]:
    """switch -> ((off label, on label), set(on))."""
    linears = policy.transposed_linears  # type: ignore[attr-defined]

    def kv_cache(on: bool) -> None:
        policy.grow_kv_cache = on  # type: ignore[attr-defined]

    def transposed(on: bool) -> None:
        policy.transposed_linears = linears if on else None  # type: ignore[attr-defined]

    def sampler(on: bool) -> None:
        policy.cdf_sampling = on  # type: ignore[attr-defined]

    return {
        "kv_cache": (("dynamic", "growing"), kv_cache),
        "transposed_linears": (("nn.Linear", "transposed"), transposed),
        "sampler": (("multinomial", "cdf"), sampler),
    }


@click.command()
@click.option(
    "--switch",
    "name",
    required=True,
    type=click.Choice(["kv_cache", "transposed_linears", "sampler"]),
)
@click.option("--rounds", default=5, show_default=True)
@click.option("--size", default="10m", show_default=True, type=click.Choice(["1m", "10m", "50m"]))
@click.option("--new-tokens", default=64, show_default=True)
def main(name: str, rounds: int, size: str, new_tokens: int) -> None:
    from services.policy.service import Policy
    from services.policy.tiny import build_tiny

    policy = Policy.load(build_tiny(tempfile.mkdtemp(), "llava", size), lora_r=16)  # type: ignore[arg-type]
    labels, switch = _switches(policy)[name]
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(16)]
    prompt = "You are playing number line. Move the current number toward the target."

    def rate(b: int, seed: int) -> float:
        t0 = time.perf_counter()
        gens = policy.generate(frames[:b], [prompt] * b, max_new_tokens=new_tokens, seed=seed)
        return sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0)

    rates: dict[tuple[str, int], list[float]] = {}
    for r in range(rounds):
        for label in labels:
            switch(label == labels[1])
            for b in (1, 16):
                rate(b, r)  # warm-up in this mode
                rates.setdefault((label, b), []).append(rate(b, r))
    print(
        f"tiny llava {size}, {new_tokens} new tokens, "
        f"{os.environ.get('GTR_TORCH_THREADS', 'default')} torch threads, {rounds} rounds; "
        f"load average (1 min) at the end: {os.getloadavg()[0]:.1f}"
    )
    print(f"| {name} | batch | tok/s (rounds) | median | batch 16 ÷ batch 1, by round | median |")
    print("|---|---:|---|---:|---|---:|")
    for label in labels:
        ratios = [a / b for a, b in zip(rates[(label, 16)], rates[(label, 1)], strict=True)]
        for b in (1, 16):
            xs = rates[(label, b)]
            by_round = ", ".join(f"{x:.1f}" for x in ratios) if b == 16 else ""
            med = f"**{statistics.median(ratios):.1f}×**" if b == 16 else ""
            print(
                f"| {label} | {b} | {', '.join(f'{x:.0f}' for x in xs)} | "
                f"{statistics.median(xs):.0f} | {by_round} | {med} |"
            )


if __name__ == "__main__":
    main()
