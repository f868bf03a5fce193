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
@click.option(
    "--dataset",
    type=click.Path(exists=True, path_type=Path),
    help="A run exported with 'gtr export': SFT on its corrected outputs after the "
    "config's init (its sft_steps, lr and batch_size)",
)
def sft(config: Path, out: Path, eval_episodes: int, dataset: Path | None) -> None:
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

    if dataset is not None:
        from services.trainer.sft_data import dataset_samples
        from services.trainer.warmstart import greedy_eval, sft_warmup

        try:
            samples = dataset_samples(dataset)
        except (ValueError, KeyError, OSError) as e:  # not JSON lines, no prompt column, ...
            raise click.ClickException(
                f"{dataset} is not a dataset written by 'gtr export' ({type(e).__name__}: {e})"
            ) from None
        if not samples:
            raise click.ClickException(f"{dataset} has no corrected or agreed step with a frame")
        policy, summary = init_policy(cfg, out / "base")  # the config's own init first
        i = cfg.init
        summary |= sft_warmup(policy, samples, i.sft_steps, i.batch_size, i.lr, cfg.seed)
        summary["dataset/samples"] = float(len(samples))
        if eval_episodes:  # under the run's evaluation protocol, as its runs evaluate
            from shared.evalrules import eval_rules

            rules = eval_rules(cfg)
            tokens = rules.max_new_tokens
            summary |= greedy_eval(policy, cfg.task, rules.env, eval_episodes, cfg.seed, tokens)
        policy.save(out)
        (out / "warm_start.json").write_text(json.dumps(summary, indent=2))
        click.echo(json.dumps(summary))
        return
    # The command is the warm start whatever the config's init kind says.
    cfg = cfg.model_copy(update={"init": cfg.init.model_copy(update={"kind": "warm_start"})})
    policy, summary = init_policy(cfg, out / "base", eval_episodes)
    policy.save(out)
    (out / "warm_start.json").write_text(json.dumps(summary, indent=2))
    click.echo(json.dumps(summary))
