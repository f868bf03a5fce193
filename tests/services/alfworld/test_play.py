"""`gtr env play alfworld` as a new user runs it, and which sample games are benchmark games."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from services.cli import main
from tests.services.alfworld.conftest import SAMPLE


def test_play_names_the_games_and_the_expert_wins(
    real_games: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # outside the repository
    args = ["env", "play", "alfworld", "--games", str(real_games), "--expert"]
    result = CliRunner().invoke(main, [*args, "--save-frames", "frames"])
    assert result.exit_code == 0, result.output
    assert "terminated" in result.output and "success True" in result.output
    frames = sorted((tmp_path / "frames").glob("frame_*.png"))
    assert len(frames) >= 7  # the expert's walk: start, ..., the potato in the sinkbasin
    first, last = (np.asarray(Image.open(f)) for f in (frames[0], frames[-1]))
    assert first.shape == (300, 300, 3) and (first != last).any()  # labels readable at 300 px


def test_play_without_games_says_how_to_name_them(alfworld_installed: None) -> None:
    result = CliRunner().invoke(main, ["env", "play", "alfworld", "--expert"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "--games DIR" in result.output and "--scene" not in result.output
    wrong = CliRunner().invoke(main, ["env", "play", "numberline", "--games", "."])
    assert wrong.exit_code == 2 and "only the alfworld task has games" in wrong.output


def test_goal_swaps_are_not_benchmark_games(real_games: Path) -> None:
    from services.controller.metrics import benchmark_share
    from services.env.alfworld.games import find_games, load_task

    tasks = [load_task(g) for g in find_games(str(SAMPLE))]
    real = [t for t in tasks if "/real/" in t.game_file]
    swaps = [t for t in tasks if "/goal_swaps/" in t.game_file]
    assert len(real) == 1 and len(swaps) == 5
    assert real[0].benchmark and not any(t.benchmark or t.synthetic for t in swaps)
    states = [{"benchmark": t.benchmark} for t in tasks]
    assert benchmark_share(states)["benchmark_share"] == pytest.approx(1 / 6)
    assert benchmark_share([{"cards": [1, 2]}]) == {}
