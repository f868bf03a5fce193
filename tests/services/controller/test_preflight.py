"""`gtr train` as a new user meets it, from a folder outside the repository: paths relative to
the config file, bad paths refused before a run exists, messages printed intact."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from services.cli import main
from services.controller.console import load_config, print_summary, success_cell
from tests.conftest import ROOT, need
from tests.services.controller.test_display_frames import _Gen

ALFWORLD = """
name = "{name}"
task = "alfworld"
[env.options]
games = "{games}"
"""


def test_every_path_resolves_against_the_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.schemas import RunConfig

    folder = tmp_path / "configs"
    folder.mkdir()
    cfg = folder / "run.toml"
    cfg.write_text(
        'task = "alfworld"\n[env.options]\ngames = ["../games", "/abs/games", "$HOME/g"]\n'
        '[model]\npath = "models/tiny"\n[init]\nkind = "checkpoint"\ncheckpoint = "~/ck"\n'
    )
    monkeypatch.chdir(tmp_path / "..")  # anywhere but the config's folder
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for loaded in (load_config(cfg), RunConfig.from_toml(cfg)):
        assert loaded.env.options["games"] == [
            str(tmp_path / "games"),
            "/abs/games",
            str(tmp_path / "home" / "g"),
        ]
        assert loaded.model.path == str(folder / "models" / "tiny")
        assert loaded.init.checkpoint == str(tmp_path / "home" / "ck")
    # The preset's sample games are found next to the repository, from any folder.
    preset = load_config(ROOT / "configs" / "alfworld-tiny.toml")
    # (resolved: a checkout whose ../shared is a symlink finds the games where the link points)
    sample = ROOT.parent / "shared" / "alfworld_sample"
    assert preset.env.options["games"] == str(sample.resolve())


def _runs_named(name: str) -> int:
    from shared.db.models import Run
    from shared.db.session import session_scope

    with session_scope() as s:
        return int(s.scalar(select(func.count()).select_from(Run).where(Run.name == name)) or 0)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (ALFWORLD.replace("{games}", "no-such-folder"), "games folder {tmp}/no-such-folder does"),
        (ALFWORLD.replace("{games}", "."), "no solvable games under"),
        (
            'name = "{name}"\ntask = "numberline"\n[model]\npath = "m"\n',
            "no model folder at {tmp}/m",
        ),
        (
            'name = "{name}"\ntask = "numberline"\n[init]\nkind = "checkpoint"\ncheckpoint = "c"\n',
            "no checkpoint folder at {tmp}/c",
        ),
        # folders that exist but hold no model: the run's own folder
        (
            'name = "{name}"\ntask = "numberline"\n[model]\npath = "."\n',
            "holds no config.json (a Hugging Face model)",
        ),
        (
            'name = "{name}"\ntask = "numberline"\n[init]\nkind = "checkpoint"\ncheckpoint = "."\n',
            "is neither a policy checkpoint (policy.json) nor a model folder (config.json)",
        ),
        (ALFWORLD.replace("{games}", ".") + 'backend = "3d"\n', "env.options"),
    ],
)
def test_bad_paths_fail_in_one_line_before_a_run_exists(
    config: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str
) -> None:
    name = f"preflight-{uuid.uuid4().hex[:8]}"
    (tmp_path / "run.toml").write_text(config.replace("{name}", name))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["train", "run.toml"])
    assert result.exit_code == 1, result.output
    assert message.replace("{tmp}", str(tmp_path)) in result.output, result.output
    assert result.output.startswith("Error: ") and len(result.output.strip().splitlines()) == 1
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)
    assert _runs_named(name) == 0


def test_a_vllm_backend_is_refused_where_vllm_cannot_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pg_url: str
) -> None:
    from importlib.util import find_spec

    need(find_spec("vllm") is None, "vllm is installed here: nothing to refuse")
    name = f"preflight-{uuid.uuid4().hex[:8]}"
    (tmp_path / "run.toml").write_text(
        f'name = "{name}"\ntask = "numberline"\n[model]\nbackend = "vllm"\n'
    )
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["train", "run.toml"])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("Error: model.backend: 'vllm' needs vllm and a CUDA device")
    assert "backend = 'hf'" in result.output and "Traceback" not in result.output
    assert _runs_named(name) == 0


def _failed_unfinished_run(policy: Any, error: str) -> int:
    """A run whose rollout finished no episode, then failed with ``error`` (both recorded by
    the driver itself)."""
    from services.api.service import create_run
    from services.controller.service import RunDriver
    from shared.db.session import session_scope
    from shared.schemas import RunConfig

    cfg = RunConfig.model_validate(
        {
            "task": "numberline",
            "env": {"image_size": 32, "invalid_action": "noop", "display_size": 0},
            "train": {"num_envs": 2, "num_steps": 2, "num_updates": 1},
        }
    )
    with session_scope() as s:
        run_id = create_run(s, cfg, team="default").id
    driver = RunDriver(run_id, _pool(), policy, None, None)  # type: ignore[arg-type]
    driver.episodes.open(0)
    driver._rollout_and_store(0)
    driver.episodes.close()
    driver._end("failed", error)
    return run_id


def _pool() -> Any:
    from services.env.service import EnvPool

    return EnvPool()


class Babbler:
    """Never writes a readable answer: every step is a penalised no-op, no episode ends."""

    def generate(self, images: list[Any], prompts: list[str], **kw: Any) -> list[_Gen]:
        return [_Gen("I am not sure") for _ in images]


def test_a_run_without_finished_episodes_says_so_and_errors_print_intact(
    pg_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from shared.db.models import Update
    from shared.db.session import session_scope

    error = "ImportError: ALFWorld needs the alfworld extra: pip install 'gtr-lab[alfworld]'"
    run_id = _failed_unfinished_run(Babbler(), error)
    with session_scope() as s:
        metrics = s.scalars(select(Update.metrics).where(Update.run_id == run_id)).one()
    assert "success_rate" not in metrics
    assert success_cell(metrics) == "0 of 2 finished"
    capsys.readouterr()
    print_summary(run_id, 1.0)
    out = capsys.readouterr().out
    assert "success_rate" in out and "0 of 2 finished" in out
    assert "pip install 'gtr-lab[alfworld]'" in " ".join(out.split())
