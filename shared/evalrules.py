"""The rules a run's greedy evaluations play under. Here, below the trainer and the controller,
because both evaluate: the run driver its start and updates (services/controller/evaluate.py),
the warm start tool (``gtr sft``) the policy it wrote."""

from __future__ import annotations

from shared.schemas import EvalProtocol, RunConfig


def eval_rules(cfg: RunConfig) -> EvalProtocol:
    """The run's evaluation protocol: its declared ``metrics.eval_protocol``, else its own env
    and token cap. Frames for people are never drawn, so ``display_size`` is no part of it."""
    declared = cfg.metrics.eval_protocol
    env = declared.env if declared is not None else cfg.env
    tokens = declared.max_new_tokens if declared is not None else cfg.generation.max_new_tokens
    return EvalProtocol(env=env.model_copy(update={"display_size": 0}), max_new_tokens=tokens)
