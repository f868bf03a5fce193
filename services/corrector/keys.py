"""Corrector API keys: Fernet-encrypted at rest with a key derived from the settings' secret,
or read from an environment variable named in the registry. Never logged, never returned."""

from __future__ import annotations

import base64
import hashlib
import os

from cryptography.fernet import Fernet, InvalidToken

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
