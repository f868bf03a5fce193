"""Checks a run config can fail before any run row exists: extras, games, model, checkpoint.

`gtr train` calls ``preflight`` right after reading the config, so a wrong path or a missing
extra is one line and a non-zero exit, not a failed run (and its traceback) in the store.
"""

from __future__ import annotations

from pathlib import Path

from shared.schemas import RunConfig


class PreflightError(ValueError):
    """The run cannot start; the message says why in one line."""


def preflight(cfg: RunConfig) -> None:
    """Raise PreflightError on the first problem a run would hit at start-up."""
    if cfg.model.path is not None and not Path(cfg.model.path).is_dir():
        raise PreflightError(f"model.path: no model folder at {cfg.model.path}")
    if cfg.init.kind == "checkpoint" and not Path(str(cfg.init.checkpoint)).is_dir():
        raise PreflightError(f"init.checkpoint: no checkpoint folder at {cfg.init.checkpoint}")
    if cfg.task == "alfworld":
        _check_alfworld(cfg)
        return
    from services.env.registry import make_env

    try:
        make_env(cfg.task, cfg.env, seed=0).close()
    except (ValueError, ImportError, OSError) as e:
        raise PreflightError(f"env: {e}") from None


def _check_alfworld(cfg: RunConfig) -> None:
    """The extra is installed, the options are valid and the games folder holds games.

    Finding games reads only the file system; parsing them (seconds) is left to the run."""
    from services.env.alfworld import MISSING_EXTRA, GamesError
    from services.env.alfworld.games import find_games

    try:
        from services.env.alfworld.env import AlfWorldOptions
    except ModuleNotFoundError as e:
        raise PreflightError(f"{MISSING_EXTRA} ({e})") from None
    try:
        options = AlfWorldOptions.model_validate(cfg.env.options)
        find_games(options.games)
    except GamesError as e:
        raise PreflightError(f"env.options.games: {e}") from None
    except ValueError as e:
        raise PreflightError(f"env.options: {e}".replace("\n", " ")) from None
