"""Env seeds: training, evaluation and probe deals come from disjoint ranges of integers.

A gym_cards session replays its deals from its seed (services/env/base.py), so two sessions with
one seed deal the same cards. Training envs (and the warm start's oracle data) use seeds below
TRAIN_SEED_LIMIT for every valid run config; evaluation and probe deals use seeds from 2**60 up,
which no training env can reach. Deals may still coincide by content (NumberLine has only a few
hundred); the study report counts those. Seeds must stay below 2**63 (BigInteger columns, the env
service's bound).
"""

from __future__ import annotations

MAX_RUN_SEED = 2**31 - 1  # RunConfig.seed
MAX_UPDATES = 100_000  # TrainConfig.num_updates
MAX_ENVS = 256  # TrainConfig.num_envs
# The largest training seed: ((MAX_RUN_SEED * 1000 + MAX_UPDATES) * 1000 + MAX_ENVS) < 2**51.
TRAIN_SEED_LIMIT = 2**52
EVAL_SEED_BASE = 2**60  # evaluation deal i has seed EVAL_SEED_BASE + i
PROBE_SEED_BASE = 2**60 + 2**40  # probe state i has seed PROBE_SEED_BASE + i
SPACE_SIZE = 2**40  # seeds per evaluation / probe space


def train_env_seed(run_seed: int, update: int, slot: int) -> int:
    """The seed of a training env session opened at ``update`` in env slot ``slot`` (grpo: the
    group's index, so a group's envs share it). A resumed run opens new sessions at a new
    update, so its envs never replay the deals before the interruption."""
    return (run_seed * 1000 + update) * 1000 + slot


def warm_start_seed(run_seed: int) -> int:
    """The seed of the warm start's oracle-trajectory env (services/trainer/warmstart.py)."""
    return run_seed


def eval_seed(deal: int) -> int:
    """The seed of evaluation deal ``deal``: the same deal in every run of a task."""
    if not 0 <= deal < SPACE_SIZE:
        raise ValueError(f"evaluation deal {deal} is outside 0..{SPACE_SIZE - 1}")
    return EVAL_SEED_BASE + deal


def probe_seed(i: int) -> int:
    """The seed of the i-th probe episode: the same probe states in every run of a task."""
    if not 0 <= i < SPACE_SIZE:
        raise ValueError(f"probe index {i} is outside 0..{SPACE_SIZE - 1}")
    return PROBE_SEED_BASE + i
