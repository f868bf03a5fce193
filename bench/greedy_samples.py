"""What a study run's final checkpoint writes: its greedy outputs on the first held-out deals.

    .venv/bin/python bench/greedy_samples.py RUN_DIR [--n 3]

RUN_DIR is a run folder of ``bench/reproduce.py`` (``config.toml`` + ``data/``). The deals are the
greedy evaluation's (``shared.seeds.eval_seed(i)``, the same for every run of a task), so the
outputs of two arms on one deal sit side by side on the results page. Prints one JSON list: per
deal the true state, the output, and whether its thought names the true state (the probe's
relevance test).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click


def final_checkpoint(run_dir: Path) -> Path | None:
    """The run's last ``update-NNNNN`` checkpoint folder, None when it wrote none."""
    found = sorted((run_dir / "data" / "checkpoints").glob("run-*/update-*"))
    return found[-1] if found else None


def greedy_samples(run_dir: Path, n: int = 3) -> list[dict[str, Any]]:
    """The final checkpoint's greedy first-step outputs on the first ``n`` held-out deals."""
    from services.controller.console import load_config
    from services.env import make_env
    from services.env.expert import thought_matches_state
    from services.policy.service import policy_for_checkpoint
    from shared.seeds import eval_seed

    cfg = load_config(run_dir / "config.toml")
    checkpoint = final_checkpoint(run_dir)
    if checkpoint is None:
        raise click.ClickException(f"{run_dir}: no update checkpoint under data/checkpoints")
    policy = policy_for_checkpoint(None, checkpoint, dtype=cfg.model.dtype)
    envs = [make_env(cfg.task, cfg.env, seed=eval_seed(i)).unwrapped for i in range(n)]
    frames = [env.reset()[0] for env in envs]
    gens = policy.generate(
        frames,
        [env.prompt() for env in envs],
        greedy=True,
        max_new_tokens=cfg.generation.max_new_tokens,
    )
    out = []
    for env, gen in zip(envs, gens, strict=True):
        parsed = env.parse(gen.text)
        state = env.state()
        out.append(
            {
                "state": state,
                "output": gen.text,
                "format_valid": bool(parsed.format_valid),
                "reads_state": bool(
                    parsed.format_valid and thought_matches_state(cfg.task, parsed.thought, state)
                ),
            }
        )
    return out


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--n", default=3, show_default=True, help="held-out deals")
def main(run_dir: Path, n: int) -> None:
    from services.policy.loading import set_threads

    set_threads()
    json.dump(greedy_samples(run_dir, n), sys.stdout)
    print()


if __name__ == "__main__":
    main()
