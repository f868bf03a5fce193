"""`gtr corrector ...`: run our corrector as a `POST /v1/correct` service."""

from __future__ import annotations

import json
import os

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
    from services.corrector.registry import InvalidCorrector, validate_base_url
    from services.corrector.remote import OpenAICorrector, RemoteParams
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

    token = os.environ.get(token_env) if token_env else None
    if token_env and not token:
        raise click.BadParameter(
            f"environment variable {token_env} is not set", param_hint="--token-env"
        )
    impl = _backend(backend, base_url, model, api_key_env, noise, params)
    from shared.logs import uvicorn_log_config

    app, log_config = create_app(impl, backend, token), uvicorn_log_config()
    uvicorn.run(app, host=host, port=port, log_level="info", log_config=log_config)
