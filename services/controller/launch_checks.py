"""What a run config may name, checked at launch against the launching team: its base model,
its starting checkpoint, ALFWorld's games, its corrector (``service.check_corrector``) and an
inline corrector's key variable (``keys.key_not_teams``). Each refusal is a 422 naming the
field. Every config that can be queued passes here, whatever its origin: a direct launch, a
study's cells, an imported study or run when resumed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from services.controller.launch import Invalid, check_corrector
from services.corrector.keys import key_not_teams
from shared.db.models import Run
from shared.paths import (
    CHECKPOINT_NOT_FOUND,
    GAMES_NOT_FOUND,
    MODEL_NOT_FOUND,
    confined,
    confined_games,
    run_of_checkpoint,
)
from shared.schemas import RunConfig
from shared.settings import Settings, get_settings


def check_launch(
    session: Session, config: RunConfig, team: str, settings: Settings | None = None
) -> RunConfig:
    """The config with its paths resolved, or Invalid. One message for "absent" and "not
    allowed", so nothing here tells a team what exists outside its reach."""
    settings = settings or get_settings()
    check_corrector(session, config, team)
    inline = config.corrector.inline()
    refused = key_not_teams(session, team, inline) if inline else None
    if refused is not None:
        raise Invalid(("corrector", "api_key_env"), refused)
    updates: dict[str, Any] = {}
    if config.model.path:
        roots = [settings.models_path, *settings.model_roots]
        path = confined(config.model.path, roots, "config.json")
        if path is None:
            raise Invalid(("model", "path"), MODEL_NOT_FOUND)
        updates["model"] = config.model.model_copy(update={"path": str(path)})
    if config.init.kind == "checkpoint" and config.init.checkpoint:
        path = _checkpoint(session, config.init.checkpoint, team, settings)
        updates["init"] = config.init.model_copy(update={"checkpoint": str(path)})
    options = config.env.options
    if config.task == "alfworld" and options.get("games") is not None:
        games = confined_games(options["games"], settings.games_paths)
        if games is None:
            raise Invalid(("env", "options", "games"), GAMES_NOT_FOUND)
        env = config.env.model_copy(update={"options": {**options, "games": games}})
        updates["env"] = env
    return config.model_copy(update=updates) if updates else config


def _checkpoint(session: Session, text: str, team: str, settings: Settings) -> Path:
    """A checkpoint by its id in the store (``run-3/update-2``) or a path under an allowed root;
    one in the store must belong to a run of the same team."""
    store = settings.checkpoints_path
    path = confined(text, [store, *settings.checkpoint_roots], "policy.json")
    if path is not None:
        run_id = run_of_checkpoint(path, store)
        owner = session.scalar(select(Run.team).where(Run.id == run_id)) if run_id else None
        if run_id is None or owner == team:
            return path
    raise Invalid(("init", "checkpoint"), CHECKPOINT_NOT_FOUND)
