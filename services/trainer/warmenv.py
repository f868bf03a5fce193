"""The env a warm start plays in (torch-free: the study scheduler groups warm starts by it)."""

from __future__ import annotations

from shared.schemas import EnvConfig


def warm_env(env: EnvConfig) -> EnvConfig:
    """The env a warm start plays in: the run's, with no early truncation. Truncation is a rule
    of the training loop (GTR's truncates, RL4VLM's does not); the warm start is the expert's
    play before any loop, so the arms of one task and seed share it, as the paper's methods
    share their SFT checkpoint. Changing this changes warm starts: bump warmcache.RECIPE_VERSION."""
    return env.model_copy(update={"early_truncation": "off"})
