"""The rollout record: round trip through bytes, validation of shapes."""

from __future__ import annotations

import numpy as np
import pytest

from shared.rollout import Rollout


def make_rollout(num_envs: int = 2, num_steps: int = 3, seed: int = 0) -> Rollout:
    rng = np.random.default_rng(seed)
    n = num_envs * num_steps
    seqs = [list(rng.integers(1, 50, size=rng.integers(2, 6))) for _ in range(n)]
    ids, lengths = Rollout.pad_responses(seqs)
    valid = np.arange(ids.shape[1])[None, :] < lengths[:, None]
    thought = valid & (np.arange(ids.shape[1])[None, :] < 1)
    return Rollout(
        num_envs=num_envs,
        num_steps=num_steps,
        step_ids=np.arange(100, 100 + n, dtype=np.int64),
        prompts=np.array([f"prompt {i} ünïcode" for i in range(n)]),
        image_shas=np.array(["ab" * 32] * (n - 1) + [""]),
        response_ids=ids,
        response_lengths=lengths,
        old_logprobs=(-rng.random(ids.shape) * valid).astype(np.float32),
        thought_mask=thought,
        action_mask=valid & ~thought,
        values=rng.random(n).astype(np.float32),
        rewards=rng.random(n).astype(np.float32),
        dones=rng.random(n) < 0.3,
        format_valid=rng.random(n) < 0.7,
        actions=np.array(["+", "-"] * (n // 2)),
        last_values=np.zeros(num_envs, np.float32),
    )


def test_round_trip_keeps_every_field() -> None:
    r = make_rollout()
    back = Rollout.from_bytes(r.to_bytes())
    assert (back.num_envs, back.num_steps, back.size) == (2, 3, 6)
    for name in (
        "step_ids",
        "response_ids",
        "response_lengths",
        "old_logprobs",
        "thought_mask",
        "action_mask",
        "values",
        "rewards",
        "dones",
        "format_valid",
        "last_values",
    ):
        np.testing.assert_array_equal(getattr(back, name), getattr(r, name), err_msg=name)
    assert list(back.prompts) == list(r.prompts)
    assert back.image_shas[-1] == "" and back.actions[1] == "-"


def test_padding_and_lengths() -> None:
    ids, lengths = Rollout.pad_responses([[5, 6, 7], [8]], pad_id=0)
    np.testing.assert_array_equal(ids, [[5, 6, 7], [8, 0, 0]])
    np.testing.assert_array_equal(lengths, [3, 1])


def test_wrong_shapes_are_refused() -> None:
    r = make_rollout()
    with pytest.raises(ValueError, match="rewards"):
        Rollout(**{**r.__dict__, "rewards": r.rewards[:-1]})
    with pytest.raises(ValueError, match="last_values"):
        Rollout(**{**r.__dict__, "last_values": np.zeros(5, np.float32)})
