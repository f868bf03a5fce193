"""ALFWorld household tasks in the GTR setting: TextWorld engine, schematic images, oracle.

Needs the `alfworld` extra (`pip install 'gtr-lab[alfworld]'`) to make envs; the oracle, the
prompts and `subtask` work on a state dict without it. Games: see docs/alfworld.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from services.env.alfworld.games import SUBTASKS, GamesError
from services.env.alfworld.oracle import oracle_output, subtask, thought_relevant
from services.env.alfworld.prompts import ALFWORLD_PROMPT, corrector_prompt

if TYPE_CHECKING:
    import gymnasium

    from shared.schemas import EnvConfig

__all__ = [
    "ALFWORLD_PROMPT",
    "SUBTASKS",
    "GamesError",
    "corrector_prompt",
    "make_alfworld_env",
    "oracle_output",
    "subtask",
    "thought_relevant",
]

MISSING_EXTRA = (
    "ALFWorld needs the alfworld extra: pip install 'gtr-lab[alfworld]' "
    "(alfworld==0.4.2 and pyyaml)"
)


def make_alfworld_env(config: EnvConfig | None, seed: int | None) -> gymnasium.Env[Any, Any]:
    """An ALFWorld env for `config` (options: AlfWorldOptions); GamesError on bad input."""
    from shared.schemas import EnvConfig

    config = config or EnvConfig.model_validate({})
    try:
        from services.env.alfworld.env import AlfWorldEnv, AlfWorldOptions
    except ModuleNotFoundError as e:
        raise ImportError(f"{MISSING_EXTRA} ({e})") from e
    try:
        options = AlfWorldOptions.model_validate(config.options)
    except ValidationError as e:  # field and reason, never the input (the service shows it)
        why = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
        raise GamesError(f"invalid alfworld options: {why}") from e
    max_steps = config.max_episode_steps or 50
    if options.backend == "thor":
        from services.env.alfworld.thor import make_thor_env

        return make_thor_env(options, config.image_size, max_steps, config.invalid_action, seed)
    return AlfWorldEnv(options, config.image_size, max_steps, config.invalid_action, seed)
