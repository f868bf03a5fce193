"""A KV cache that grows in place: decoding writes each new position into spare room.

HF's ``DynamicLayer`` appends a decode step's keys and values with ``torch.cat``, which copies the
whole cache of every layer at every token: O(batch x length) bytes per step, the one part of a
decode step that batching cannot amortise (docs/benchmarks.md, "KV cache"). ``GrowingLayer``
keeps keys and values in buffers with room to spare (doubled when full, so a generation
reallocates O(log length) times) and hands attention views of the filled part. Outputs are the
same as the dynamic cache's (tests/services/policy/test_kv_cache.py).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

MIN_ROOM = 128  # positions: a tiny model's prompt plus its whole generation fit in one buffer

try:  # `generate(cache=...)` from transformers 5.2x; `past_key_values` before (now deprecated)
    from transformers.generation.utils import ALL_CACHE_NAMES

    CACHE_ARG = ALL_CACHE_NAMES[0]
except ImportError:  # pragma: no cover - older transformers 5
    CACHE_ARG = "past_key_values"


class GrowingLayer(DynamicLayer):
    """``DynamicLayer`` with keys/values in preallocated buffers instead of a cat per step."""

    def __init__(self) -> None:
        super().__init__()
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._n = 0
        self.reallocations = 0

    def _adopted(self) -> bool:
        """Whether `keys` is still the filled part of our buffer (HF's crop, reorder and batch
        selection replace `keys` with a new tensor: then that tensor is copied in again)."""
        k, keys = self._k, self.keys
        if k is None or keys is None:
            return False
        return keys.data_ptr() == k.data_ptr() and keys.shape[-2] == self._n

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self._adopted():  # first call, or HF replaced keys/values
            old_k, old_v = self.keys, self.values
            self._k = self._v = None
            self._n = old_k.shape[-2] if old_k is not None and old_k.numel() else 0
        else:
            old_k, old_v = self._k, self._v
        n, add = self._n, key_states.shape[-2]
        if self._k is None or n + add > self._k.shape[-2]:
            room = max(2 * (n + add), MIN_ROOM)
            k = key_states.new_empty((*key_states.shape[:-2], room, key_states.shape[-1]))
            v = value_states.new_empty((*value_states.shape[:-2], room, value_states.shape[-1]))
            if n and old_k is not None and old_v is not None:
                k[..., :n, :].copy_(old_k[..., :n, :])
                v[..., :n, :].copy_(old_v[..., :n, :])
            self._k, self._v = k, v
            self.reallocations += 1
        assert self._k is not None and self._v is not None
        self._k[..., n : n + add, :].copy_(key_states)
        self._v[..., n : n + add, :].copy_(value_states)
        self._n = n + add
        self.keys, self.values = self._k[..., : self._n, :], self._v[..., : self._n, :]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._k = self._v = None
        self._n = 0


def growing_cache(config: Any) -> DynamicCache:
    """The dynamic cache HF would build for `config`, with every full-attention layer growing in
    place (sliding-window and other layer kinds are kept as HF makes them)."""
    cache = DynamicCache(config=config)
    if not cache.layers:  # no layer types in the config: layers are made lazily
        cache.layer_class_to_replicate = GrowingLayer
    else:
        cache.layers = [GrowingLayer() if type(x) is DynamicLayer else x for x in cache.layers]
    return cache
