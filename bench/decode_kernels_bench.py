"""Microseconds of the two per-row kernels a CPU decode step repeats, old way against new, at 1 and
16 rows (docs/benchmarks.md, "Batch 16 at 8×"):

- a Linear's product: ``F.linear(x, W)`` (W stored out x in, what ``nn.Linear`` runs), ``x @ Wt``
  on a stored contiguous transpose (services/policy/transposed_linears.py), and MKL's packed GEMM
  for comparison, with the largest difference from ``F.linear``'s result;
- a token draw over a 1,024-entry vocabulary: ``torch.multinomial`` against one uniform per row
  on the CDF (services/policy/sampling.py).

    GTR_TORCH_THREADS=1 .venv/bin/python bench/decode_kernels_bench.py [--calls 300]

One thread, each weight small enough to stay in cache: what the kernels cost, not a decode step.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import click

SHAPES = ((256, 256), (256, 768), (768, 256), (256, 1024))  # the 10M model's; 1024: LM head


def _us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(20):
        fn()
    xs = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(xs)


@click.command()
@click.option("--calls", default=300, show_default=True, help="timed calls per cell")
def main(calls: int) -> None:
    import torch
    import torch.nn.functional as F

    from services.policy.sampling import CdfDraw

    torch.set_num_threads(int(os.environ.get("GTR_TORCH_THREADS", "1")))
    torch.manual_seed(0)
    packed = hasattr(torch.ops.mkl, "_mkl_linear")
    click.echo(f"{torch.get_num_threads()} torch threads, {calls} calls a cell, median µs")
    click.echo(
        "| in × out | rows | `F.linear` | `x @ Wᵀ` stored | MKL packed | max diff (stored) |"
    )
    click.echo("|---|---:|---:|---:|---:|---:|")
    for i, o in SHAPES:
        w = torch.randn(o, i)
        wt = w.t().contiguous()
        for rows in (1, 16):
            x = torch.randn(rows, i)
            base = _us(lambda x=x, w=w: F.linear(x, w), calls)
            stored = _us(lambda x=x, wt=wt: x @ wt, calls)
            cell = "–"
            if packed:
                pw = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)

                def mkl(x=x, pw=pw, w=w, r=rows) -> object:
                    return torch.ops.mkl._mkl_linear(x, pw, w, None, r)

                cell = f"{_us(mkl, calls):.1f}"
            diff = (x @ wt - F.linear(x, w)).abs().max().item()
            click.echo(f"| {i} × {o} | {rows} | {base:.1f} | {stored:.1f} | {cell} | {diff:.1e} |")
    click.echo("\n| draw, vocabulary 1,024 | rows | `torch.multinomial` | CDF, one uniform a row |")
    click.echo("|---|---:|---:|---:|")
    draw = CdfDraw()
    for rows in (1, 16):
        scores = torch.randn(rows, 1024)
        probs = torch.softmax(scores, -1)
        none = torch.zeros(rows, 0, dtype=torch.long)
        multi = _us(lambda p=probs: torch.multinomial(p, 1), calls)
        cdf = _us(lambda s=scores: draw(none, s), calls)  # noqa: B023 - bound per row count
        click.echo(f"| softmax → token | {rows} | {multi:.1f} | {cdf:.1f} |")


if __name__ == "__main__":
    main()
