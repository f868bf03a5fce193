"""``Policy.score`` with the last decoder layer run only at the positions whose output it reads.

The last decoder layer's output feeds the final norm and the LM head, nothing else: a later
position reads an earlier one through its keys and values, which the layer computes from its
*input*. ``score`` keeps the logits of the last prompt position and the response
(``logits_to_keep``), and the value head reads the last prompt position (and, for ``mlp+image``,
the image tokens). So in the last layer the query, attention output and MLP of the prompt's other
positions (~190 of ~230 in a study's EZPoints batch) are products whose result nothing reads.

``ResponseLastLayer.active(start, image)`` runs that layer's keys and values at every position,
its query, attention output and MLP only at the positions from ``start`` on and the image tokens,
and passes the other positions' input through as their output: placeholders that nothing reads,
so the output keeps its shape and HF's code after the layer (final norm, ``logits_to_keep``, the
value head's hook) runs unchanged. The same numbers up to float reassociation, gradients
included (tests/services/policy/test_last_layer.py); on the 1M preset (3 layers) about a fifth of
a score pass's language-model products.

Handled: the pre-norm decoder layers of the tiny architectures (``LlamaDecoderLayer``: llava and
idefics3; ``Qwen2VLDecoderLayer`` without a sliding window) under sdpa or eager attention, with no
KV cache. Any other layer makes ``of`` answer None (``score`` runs the whole layer); any other
call of a handled layer (a cache, another attention kernel, an unexpected mask) runs its own
forward.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

# On: outputs agree with the whole layer to float rounding (tests/services/policy/
# test_last_layer.py).
# False computes the whole layer everywhere (a debugging switch; the bench measures both ways).
ENABLED = True
HANDLED = ("LlamaDecoderLayer", "Qwen2VLDecoderLayer")
ATTENTION = ("sdpa", "eager")


class ResponseLastLayer:
    """A language model's last decoder layer, switchable to computing only the positions read."""

    def __init__(self, layer: nn.Module, eager: Callable[..., Any]) -> None:
        self.layer: Any = layer  # an HF decoder layer: its submodules by name
        self._eager = eager  # the model's own eager attention (sdpa: HF's registry, at call time)

    @classmethod
    def of(cls, language_model: nn.Module) -> ResponseLastLayer | None:
        """The switch for ``language_model``'s last layer; None where it is not one handled
        (and everywhere when ``ENABLED`` is False)."""
        if not ENABLED:
            return None
        layers = getattr(language_model, "layers", None)
        config = getattr(language_model, "config", None)
        if not isinstance(layers, nn.ModuleList) or len(layers) == 0 or config is None:
            return None
        layer = layers[-1]
        if type(layer).__name__ not in HANDLED or config.num_hidden_layers != len(layers):
            return None
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            return None
        eager = getattr(
            sys.modules[type(layer.self_attn).__module__], "eager_attention_forward", None
        )
        return cls(layer, eager) if callable(eager) else None

    @contextmanager
    def active(self, start: int, image: torch.Tensor | None) -> Iterator[None]:
        """Within: a call of the layer computes its output at positions >= ``start`` (negative:
        from the end) and where ``image`` (B, P, 1) marks the prompt's image tokens; the others
        are its input. Its own forward is back after, also on an error."""
        layer = self.layer
        plain = layer.forward

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            mask = kwargs.get("attention_mask")
            impl = layer.self_attn.config._attn_implementation
            if (
                args
                or kwargs.get("cache") is not None
                or kwargs.get("past_key_values") is not None
                or kwargs.get("position_embeddings") is None
                or impl not in ATTENTION
                or not ((mask is None and impl == "sdpa") or _is_4d(mask))
            ):
                return plain(hidden_states, *args, **kwargs)
            b, s = hidden_states.shape[:2]
            keep = kept_positions(b, s, start, image, hidden_states.device)
            return self._forward(hidden_states, keep, **kwargs)

        layer.forward = forward  # type: ignore[method-assign]
        try:
            yield
        finally:
            layer.__dict__.pop("forward", None)

    def _forward(
        self,
        h: torch.Tensor,
        keep: torch.Tensor,
        *,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """The layer's forward (LlamaDecoderLayer's, op for op) with queries at ``keep`` only."""
        for name in ("position_ids", "cache", "past_key_values", "use_cache"):
            kwargs.pop(name, None)
        layer, attn = self.layer, self.layer.self_attn
        (b, s, d), k = h.shape, keep.shape[1]
        rows = keep.unsqueeze(-1).expand(b, k, d)
        x = layer.input_layernorm(h)
        hd = attn.head_dim
        query = attn.q_proj(x.gather(1, rows)).view(b, k, -1, hd).transpose(1, 2)
        key = attn.k_proj(x).view(b, s, -1, hd).transpose(1, 2)
        value = attn.v_proj(x).view(b, s, -1, hd).transpose(1, 2)
        cos, sin = position_embeddings
        query = _rotate(query, _rows(cos, keep, b), _rows(sin, keep, b))
        key = _rotate(key, cos, sin)
        impl = attn.config._attn_implementation
        interface = self._eager if impl == "eager" else _registry().get_interface(impl, self._eager)
        out, _ = interface(
            attn,
            query,
            key,
            value,
            _mask_rows(attention_mask, keep, s),
            dropout=0.0 if not attn.training else attn.attention_dropout,
            scaling=attn.scaling,
            **kwargs,
        )
        out = attn.o_proj(out.reshape(b, k, -1).contiguous())
        kept = h.gather(1, rows) + out
        kept = kept + layer.mlp(layer.post_attention_layernorm(kept))
        return h.scatter(1, rows, kept.to(h.dtype))


def kept_positions(
    batch: int, seq: int, start: int, image: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """(B, K) sorted positions whose output is read: ``start`` on, and the image tokens. Rows
    with different image counts keep everything from the earliest image token on (equal K)."""
    start = start % seq if start < 0 else min(start, seq)
    if image is None:
        return torch.arange(start, seq, device=device).expand(batch, -1)
    keep = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    keep[:, start:] = True
    keep[:, : image.shape[1]] |= image[..., 0].bool()
    counts = keep.sum(1)
    if bool((counts != counts[0]).any()):
        first = int(keep.float().argmax(1).min())
        keep[:, first:] = True
    return keep.nonzero()[:, 1].view(batch, -1)


def _is_4d(mask: Any) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dim() == 4


def _registry() -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def _rows(t: torch.Tensor, keep: torch.Tensor, batch: int) -> torch.Tensor:
    """t (B or 1, S, w) at each row's ``keep`` positions: (B, K, w)."""
    t = t.expand(batch, -1, -1)
    return t.gather(1, keep.unsqueeze(-1).expand(-1, -1, t.shape[-1]))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding (apply_rotary_pos_emb) on (B, heads, n, hd) with cos/sin (B, n, hd)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _mask_rows(mask: torch.Tensor | None, keep: torch.Tensor, seq: int) -> torch.Tensor:
    """The attention mask's rows of the kept queries, (B, h, K, S); sdpa's causal mask (None:
    no padding anywhere) made explicit as a boolean one (a query sees keys at or before it)."""
    b, k = keep.shape
    if mask is None:
        keys = torch.arange(seq, device=keep.device)
        return (keys.view(1, 1, seq) <= keep.unsqueeze(-1)).unsqueeze(1)
    if mask.shape[2] == 1:  # one row for every query
        return mask
    mask = mask.expand(b, -1, -1, -1)
    index = keep.view(b, 1, k, 1).expand(b, mask.shape[1], k, mask.shape[3])
    return mask.gather(2, index)
