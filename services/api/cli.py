"""``gtr serve``, ``gtr db`` and ``gtr token``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import click

GRACE_S = 20


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1, 64))
def serve(host: str, port: int, workers: int) -> None:
    """Serve the REST API and the web UI (migrates an embedded SQLite database first)."""
    import uvicorn

    from shared.service_auth import serve_settings

    settings = serve_settings()
    if settings.database_url is None:
        from shared.db.migrate import ensure_schema

        ensure_schema()
    from shared.logs import uvicorn_log_config

    uvicorn.run(
        "services.api.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level="info",
        log_config=uvicorn_log_config(),
        # SIGTERM: open requests get this long, then the server stops anyway (k8s grace is 30 s).
        timeout_graceful_shutdown=GRACE_S,
        **settings.uvicorn_proxy_options(),
    )


@click.group()
def db() -> None:
    """Database migrations."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(revision: str) -> None:
    """Migrate the database to a revision (head by default)."""
    from shared.db.migrate import upgrade

    with _alembic_errors(revision):
        upgrade(revision=revision)
    click.echo(f"database at {revision}")


@db.command("downgrade")
@click.option("--revision", default="base", show_default=True)
def db_downgrade(revision: str) -> None:
    """Migrate the database down to a revision (base by default: drops everything)."""
    from shared.db.migrate import downgrade

    with _alembic_errors(revision):
        downgrade(revision=revision)
    click.echo(f"database at {revision}")


@contextmanager
def _alembic_errors(revision: str) -> Iterator[None]:
    """Alembic's refusals (an unknown or wrong-way revision) are a message, not a traceback."""
    from alembic.util import CommandError

    try:
        yield
    except CommandError as e:
        raise click.ClickException(f"cannot migrate to {revision!r}: {e}") from None


@click.group()
def token() -> None:
    """API tokens."""


@token.command("create")
@click.argument("name")
@click.option("--read-only", is_flag=True, help="The token can read but not change anything.")
@click.option(
    "--admin", is_flag=True, help="The token can also manage correctors and see every team."
)
@click.option(
    "--team", default="default", show_default=True, help="The team whose runs the token sees."
)
def token_create(name: str, read_only: bool, admin: bool, team: str) -> None:
    """Create a token and print its secret (shown once)."""
    from services.api.auth import create_token
    from shared.db.migrate import ensure_schema
    from shared.db.session import session_scope

    if read_only and admin:
        raise click.UsageError("--read-only and --admin exclude each other")
    if not name.strip() or len(name) > 100:
        raise click.BadParameter("a name of 1 to 100 characters", param_hint="NAME")
    ensure_schema()
    scope = "read" if read_only else "admin" if admin else "write"
    with session_scope() as session:
        _, raw = create_token(session, name, scope, team)
    click.echo(raw)


@token.command("list")
def token_list() -> None:
    """List tokens (never their secrets)."""
    from sqlalchemy import select

    from shared.db.models import ApiToken
    from shared.db.session import session_scope

    with session_scope() as session:
        for t in session.scalars(select(ApiToken).order_by(ApiToken.id)):
            state = "revoked" if t.revoked_at else "active"
            click.echo(f"{t.id}\t{t.name}\t{t.scope}\t{t.team}\t{t.prefix}…\t{state}")


@token.command("revoke")
@click.argument("token_id", type=int)
def token_revoke(token_id: int) -> None:
    """Revoke a token by id."""
    from services.api.auth import revoke_token
    from shared.db.session import session_scope

    with session_scope() as session:
        if not revoke_token(session, token_id):
            raise click.ClickException(f"no token with id {token_id}")
    click.echo(f"token {token_id} revoked")
