"""The env a warm start plays in. Here, below the trainer and the study, because both need it:
the trainer keys its warm-start cache by it, the study scheduler groups runs by it."""

from __future__ import annotations

from shared.schemas import EnvConfig


def warm_env(env: EnvConfig) -> EnvConfig:
    """The env a warm start plays in: the run's, with no early truncation. Truncation is a rule
    of the training loop (GTR's truncates, RL4VLM's does not); the warm start is the expert's
    play before any loop, so the arms of one task and seed share it, as the paper's methods
    share their SFT checkpoint. Changing this changes warm starts: bump RECIPE_VERSION in
    services/trainer/warmcache.py."""
    return env.model_copy(update={"early_truncation": "off"})
