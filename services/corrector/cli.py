"""`gtr corrector ...`: run our corrector as a `POST /v1/correct` service."""

from __future__ import annotations

import json
import os
import sys

import click


@click.group()
def corrector() -> None:
    """The corrector service."""


def _backend(
    backend: str,
    base_url: str | None,
    model: str | None,
    api_key_env: str | None,
    noise: float,
    params: str | None,
):  # type: ignore[no-untyped-def]
    from pydantic import ValidationError

    from services.corrector.oracle import OracleCorrector
    from services.corrector.remote import OpenAICorrector, RemoteParams
    from services.corrector.rows import InvalidCorrector, validate_base_url
    from shared.settings import get_settings

    if backend == "oracle":
        return OracleCorrector(noise=noise)
    if not base_url or not model:
        raise click.UsageError("--backend openai needs --base-url and --model")
    try:
        url = validate_base_url(base_url, get_settings())
        remote = RemoteParams(**json.loads(params or "{}"))
    except InvalidCorrector as e:
        raise click.BadParameter(str(e), param_hint="--base-url") from e
    except (ValueError, ValidationError, TypeError) as e:
        raise click.BadParameter(f"not valid RemoteParams JSON ({e})", param_hint="--params") from e
    key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not key:
        raise click.BadParameter(
            f"environment variable {api_key_env} is not set", param_hint="--api-key-env"
        )
    return OpenAICorrector(url, model, key, remote)


@corrector.command()
@click.option(
    "--backend", type=click.Choice(["oracle", "openai"]), default="oracle", show_default=True
)
@click.option("--base-url", help="OpenAI-compatible endpoint, e.g. http://127.0.0.1:8001/v1")
@click.option("--model", help="Model name at that endpoint")
@click.option("--api-key-env", help="Environment variable holding the endpoint's API key")
@click.option("--params", help='RemoteParams as JSON, e.g. \'{"vision": false, "timeout_s": 30}\'')
@click.option(
    "--noise",
    type=click.FloatRange(0, 1),
    default=0.0,
    show_default=True,
    help="Oracle: rate of deliberately wrong corrections",
)
@click.option("--token-env", help="Environment variable holding a bearer token callers must send")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8010, show_default=True)
def serve(
    backend: str,
    base_url: str | None,
    model: str | None,
    api_key_env: str | None,
    params: str | None,
    noise: float,
    token_env: str | None,
    host: str,
    port: int,
) -> None:
    """Serve POST /v1/correct (and GET /healthz) with the oracle or an OpenAI-compatible model."""
    import uvicorn

    from services.corrector.app import create_app
    from shared.service_auth import serve_settings

    settings = serve_settings()  # production refuses default secrets here too
    token = os.environ.get(token_env) if token_env else None
    if token_env and not token:
        raise click.BadParameter(
            f"environment variable {token_env} is not set", param_hint="--token-env"
        )
    impl = _backend(backend, base_url, model, api_key_env, noise, params)
    from shared.logs import uvicorn_log_config

    app = create_app(impl, backend, token, settings)
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="info",
        log_config=uvicorn_log_config(),
        **settings.uvicorn_proxy_options(),
    )


# ---- the registry from the command line: the embedded default needs no server ---------------


def _registry_session():  # type: ignore[no-untyped-def]
    from shared.db.migrate import ensure_schema
    from shared.db.session import session_scope
    from shared.settings import get_settings

    if get_settings().database_url is None:
        ensure_schema()  # the embedded SQLite file, as `gtr train` makes it
    return session_scope()


def _find(session, name: str):  # type: ignore[no-untyped-def]
    from sqlalchemy import select

    from shared.db import models

    row = session.scalar(select(models.Corrector).where(models.Corrector.name == name))
    if row is None:
        raise click.ClickException(f"no corrector named '{name}' (see: gtr corrector list)")
    return row


@corrector.command("add")
@click.argument("name")
@click.option("--kind", type=click.Choice(["openai", "http"]), default="openai", show_default=True)
@click.option("--base-url", required=True, help="e.g. http://127.0.0.1:8080/v1")
@click.option("--model", help="The model name (kind openai)")
@click.option("--api-key-env", help="Environment variable holding the API key")
@click.option("--params", help='RemoteParams as JSON, e.g. \'{"vision": true, "timeout_s": 30}\'')
@click.option("--team", default="default", show_default=True)
def add(
    name: str,
    kind: str,
    base_url: str,
    model: str | None,
    api_key_env: str | None,
    params: str | None,
    team: str,
) -> None:
    """Register a corrector in this data folder's registry (or the settings' database)."""
    from pydantic import ValidationError

    from services.corrector.registry import RegistryError, create_corrector
    from services.corrector.schemas import CorrectorCreate
    from shared.settings import get_settings

    try:
        extra = json.loads(params or "{}")
        body = CorrectorCreate(
            name=name,
            kind=kind,  # type: ignore[arg-type]
            base_url=base_url,
            model=model,
            api_key_env=api_key_env,
            params=extra,
        )
    except ValueError as e:  # ValidationError is a ValueError
        first = e.errors()[0] if isinstance(e, ValidationError) else None
        why = f"{'.'.join(map(str, first['loc']))}: {first['msg']}" if first else str(e)
        raise click.BadParameter(why) from None
    try:
        with _registry_session() as s:
            row = create_corrector(s, body, team, get_settings())
            s.flush()
            click.echo(
                f"corrector {row.id} '{row.name}': {row.kind} {row.base_url} {row.model or ''}"
            )
    except RegistryError as e:
        raise click.ClickException(str(e)) from None
    from services.corrector.base import CorrectorError
    from services.corrector.egress import check_destination

    try:  # what Test and every run would refuse, said now (the API refuses to register it)
        check_destination(base_url or "", get_settings())
    except CorrectorError as e:
        if e.kind == "config":
            click.echo(f"warning: calls to it will be refused: {e.reason}", err=True)
    click.echo(f'try it: gtr corrector test {name}; use it: [corrector] name = "{name}"')


@corrector.command("list")
def list_() -> None:
    """The registered correctors."""
    from sqlalchemy import select

    from shared.db import models

    with _registry_session() as s:
        rows = s.scalars(select(models.Corrector).order_by(models.Corrector.id)).all()
        if not rows:
            click.echo("no corrector registered; the built-in 'oracle' is always there")
        for r in rows:
            params = json.dumps(r.params or {}, sort_keys=True)
            click.echo(f"{r.name}\t{r.kind}\t{r.base_url or ''}\t{r.model or ''}\t{params}")


@corrector.command("test")
@click.argument("name")
@click.option(
    "--task",
    type=click.Choice(["numberline", "ezpoints", "points24", "blackjack"]),
    default="numberline",
    show_default=True,
)
@click.option("--seed", type=click.IntRange(0, 2**31 - 1), default=0, show_default=True)
def test(name: str, task: str, seed: int) -> None:
    """Send one sample step; print the verdict, or the error, and the model's raw answer."""
    from services.corrector.registry import try_corrector
    from shared.settings import get_settings

    with _registry_session() as s:
        row = _find(s, name)
        result = try_corrector(row, get_settings(), task, seed, probe=True)
    click.echo(
        f"{'ok' if result.ok else 'FAILED'} in {result.latency_ms:.0f} ms, "
        f"{result.attempts} request(s), {result.tokens} tokens"
    )
    if result.structured:
        click.echo(result.structured)
    for step in result.probe:
        if step.reason:
            click.echo(f"  {step.level} {step.outcome}: {step.reason}")
    if result.ok:
        click.echo(f"verdict: {result.verdict}")
        if result.corrected_thought:
            click.echo(f"corrected thought: {result.corrected_thought}")
    else:
        click.echo(f"error: {result.error}")
    click.echo(f"raw answer: {result.raw if result.raw is not None else '(none)'}")
    if not result.ok:
        sys.exit(1)


@corrector.command("rm")
@click.argument("name")
def rm(name: str) -> None:
    """Remove a registered corrector (its recorded corrections stay)."""
    with _registry_session() as s:
        s.delete(_find(s, name))
    click.echo(f"removed '{name}'")
