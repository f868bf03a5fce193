"""Page faults and tokens/s of the tiny policy's decoding under glibc's default mmap threshold and
under ``keep_freed_memory``'s fixed thresholds, alternated in one process (docs/benchmarks.md).

    GTR_TORCH_THREADS=1 .venv/bin/python bench/kv_faults_bench.py [--rounds 4]
"""

from __future__ import annotations

import ctypes
import resource
import statistics
import tempfile
import time

import click
import numpy as np

from services.policy.loading import (
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    MMAP_THRESHOLD,
    TRIM_THRESHOLD,
)

DEFAULT = 128 * 1024  # glibc's initial thresholds, held fixed (a process that freed nothing large)


@click.command()
@click.option("--rounds", default=4, show_default=True)
def main(rounds: int) -> None:
    from services.policy.service import Policy
    from services.policy.tiny import build_tiny

    libc = ctypes.CDLL("libc.so.6")
    policy = Policy.load(build_tiny(tempfile.mkdtemp(), "llava", "10m"), lora_r=16)
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(16)]
    prompt = "You are playing number line. Move the current number toward the target."

    def run(b: int) -> int:
        gens = policy.generate(frames[:b], [prompt] * b, max_new_tokens=64, seed=0)
        return sum(len(g.token_ids) for g in gens)

    rates: dict[tuple[str, int], list[float]] = {}
    faults: dict[tuple[str, int], list[int]] = {}
    for _ in range(rounds):
        for mode, (mmap, trim) in (
            ("default", (DEFAULT, DEFAULT)),
            ("kept", (MMAP_THRESHOLD, TRIM_THRESHOLD)),
        ):
            libc.mallopt(M_MMAP_THRESHOLD, mmap)
            libc.mallopt(M_TRIM_THRESHOLD, trim)
            for b in (1, 16):
                run(b)  # warm-up under these thresholds
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0 = time.perf_counter()
                n = run(b)
                rates.setdefault((mode, b), []).append(n / (time.perf_counter() - t0))
                faults.setdefault((mode, b), []).append(
                    resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
                )
    click.echo("| thresholds | batch | minor faults per call (rounds) | tok/s (median) |")
    click.echo("|---|---|---|---:|")
    for (mode, b), r in sorted(rates.items()):
        click.echo(f"| {mode} | {b} | {faults[mode, b]} | {statistics.median(r):.0f} |")


if __name__ == "__main__":
    main()
