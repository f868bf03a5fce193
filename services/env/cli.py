"""``gtr env``: play an environment from the terminal, or serve the env REST service."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from services.env.registry import TASKS


@click.group("env")
def env() -> None:
    """Environments: play one, or serve them over REST."""


def _save(frames: Path | None, index: int, image) -> None:  # noqa: ANN001 - a numpy array
    if frames is not None:
        from PIL import Image

        Image.fromarray(image).save(frames / f"frame_{index:03d}.png")


def _pick(names: list[str], typed: str) -> int:
    lookup = {n.lower(): i for i, n in enumerate(names)}
    if typed.strip().lower() not in lookup:
        raise click.BadParameter(
            f"{typed!r} is not an action here; legal: {', '.join(names)}", param_hint="action"
        )
    return lookup[typed.strip().lower()]


@env.command()
@click.argument("task", type=click.Choice(TASKS))
@click.option(
    "--seed", type=click.IntRange(min=0), default=0, show_default=True, help="Seeds the deal"
)
@click.option(
    "--actions",
    default=None,
    help='Comma-separated actions, e.g. "(,4,-,1,),*,8,="; omit to type them',
)
@click.option("--expert", is_flag=True, help="Let the oracle play instead")
@click.option(
    "--save-frames",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write frame_NNN.png here",
)
@click.option("--image-size", type=click.IntRange(32, 1024), default=300, show_default=True)
@click.option(
    "--games",
    type=click.Path(exists=True, path_type=Path),
    default=None,
    help="ALFWorld: folder of games (env.options.games)",
)
@click.option(
    "--early-truncation",
    is_flag=True,
    help="Points games: stop once the formula cannot reach the target",
)
def play(
    task: str,
    seed: int,
    actions: str | None,
    expert: bool,
    save_frames: Path | None,
    image_size: int,
    games: Path | None,
    early_truncation: bool,
) -> None:
    """Play one episode of TASK with scripted, typed or expert actions; print each step."""
    from services.env.expert import expert_action
    from services.env.registry import make_env
    from shared.schemas import EnvConfig

    if games is not None and task != "alfworld":
        raise click.BadParameter("only the alfworld task has games", param_hint="--games")
    options = {"games": str(games.resolve())} if games is not None else {}
    config = {"image_size": image_size, "early_truncation": early_truncation, "options": options}
    try:
        e = make_env(task, EnvConfig.model_validate(config), seed)
        image, info = e.reset()
    except (ValueError, FileNotFoundError, ImportError) as exc:
        raise click.ClickException(str(exc)) from exc
    u: Any = e.unwrapped
    if save_frames is not None:
        save_frames.mkdir(parents=True, exist_ok=True)
    _save(save_frames, 0, image)
    click.echo(f"{task} seed {seed}: actions {', '.join(u.action_names)}")
    click.echo(f"prompt: {u.prompt()}")
    click.echo(f"state: {json.dumps(info['state'])}")
    script = [a for a in actions.split(",") if a.strip()] if actions is not None else None
    if script is not None and task != "alfworld":  # fixed action sets: refuse a bad script up front
        for typed in script:
            _pick(list(u.action_names), typed)
    total, step = 0.0, 0
    while True:
        if expert:
            typed = expert_action(task, u.state())
        elif script is not None:
            if step >= len(script):
                click.echo(f"script ended after {step} steps; the episode is still running")
                break
            typed = script[step]
        else:
            typed = click.prompt("action", type=str)
        image, reward, terminated, truncated, info = e.step(_pick(list(u.action_names), typed))
        step += 1
        total += float(reward)
        _save(save_frames, step, image)
        click.echo(
            f"step {step}: {typed.strip()} -> reward {reward:+g}"
            f"{' terminated' if terminated else ''}{' truncated' if truncated else ''}"
        )
        click.echo(f"state: {json.dumps(info['state'])}")
        if terminated or truncated:
            left = len(script) - step if script is not None else 0
            extra = f" ({left} scripted actions unused)" if left > 0 else ""
            click.echo(f"episode over: return {total:+g}, success {total > 0}{extra}")
            break
    if save_frames is not None:
        click.echo(f"frames written to {save_frames}")


@env.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8001, show_default=True)
@click.option(
    "--max-sessions",
    type=click.IntRange(min=1),
    default=None,
    help="Most sessions at once [default: GTR_ENV_MAX_SESSIONS, 256]",
)
@click.option(
    "--ttl",
    type=click.FloatRange(min=1),
    default=None,
    help="Idle seconds before a session is dropped [default: GTR_ENV_SESSION_TTL_S, 900]",
)
def serve(host: str, port: int, max_sessions: int | None, ttl: float | None) -> None:
    """Serve the env REST API (POST /envs, /envs/{id}/step, ...)."""
    import uvicorn

    from services.env.app import create_app, pool_from
    from shared.logs import uvicorn_log_config
    from shared.service_auth import serve_settings

    settings = serve_settings()
    pool = pool_from(settings)
    pool.max_sessions = max_sessions or pool.max_sessions
    pool.ttl_s = ttl or pool.ttl_s
    app = create_app(pool, settings)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_config=uvicorn_log_config(),
        **settings.uvicorn_proxy_options(),
    )
