"""Optional vLLM generation backend (GPU only; ``pip install vllm`` on the GPU box).

vLLM samples the tokens (fast paged decoding, the LoRA adapter of the current checkpoint loaded
per request); the HF `Policy` then scores the sampled ids in one forward pass, so log-probs,
entropies, values and spans are exactly what the trainer's `score` computes. Not exercised in CI:
vllm cannot be installed on the CPU machines (see offline-models.md §5); its test is marked `gpu`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.policy.checkpoint import read_checkpoint_meta
from services.policy.loading import to_pil
from services.policy.protocol import ImageLike
from services.policy.schemas import Generation
from services.policy.scoring import generation_of
from services.policy.service import Policy, ScoreOutput, policy_for_checkpoint

if TYPE_CHECKING:
    from services.policy.protocol import RolloutPolicy


def vllm_available() -> bool:
    """True when vllm imports and a CUDA device is present."""
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def served_for_checkpoint(
    current: Policy | VllmPolicy | None,
    directory: str | Path,
    dtype: str = "auto",
    backend: str = "hf",
) -> Policy | VllmPolicy:
    """The policy that serves rollouts from `directory`: `current` when it ``matches`` the
    checkpoint, else one built for it (``policy_for_checkpoint``), sampling with vLLM when
    `backend` is "vllm"."""
    if current is not None and current.matches(read_checkpoint_meta(directory)):
        current.load_weights(directory)
        return current
    policy = policy_for_checkpoint(None, directory, dtype)
    if backend != "vllm":
        return policy
    served = VllmPolicy(policy)
    served.load_weights(directory)  # the HF weights again, and vLLM pointed at the adapter
    return served


VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts


def lora_rank_cap(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds a LoRA of `rank` (the paper's: 128)."""
    for cap in VLLM_LORA_RANKS:
        if cap >= rank:
            return cap
    raise ValueError(f"vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, not {rank}")


def generated_penalty(penalty: float) -> Any:
    """A vLLM per-request logits processor: the repetition penalty over the output tokens only.

    vLLM's own ``repetition_penalty`` counts the prompt as well; this one sees only
    ``output_token_ids`` (vLLM's ``(output_token_ids, logits)`` logits-processor form)."""
    import torch

    from services.policy.heads import penalise

    def process(output_token_ids: list[int], logits: Any) -> Any:
        if not output_token_ids:
            return logits
        ids = torch.tensor([output_token_ids], device=logits.device)
        return penalise(logits.unsqueeze(0), ids, penalty).squeeze(0)

    return process


class VllmPolicy:
    """A `Policy` whose `generate` samples on vLLM; the HF policy scores, saves and loads."""

    def __init__(
        self,
        policy: Policy,
        *,
        gpu_memory_utilization: float = 0.3,
        max_lora_rank: int | None = None,
    ) -> None:
        try:
            from vllm import LLM
        except ImportError as e:
            raise RuntimeError("the vllm backend needs `pip install vllm` on a CUDA machine") from e
        self.policy = policy
        self.llm = LLM(
            model=str(policy.model_path),
            dtype="bfloat16",
            enable_lora=policy.lora is not None,
            # At least the policy's rank: vLLM refuses an adapter above it (paper: r = 128).
            max_lora_rank=max_lora_rank or lora_rank_cap((policy.lora or {}).get("r", 8)),
            gpu_memory_utilization=gpu_memory_utilization,
            limit_mm_per_prompt={"image": 1},
            seed=0,
        )
        self._lora: Any = None
        self._lora_ids = itertools.count(1)
        self._allowed = sorted(set(range(len(policy.tokenizer))) - set(policy.suppress_ids))

    @property
    def model_path(self) -> Path:
        return self.policy.model_path

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    def matches(self, meta: dict[str, Any]) -> bool:
        return self.policy.matches(meta)

    def load_weights(self, directory: str | Path) -> None:
        """Load a checkpoint into the HF policy and point vLLM at its LoRA adapter."""
        from vllm.lora.request import LoRARequest

        self.policy.load_weights(directory)
        if self.policy.lora is not None:
            n = next(self._lora_ids)
            self._lora = LoRARequest(f"ckpt{n}", n, str(Path(directory).resolve()))

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
        """Sample with vLLM, then score with the HF policy (same contract as `Policy.generate`).

        repetition_scope "generated" needs vLLM's per-request logits processors (the V0 engine,
        ``VLLM_USE_V1=0``); "all" uses vLLM's built-in penalty, prompt included."""
        from vllm import SamplingParams

        own = repetition_scope == "generated" and repetition_penalty != 1.0
        params = SamplingParams(
            temperature=0.0 if greedy else temperature,
            top_p=top_p,
            max_tokens=max_new_tokens,
            repetition_penalty=1.0 if own else repetition_penalty,
            logits_processors=[generated_penalty(repetition_penalty)] if own else None,
            seed=seed,
            allowed_token_ids=self._allowed,
            stop_token_ids=[self.policy.eos_id],
            skip_special_tokens=False,
        )
        requests = [
            {"prompt": self.policy.render(p), "multi_modal_data": {"image": to_pil(im)}}
            for im, p in zip(images, prompts, strict=True)
        ]
        outs = self.llm.generate(requests, params, lora_request=self._lora, use_tqdm=False)
        ids = [list(o.outputs[0].token_ids) for o in outs]
        scored = self.policy.score(images, prompts, ids, temperature=temperature)
        return [
            generation_of(
                self.policy.tokenizer,
                self.policy.eos_id,
                r,
                scored.logprobs[i],
                scored.entropy[i],
                float(scored.values[i]),
            )
            for i, r in enumerate(ids)
        ]

    def score(
        self,
        images: Sequence[ImageLike],
        prompts: Sequence[str],
        response_ids: Sequence[Sequence[int]],
        *,
        temperature: float = 1.0,
    ) -> ScoreOutput:
        """The HF policy's scores (what the trainer computes) of given responses."""
        return self.policy.score(images, prompts, response_ids, temperature=temperature)


if TYPE_CHECKING:  # mypy holds the class to the contract the controller codes against
    _contract: type[RolloutPolicy] = VllmPolicy
