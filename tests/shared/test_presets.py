"""Every run preset in configs/ is a valid run config (a typo fails here, not on a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.schemas import RunConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_preset_validates(path: Path) -> None:
    cfg = RunConfig.from_toml(path)
    assert cfg.name and cfg.task
