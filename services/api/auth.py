"""Bearer API tokens: stored as sha256 hashes, compared in constant time, scoped.

Scopes: ``read`` sees everything of its team, ``write`` also launches and cancels runs, ``admin``
also manages tokens and correctors and sees every team.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import UTC, datetime

from fastapi import Depends, HTTPException, Request, status
from sqlalchemy import select
from sqlalchemy.orm import Session

from services.api.deps import get_db
from shared.db.models import ApiToken

SCOPES = ("read", "write", "admin")
TOKEN_PREFIX = "gtr_"
COOKIE_NAME = "gtr_token"


def hash_token(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def create_token(
    session: Session, name: str, scope: str = "write", team: str = "default"
) -> tuple[ApiToken, str]:
    """Returns the row and the secret; the secret is shown once and never stored."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {', '.join(SCOPES)}")
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(name=name, token_hash=hash_token(raw), prefix=raw[:10], scope=scope, team=team)
    session.add(row)
    session.flush()
    return row, raw


def lookup_token(session: Session, raw: str | None) -> ApiToken | None:
    if not raw or len(raw) > 200:
        return None
    digest = hash_token(raw)
    row = session.scalar(select(ApiToken).where(ApiToken.token_hash == digest))
    # The index lookup finds the row; the constant-time compare keeps the check itself timing-safe.
    if row is None or not hmac.compare_digest(row.token_hash, digest) or row.revoked_at is not None:
        return None
    return row


def revoke_token(session: Session, token_id: int) -> bool:
    row = session.get(ApiToken, token_id)
    if row is None:
        return False
    row.revoked_at = row.revoked_at or datetime.now(UTC)
    return True


def raw_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.cookies.get(COOKIE_NAME)


SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


def from_our_pages(request: Request) -> bool:
    """The request comes from our own origin: its Origin (when sent) is ours, and a browser that
    says where it comes from (Sec-Fetch-Site) says same-origin, or none for a typed address.
    A sibling subdomain (same-site) is another origin, so it does not pass."""
    origin = request.headers.get("origin")
    if origin is not None and origin.rstrip("/") != str(request.base_url).rstrip("/"):
        return False
    return request.headers.get("sec-fetch-site", "same-origin") in ("same-origin", "none")


def check_cookie_origin(request: Request) -> None:
    """A write authenticated by the cookie alone must come from our own pages: a foreign
    Origin (or a browser saying cross-site) is refused. Bearer-token clients send no cookie."""
    if request.method in SAFE_METHODS or request.headers.get("authorization"):
        return
    if request.cookies.get(COOKIE_NAME) and not from_our_pages(request):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, "cross-origin request with the login cookie rejected"
        )


def current_token(request: Request, db: Session = Depends(get_db, scope="function")) -> ApiToken:
    check_cookie_origin(request)
    raw = raw_token(request)
    if not raw:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "missing API token: send 'Authorization: Bearer <token>' "
            "(create one with 'gtr token create NAME')",
            headers={"WWW-Authenticate": "Bearer"},
        )
    token = lookup_token(db, raw)
    if token is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "invalid or revoked API token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    request.state.token = token
    return token


def require_read(token: ApiToken = Depends(current_token)) -> ApiToken:
    return token


def require_write(token: ApiToken = Depends(current_token)) -> ApiToken:
    if token.scope not in ("write", "admin"):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"token '{token.name}' is read-only: this action needs a read-write token",
        )
    return token


def require_admin(token: ApiToken = Depends(current_token)) -> ApiToken:
    if token.scope != "admin":
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"token '{token.name}' has scope '{token.scope}': this action needs an admin token",
        )
    return token
