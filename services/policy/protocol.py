"""The policy contract: what a run asks of whatever serves its policy.

A rollout needs two things of a policy: a batch of sampled responses (``generate``) and a
checkpoint to sample from (``load_weights``). ``Policy`` (HF, in this process), ``VllmPolicy``
(vLLM samples, HF scores), ``PolicyClient`` (the policy service over HTTP) and the controller's
``InProcessPolicy`` all satisfy it; mypy holds each to it (an ``if TYPE_CHECKING`` line beside
each class). Torch-free, like ``schemas.py``: the controller imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image

from services.policy.schemas import Generation

ImageLike = np.ndarray | Image.Image  # an HxWx3 uint8 frame, or a PIL image


class RolloutPolicy(Protocol):
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
        """One response per (image, prompt), with its token ids, log-probs, value and
        thought/action masks; the full contract is in ``services/policy/service.py``."""
        ...

    def load_weights(self, directory: str | Path, /) -> None:
        """Sample from the checkpoint folder ``directory`` (written by ``Policy.save``) on."""
        ...
