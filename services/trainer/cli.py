"""``gtr sft CONFIG --out DIR``: the warm start of a run config, written as a policy checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Folder for the warm-started policy checkpoint",
)
@click.option(
    "--eval-episodes",
    default=30,
    show_default=True,
    type=click.IntRange(0, 10_000),
    help="Greedy episodes played after the warm start (0 = skip)",
)
def sft(config: Path, out: Path, eval_episodes: int) -> None:
    """Warm-start the policy of CONFIG (vision warm-up + oracle SFT) into OUT."""
    from pydantic import ValidationError

    from shared.schemas import RunConfig

    try:
        cfg = RunConfig.from_toml(config)
    except (ValidationError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="CONFIG") from e
    if out.exists() and any(out.iterdir()):
        raise click.ClickException(f"{out} is not empty")
    from services.trainer.warmstart import init_policy

    # The command is the warm start whatever the config's init kind says.
    cfg = cfg.model_copy(update={"init": cfg.init.model_copy(update={"kind": "warm_start"})})
    policy, summary = init_policy(cfg, out / "base", eval_episodes)
    policy.save(out)
    (out / "warm_start.json").write_text(json.dumps(summary, indent=2))
    click.echo(json.dumps(summary))
