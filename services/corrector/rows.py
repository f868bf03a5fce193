"""What a corrector row may hold: the URL and params rules that a registered corrector and a run
config's inline one both pass (``registry.py`` keeps the rows, ``service.py`` builds correctors
from them)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from pydantic import ValidationError

from services.corrector.remote import RemoteParams
from shared.db import models
from shared.schemas import CorrectorErrors
from shared.settings import Settings


class RegistryError(Exception):
    status_code = 400


class InvalidCorrector(RegistryError):
    status_code = 422


def validate_base_url(url: str, settings: Settings) -> str:
    """http(s) only, a host, no credentials in the URL, and the allowlist when one is set."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as e:
        raise InvalidCorrector(f"base_url is not a valid URL ({e})") from e
    if parts.scheme not in ("http", "https"):
        raise InvalidCorrector("base_url must start with http:// or https://")
    if not host:
        raise InvalidCorrector("base_url has no host")
    if parts.username or parts.password:
        raise InvalidCorrector("base_url must not hold credentials: use api_key or api_key_env")
    allow = [h.lower() for h in settings.corrector_url_allowlist]
    if allow and host.lower() not in allow:
        raise InvalidCorrector(f"host '{host}' is not in the corrector allowlist")
    return url.rstrip("/")


def _check_params(kind: str, params: dict[str, Any]) -> dict[str, Any]:
    if kind == "oracle":
        extra = set(params) - {"noise", "errors"}
        noise = params.get("noise", 0.0)
        if extra or not isinstance(noise, int | float) or not 0 <= noise <= 1:
            raise InvalidCorrector(
                "oracle params: only 'noise', a number in [0, 1], and 'errors' (rates per kind)"
            )
        try:
            CorrectorErrors.model_validate(params.get("errors") or {})
        except ValidationError as e:
            first = e.errors()[0]
            where = "".join(f".{p}" for p in first["loc"])
            raise InvalidCorrector(f"oracle params.errors{where}: {first['msg']}") from e
        return params
    try:
        return RemoteParams(**params).model_dump(exclude_unset=True)
    except ValidationError as e:
        first = e.errors()[0]
        raise InvalidCorrector(f"params.{'.'.join(map(str, first['loc']))}: {first['msg']}") from e


def check_row(row: models.Corrector, settings: Settings) -> None:
    """A row's URL (for remote kinds), model and params, checked; the URL and params normalised."""
    if row.kind in ("openai", "http"):
        if not row.base_url:
            raise InvalidCorrector(f"a corrector of kind '{row.kind}' needs a base_url")
        row.base_url = validate_base_url(row.base_url, settings)
    if row.kind == "openai" and not row.model:
        raise InvalidCorrector("a corrector of kind 'openai' needs a model")
    row.params = _check_params(row.kind, row.params or {})


def inline_row(cfg: dict[str, Any], settings: Settings) -> models.Corrector:
    """An unsaved registry row for a run config's inline corrector, checked like a registered
    one (URL rules, params)."""
    row = models.Corrector(
        name=cfg.get("name") or "inline",
        kind=cfg.get("kind"),
        base_url=cfg.get("base_url"),
        model=cfg.get("model"),
        params=dict(cfg.get("params") or {}),
        api_key_env=cfg.get("api_key_env"),
    )
    check_row(row, settings)
    return row
