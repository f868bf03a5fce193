"""Sampling a token per row with one uniform draw against the CDF, as the last logits processor.

HF's sampling draws with ``torch.multinomial``, which on the CPU draws an exponential for every
vocabulary entry of every row: 342 against 61 us a step for 16 rows of 1,024 entries, one thread
(bench/decode_kernels_bench.py), and it grows with the vocabulary (a 150k-entry Qwen vocabulary
is 2.4M exponentials a step at batch 16). Inverse-CDF sampling draws one uniform per row and
finds it in the running sum of the probabilities, the same distribution
(tests/services/policy/test_sampling.py).

HF has no hook for its sampler, so ``Policy.generate`` decodes "greedily" over processors that do
the sampler's whole work: the temperature and top-p warpers HF would add, then ``CdfDraw``, which
leaves only the drawn token finite, so the argmax is the draw. The order is HF's own (its
built-in processors, ours, then the warpers), and the log-probs a rollout records come from the
raw logits as before. The draws use torch's global generator, so ``seed`` still fixes them.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper


class CdfDraw(LogitsProcessor):
    """Scores -> a row of -inf with 0 at one token drawn from softmax(scores)."""

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        # float64: a float32 running sum over a large vocabulary drifts in its last entries
        cdf = torch.softmax(scores.double(), dim=-1).cumsum_(-1)
        total = cdf[:, -1:].contiguous()
        u = torch.rand(total.shape, dtype=cdf.dtype, device=cdf.device) * total
        picked = torch.searchsorted(cdf, u, right=True)  # the first entry whose sum passes u
        # u * total can round up to total; the last entry with mass is then the draw (never a
        # masked entry past it, whose probability is 0)
        picked = torch.minimum(picked, torch.searchsorted(cdf, total))
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, picked, 0.0)


def sampling_processors(temperature: float, top_p: float) -> list[LogitsProcessor]:
    """The warpers HF adds for `do_sample` (temperature, then top-p), then the draw."""
    warpers: list[LogitsProcessor] = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return [*warpers, CdfDraw()]
