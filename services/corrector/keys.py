"""Corrector API keys: Fernet-encrypted at rest with a key derived from the settings' secret,
or read from an environment variable named in the registry. Never logged, never returned."""

from __future__ import annotations

import base64
import hashlib
import os
from typing import Any

from cryptography.fernet import Fernet, InvalidToken
from sqlalchemy import select
from sqlalchemy.orm import Session

from services.corrector.base import CorrectorError
from services.corrector.schemas import KEY_ENV_PREFIX
from shared.db import models
from shared.settings import Settings


def _fernet(settings: Settings) -> Fernet:
    digest = hashlib.sha256(settings.secret_key.get_secret_value().encode()).digest()
    return Fernet(base64.urlsafe_b64encode(digest))


def encrypt_key(raw: str, settings: Settings) -> str:
    return _fernet(settings).encrypt(raw.encode()).decode()


def decrypt_key(row: models.Corrector, settings: Settings) -> str | None:
    """The row's API key in clear, for the outgoing call only."""
    if row.api_key_encrypted:
        try:
            return _fernet(settings).decrypt(row.api_key_encrypted.encode()).decode()
        except InvalidToken as e:
            raise CorrectorError(
                "config",
                f"the API key of '{row.name}' does not decrypt: was GTR_SECRET_KEY changed?",
            ) from e
    if row.api_key_env:
        if not row.api_key_env.startswith(KEY_ENV_PREFIX):
            # A row from before the prefix rule: never read an arbitrary variable.
            raise CorrectorError(
                "config", f"api_key_env must start with {KEY_ENV_PREFIX} (edit the corrector)"
            )
        value = os.environ.get(row.api_key_env)
        if not value:
            raise CorrectorError("config", f"environment variable {row.api_key_env} is not set")
        return value
    return None


OPERATOR_TEAM = "default"  # the team of `gtr train` and of the operator's own commands


def key_not_teams(session: Session, team: str, inline: dict[str, Any]) -> str | None:
    """Why an inline corrector may not name its ``api_key_env``, or None when it may.

    A key variable belongs to the registered correctors that name it: an inline corrector may
    send it only to the ``base_url`` one of those registers, and only if that corrector is its
    team's own or shared. A variable no corrector names is the operator's (team ``default``,
    the team of `gtr train`). One text whether the variable is another team's, registered for
    another endpoint or not registered at all, so nothing here tells a team what exists."""
    var = inline.get("api_key_env")
    if not var:
        return None
    url = str(inline.get("base_url") or "").rstrip("/")
    rows = session.scalars(
        select(models.Corrector).where(models.Corrector.api_key_env == var)
    ).all()
    if not rows and team == OPERATOR_TEAM:
        return None
    if any(
        (row.team == team or row.shared) and (row.base_url or "").rstrip("/") == url for row in rows
    ):
        return None
    return (
        f"{var} is not a key of team '{team}' for this base_url: an inline corrector may name "
        "only a key variable that one of its team's (or a shared) registered correctors names "
        "with the same base_url (or name that corrector instead)"
    )
