"""The VLM policy: a local HF image-text-to-text model + LoRA (or full FT) + a value head.

Interface (stable; the trainer and controller code against it):

- ``Policy.load(model_path, *, finetune="lora"|"full", lora_r=16, lora_alpha=32, lora_dropout=0.0,
  lora_target_modules=REGEX, device=None, dtype="auto", seed=0)``; ``Policy.from_config(model_cfg,
  model_path)`` takes a ``shared.schemas.ModelConfig``. The LoRA regex is full-matched against
  module names and only Linear layers inside the language model are adapted (never the vision
  tower). fp32 on CPU, bf16 on GPU (``dtype="auto"``). Torch threads: ``GTR_TORCH_THREADS`` or
  min(4, cores).
- ``generate(images, prompts, *, temperature=1.0, top_p=1.0, max_new_tokens=64,
  repetition_penalty=1.0, greedy=False, seed=None) -> list[Generation]``. ``images`` are HxWx3
  uint8 arrays or PIL images, one per prompt; a prompt is the env's text, wrapped here in the
  model's chat template with the image first. Special, image and pad tokens are never sampled.
  ``Generation.logprobs``/``entropy`` are of softmax(logits / temperature) over the allowed tokens
  (top-p and the repetition penalty shape sampling only), so ``score`` reproduces them exactly.
  ``token_ids`` are the response tokens, EOS included when produced. ``value`` is the value head
  on the last-layer hidden state of the last prompt token. Speed switches, each the same model
  and distribution (docs/benchmarks.md): ``grow_kv_cache`` (kv_cache.py), ``cdf_sampling``
  (sampling.py), ``transposed_linears`` (transposed_linears.py, CPU only; None turns it off);
  for ``score``, ``response_last_layer`` (last_layer.py; None turns it off).
- Spans: ``thought_mask`` = tokens wholly before the last ``"action":`` key; ``action_mask`` =
  from the token that holds that key's first character to the end, EOS excluded. Found from the
  decoded text's character offsets, never from token ids. No key: ``has_action=False``,
  ``action_mask`` all False and ``thought_mask`` = every non-EOS token. ``spans(token_ids)``
  gives the same masks.
- ``score(images, prompts, response_ids, *, with_grad=False, temperature=1.0) -> ScoreOutput`` with
  tensors ``logprobs (B,T)``, ``entropy (B,T)``, ``values (B,)``, ``mask (B,T)`` (1 on real response
  tokens, responses right-padded to the longest). ``with_grad=True`` is the trainer's differentiable
  forward (train mode, so LoRA dropout applies); otherwise no grad, eval mode.
- ``encode_response(text) -> list[int]``: a target output's ids + EOS (for SFT).
- ``trainable_parameters()``: params with ``requires_grad`` (LoRA, or the whole model under full
  FT) + value head. ``vision_parameters()``: vision tower + projector; under LoRA they are frozen:
  the caller sets ``requires_grad`` for its warm-up (and unsets it after, or they join
  ``trainable_parameters()``); once called, they are saved with every checkpoint.
  ``image_features(images)`` -> ``(B, N, d)`` projector output.
- ``save(dir)`` writes ``policy.json`` + ``value_head.safetensors`` + the LoRA adapter
  (``adapter_model.safetensors``, ``adapter_config.json``) or the full model
  (``model.safetensors``), plus ``vision.safetensors`` when the vision tower was trained under
  LoRA. Other files in the folder (the trainer's) are left alone. ``load_weights(dir)`` loads such
  a folder into this policy (same finetune mode and LoRA rank, else ValueError);
  ``services.policy.checkpoint.read_checkpoint_meta(dir)`` reads its policy.json;
  ``policy_for_checkpoint(current, dir)`` reuses ``current`` when it ``matches`` the checkpoint's
  base model, else loads the one the checkpoint names.
- Also: ``tokenizer``, ``eos_id``, ``suppress_ids``, ``render(prompt)`` (the chat-templated text).
  ``generate``/``score``/``load_weights`` hold one lock, so a policy may be shared by threads.
- Service: ``services.policy.app.create_app(policy)`` (POST /generate batched, POST /score,
  POST /checkpoints/load, GET /healthz, GET /stats); ``services.policy.client.PolicyClient(url)``
  has the same ``generate`` and returns the same ``Generation`` records (torch-free module
  ``services.policy.schemas``). vLLM: ``services.policy.vllm_backend`` (GPU only). What a run
  needs of any of them (``generate`` + ``load_weights``) is ``protocol.RolloutPolicy``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from services.policy.checkpoint import (
    load_policy_weights,
    policy_kwargs,
    read_checkpoint_meta,
    save_policy,
)
from services.policy.heads import GeneratedRepetitionPenalty, image_token_id, make_value_head
from services.policy.last_layer import ResponseLastLayer
from services.policy.loading import (
    add_lora,
    autocast,
    language_model,
    load_processor,
    resolve_precision,
    set_threads,
    suppressed_ids,
    to_pil,
)
from services.policy.protocol import ImageLike
from services.policy.sampling import sampling_processors
from services.policy.schemas import Generation
from services.policy.scoring import (
    generation_of,
    last_hidden,
    pad_responses,
    token_stats,
    value_of,
    with_response,
)
from services.policy.spans import token_spans
from services.policy.transposed_linears import TransposedLinears

if TYPE_CHECKING:
    from services.policy.protocol import RolloutPolicy
    from shared.schemas import ModelConfig

DEFAULT_LORA_TARGETS = r".*(language_model|text_model).*\.(q_proj|k_proj|v_proj|o_proj)"
__all__ = ["Generation", "Policy", "ScoreOutput"]


@dataclass
class ScoreOutput:
    """Per-token log-probs/entropies (B,T), values (B,), mask (B,T) of given responses."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor


class Policy:
    """A VLM policy with a value head; see the module docstring for the contract."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        *,
        finetune: str,
        lora: dict[str, Any] | None,
        model_path: Path,
        device: torch.device,
        dtype: torch.dtype,
        value_head: str = "linear",
        amp: bool = False,
    ) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.tokenizer.padding_side = "left"
        self.finetune = finetune
        self.lora = lora
        self.model_path = model_path
        self.device = device
        self.dtype, self.amp = dtype, amp  # amp: forward passes under bf16 autocast
        cfg = self.base_model.config
        self.model_type: str = cfg.model_type
        self.value_kind = value_head
        self.value_head = make_value_head(value_head, cfg.get_text_config().hidden_size).to(device)
        self._image_token = image_token_id(cfg)
        self.eos_id: int = self.tokenizer.eos_token_id
        self.pad_id: int = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = self.eos_id
        self.suppress_ids = suppressed_ids(self.tokenizer, cfg)
        norm = getattr(language_model(self.base_model), "norm", None)
        if not isinstance(norm, nn.Module):  # the value head reads the final norm's output
            raise ValueError(f"{self.model_type}: the language model has no final `norm` layer")
        self._final_norm = norm
        self.vision_in_checkpoint = finetune == "full"
        # Decode with a KV cache that grows in place (services/policy/kv_cache.py); False: HF's
        # dynamic cache, which copies the cache at every token (bench/decode_switch_bench.py).
        self.grow_kv_cache = True
        # Sample with one uniform per row against the CDF (services/policy/sampling.py); False:
        # HF's torch.multinomial, an exponential per vocabulary entry. The same distribution.
        self.cdf_sampling = True
        # Decode through each Linear's weight stored transposed, on the CPU only
        # (services/policy/transposed_linears.py); None: nn.Linear's own path.
        self.transposed_linears = (
            TransposedLinears(self._decode_linears()) if device.type == "cpu" else None
        )
        # Score with the last decoder layer only where score reads it (last_layer.py); None:
        # every position, as HF runs it (also for a layer that module does not handle).
        self.response_last_layer = ResponseLastLayer.of(language_model(self.base_model))
        self._lock = threading.RLock()
        self.model.eval()

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        model_path: str | Path,
        *,
        finetune: Literal["lora", "full"] = "lora",
        lora_r: int = 16,
        lora_alpha: int = 32,
        lora_dropout: float = 0.0,
        lora_target_modules: str = DEFAULT_LORA_TARGETS,
        lora_targets: str = "attention",
        value_head: str = "linear",
        device: str | None = None,
        dtype: str = "auto",
        seed: int = 0,
    ) -> Policy:
        """Load a local checkpoint folder and wrap it (LoRA on the LM, or full fine-tuning)."""
        from transformers import AutoModelForImageTextToText

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"no HF checkpoint (config.json) in {path}")
        set_threads()
        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        tdtype, amp = resolve_precision(dtype, dev, finetune)
        torch.manual_seed(seed)
        model: Any = AutoModelForImageTextToText.from_pretrained(path, dtype=tdtype)
        model = model.to(dev)
        processor = load_processor(path, model.config)
        lora = None
        if finetune == "lora":
            lora = {
                "r": lora_r,
                "alpha": lora_alpha,
                "dropout": lora_dropout,
                "target_modules": lora_target_modules,
                "targets": lora_targets,
            }
            model = add_lora(model, lora)
        elif finetune != "full":
            raise ValueError(f"finetune must be 'lora' or 'full', got {finetune!r}")
        return cls(
            model,
            processor,
            finetune=finetune,
            lora=lora,
            model_path=path,
            device=dev,
            dtype=tdtype,
            value_head=value_head,
            amp=amp,
        )

    @classmethod
    def from_config(cls, model_cfg: ModelConfig, model_path: str | Path, seed: int = 0) -> Policy:
        """Load `model_path` with a run's `ModelConfig` (always HF; vLLM: `serving_policy`)."""
        return cls.load(
            model_path,
            finetune=model_cfg.finetune,
            lora_r=model_cfg.lora_r,
            lora_alpha=model_cfg.lora_alpha,
            lora_dropout=model_cfg.lora_dropout,
            lora_target_modules=model_cfg.lora_target_modules,
            lora_targets=model_cfg.lora_targets,
            value_head=model_cfg.value_head,
            dtype=model_cfg.dtype,
            seed=seed,
        )

    @property
    def base_model(self) -> Any:
        """The underlying transformers model (inside the peft wrapper under LoRA)."""
        return self.model.get_base_model() if self.lora is not None else self.model

    # ---- inputs -----------------------------------------------------------------------------

    def render(self, prompt: str) -> str:
        """The chat-templated text for one prompt with one image before it."""
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}
        ]
        template = getattr(self.processor, "chat_template", None) or self.tokenizer.chat_template
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, chat_template=template
        )

    def _inputs(self, images: Sequence[ImageLike], prompts: Sequence[str]) -> dict[str, Any]:
        if len(images) != len(prompts):
            raise ValueError(f"{len(images)} images for {len(prompts)} prompts")
        if not prompts:
            raise ValueError("empty batch")
        pil = [to_pil(im) for im in images]
        imgs: list[Any] = [[im] for im in pil] if self.model_type == "idefics3" else pil
        batch = self.processor(
            images=imgs, text=[self.render(p) for p in prompts], return_tensors="pt", padding=True
        )
        out = {k: v.to(self.device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if "pixel_values" in out:
            out["pixel_values"] = out["pixel_values"].to(self.dtype)
        return out

    # ---- generate / score -------------------------------------------------------------------

    def generate(
        self,
        images: Sequence[ImageLike],
        prompts: Sequence[str],
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_new_tokens: int = 64,
        repetition_penalty: float = 1.0,
        repetition_scope: str = "generated",
        greedy: bool = False,
        seed: int | None = None,
    ) -> list[Generation]:
        """Sample one response per (image, prompt); see the module docstring.

        repetition_scope "generated": the penalty counts the response's own tokens only (the
        reference, which generated from embeddings); "all": HF's, prompt tokens included."""
        from transformers import GenerationConfig, LogitsProcessorList

        if temperature <= 0:
            raise ValueError("temperature must be > 0 (use greedy=True for argmax decoding)")
        # HF's own sampler (multinomial), or ours as the last processor over a greedy decode
        hf_sampling = not greedy and not self.cdf_sampling
        sampling = {"temperature": temperature, "top_p": top_p, "top_k": 0} if hf_sampling else {}
        gcfg = GenerationConfig(
            do_sample=hf_sampling,
            max_new_tokens=max_new_tokens,
            repetition_penalty=repetition_penalty if repetition_scope == "all" else 1.0,
            suppress_tokens=self.suppress_ids,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
            return_dict_in_generate=True,
            output_logits=True,
            **sampling,
        )
        with self._lock, torch.no_grad():
            inputs = self._inputs(images, prompts)
            prompt_len = inputs["input_ids"].shape[1]
            processors = LogitsProcessorList()
            if repetition_scope == "generated" and repetition_penalty != 1.0:
                processors.append(GeneratedRepetitionPenalty(repetition_penalty, prompt_len))
            if not greedy and self.cdf_sampling:
                processors.extend(sampling_processors(temperature, top_p))
            if seed is not None:
                torch.manual_seed(seed)
            linears = self.transposed_linears
            fast = linears.active() if linears is not None else nullcontext()
            # The value reads the hidden state at the prefill's last position (-1).
            amp = autocast(self.device, self.amp)  # mixed precision: resolve_precision
            with fast, amp, last_hidden(self._final_norm, -1, self._image_mask(inputs)) as hidden:
                out = self.model.generate(
                    **inputs,
                    generation_config=gcfg,
                    logits_processor=processors,
                    **self._cache_kwargs(),
                )
            values = value_of(self.value_head, *hidden[0])
            logits = torch.stack(out.logits, dim=1).float()  # (B, T, V) raw
            new = out.sequences[:, prompt_len:]
            logp, ent = token_stats(logits, new, temperature, self.suppress_ids)
        return [
            generation_of(self.tokenizer, self.eos_id, row, logp[i], ent[i], float(values[i]))
            for i, row in enumerate(new.tolist())
        ]

    def _cache_kwargs(self) -> dict[str, Any]:
        """A KV cache that grows in place (services/policy/kv_cache.py) where the model takes
        HF's dynamic cache; other models keep whatever HF gives them."""
        base = self.base_model
        supports = getattr(base, "_supports_default_dynamic_cache", None)
        if not self.grow_kv_cache or supports is None or not supports():
            return {}
        from services.policy.kv_cache import CACHE_ARG, growing_cache

        return {CACHE_ARG: growing_cache(base.config)}

    def _decode_linears(self) -> list[nn.Linear]:
        """The Linears a decode step runs: the language model's (LoRA's included) and the head."""
        base = self.base_model
        mods = [m for m in language_model(base).modules() if isinstance(m, nn.Linear)]
        head = base.get_output_embeddings()
        return mods + [head] if isinstance(head, nn.Linear) else mods

    def score(
        self,
        images: Sequence[ImageLike],
        prompts: Sequence[str],
        response_ids: Sequence[Sequence[int]],
        *,
        with_grad: bool = False,
        temperature: float = 1.0,
    ) -> ScoreOutput:
        """Log-probs, entropies and values of given responses (differentiable with `with_grad`)."""
        if len(response_ids) != len(prompts):
            raise ValueError(f"{len(response_ids)} responses for {len(prompts)} prompts")
        with self._lock:
            inputs = self._inputs(images, prompts)
            prompt_len = inputs["input_ids"].shape[1]
            resp, mask = pad_responses(response_ids, self.pad_id, self.device)
            full = with_response(inputs, resp, mask, self.model_type)
            grad = torch.enable_grad() if with_grad else torch.no_grad()
            self.model.train(with_grad)
            try:
                amp = autocast(self.device, self.amp)
                at, image = prompt_len - 1, self._image_mask(inputs)
                reads = last_hidden(self._final_norm, at, image, self.response_last_layer)
                with grad, amp, reads as hidden:
                    out = self.model(**full, use_cache=False, logits_to_keep=resp.shape[1] + 1)
                    values = value_of(self.value_head, *hidden[0])
                    logits = out.logits[:, :-1].float()  # position P-1+t predicts token t
                    logp, ent = token_stats(logits, resp, temperature, self.suppress_ids)
            finally:
                self.model.eval()
        maskf = mask.to(logp.dtype)
        # where, not multiply: a suppressed pad token has logp = -inf, and -inf * 0 is NaN.
        real = mask.bool()
        zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
        logp, ent = torch.where(real, logp, zero), torch.where(real, ent, zero)
        return ScoreOutput(logprobs=logp, entropy=ent, values=values, mask=maskf)

    def _image_mask(self, inputs: dict[str, Any]) -> torch.Tensor | None:
        """The prompt's image tokens (B, P, 1), for the image-reading value head; else None."""
        if self.value_kind != "mlp+image":
            return None
        return (inputs["input_ids"] == self._image_token).unsqueeze(-1)

    # ---- helpers for the trainer --------------------------------------------------------------

    def spans(self, token_ids: Sequence[int]) -> tuple[list[bool], list[bool]]:
        """(thought_mask, action_mask) of response tokens, from character offsets of `"action":`."""
        thought, action, _ = token_spans(self.tokenizer, list(token_ids), self.eos_id)
        return thought, action

    def encode_response(self, text: str) -> list[int]:
        """Token ids of a target output followed by EOS (an SFT target)."""
        return [*self.tokenizer.encode(text, add_special_tokens=False), self.eos_id]

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Parameters the optimiser updates: LoRA (or the whole model) + the value head."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return params + list(self.value_head.parameters())

    def vision_parameters(self) -> list[nn.Parameter]:
        """Vision tower + projector parameters (for the vision warm-up)."""
        self.vision_in_checkpoint = True
        return [p for _, p in self.vision_named_parameters()]

    def vision_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Vision tower + projector parameters by name, as a checkpoint stores them (no side
        effect, unlike ``vision_parameters``)."""
        inner = self.base_model.model
        names = ("vision_tower", "multi_modal_projector", "visual", "vision_model", "connector")
        return [
            (f"{n}.{k}", p)
            for n in names
            if hasattr(inner, n)
            for k, p in getattr(inner, n).named_parameters()
        ]

    def image_features(self, images: Sequence[ImageLike]) -> torch.Tensor:
        """Projector output per image, (B, N, d); differentiable when vision params require grad."""
        inputs = self._inputs(images, [""] * len(images))
        keys = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes")
        out = self.base_model.get_image_features(**{k: inputs[k] for k in keys if k in inputs})
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        return torch.stack(list(feats)) if isinstance(feats, list | tuple) else feats

    # ---- checkpoints --------------------------------------------------------------------------

    def save(self, directory: str | Path) -> Path:
        """Write adapter (or full weights) + value head + policy.json into `directory`."""
        return save_policy(self, Path(directory))

    def load_weights(self, directory: str | Path, value_head: bool = True) -> None:
        """Load a folder written by `save` into this policy (value_head=False: keep our head)."""
        with self._lock:
            load_policy_weights(self, Path(directory), value_head)

    def matches(self, meta: dict[str, Any]) -> bool:
        """Whether a checkpoint (its policy.json) fits this policy: same base model, fine-tuning
        mode, LoRA rank and value head, so ``load_weights`` can take it."""
        return (
            str(self.model_path) == meta["base_model"]
            and self.finetune == meta["finetune"]
            and (self.lora or {}).get("r") == (meta.get("lora") or {}).get("r")
            and self.value_kind == meta.get("value_head", "linear")
        )


def policy_for_checkpoint(
    current: Policy | None, directory: str | Path, dtype: str = "auto"
) -> Policy:
    """A policy holding `directory`'s weights: `current` when it ``matches`` the checkpoint, else
    a new one (in `dtype`) on the base model and fine-tuning the checkpoint records."""
    meta = read_checkpoint_meta(directory)
    if current is None or not current.matches(meta):
        current = Policy.load(meta["base_model"], dtype=dtype, **policy_kwargs(meta))
    current.load_weights(directory)
    return current


if TYPE_CHECKING:  # mypy holds the class to the contract the controller codes against
    _contract: type[RolloutPolicy] = Policy
