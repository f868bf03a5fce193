"""Decoding on the CPU with each Linear's weight stored transposed: a few rows' products run ~1.7x
faster.

``nn.Linear`` computes ``x @ W.T`` with W stored (out, in), which MKL runs as a GEMM with a
transposed operand. At the few rows of a decode step (one new token per sample) that kernel is
much slower than the plain one on a weight stored (in, out): 71 against 38 us for a 16 x 256 x 768
product on one thread, bit-identical results (bench/decode_kernels_bench.py). A decode
step is a few hundred such products, so ``Policy.generate`` runs the language model's Linears
through ``TransposedLinears.active()``: each reads a contiguous copy of its weight's transpose,
made once and made again only when the weight changes (an optimiser step or ``load_weights``
bumps the tensor's version). The copy costs one more set of the language model's weights in
memory; CPU only (cuBLAS has no such gap). Training and ``score`` keep ``nn.Linear``'s own path,
so a rollout's log-probs match ``score``'s to float rounding (~1e-6), as before.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import nn


class TransposedLinears:
    """The given Linears, switchable to a matmul on a cached (in, out) copy of their weights."""

    def __init__(self, modules: Iterable[nn.Linear]) -> None:
        self.modules = list(dict.fromkeys(modules))  # a tied weight's module once
        self._copies: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}

    def _transposed(self, m: nn.Linear) -> torch.Tensor:
        w = m.weight
        key = (w.data_ptr(), w._version)
        held = self._copies.get(id(m))
        if held is None or held[0] != key:
            held = (key, w.detach().t().contiguous())
            self._copies[id(m)] = held
        return held[1]

    @staticmethod
    def _with_bias(wt: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, wt).add_(bias)

    def _forward(self, m: nn.Linear) -> partial[torch.Tensor]:
        """`x @ W.T (+ b)` on the cached transpose; a bare `torch.matmul` where there is no bias
        (a decode step makes hundreds of these calls: no Python frame of ours in between)."""
        wt = self._transposed(m)
        if m.bias is None:
            return partial(torch.matmul, other=wt)
        return partial(self._with_bias, wt, m.bias)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Within: each module's forward is the transposed matmul (no grad: the copies are
        detached). Restored after, also on an error."""
        if torch.is_grad_enabled():
            raise RuntimeError("TransposedLinears.active() is for no-grad decoding")
        for m in self.modules:
            m.forward = self._forward(m)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for m in self.modules:
                m.__dict__.pop("forward", None)
