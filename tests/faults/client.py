"""Requests of the attack tests against a live API (`{"url": ..., "tokens": {who: token}}`),
and the checks they share."""

from __future__ import annotations

from typing import Any

import httpx
from sqlalchemy import func, select

from shared.db.session import session_scope


def call(api: dict, method: str, path: str, who: str, **kw: Any) -> httpx.Response:
    """``method path`` with the bearer token of ``who``."""
    headers = {"Authorization": f"Bearer {api['tokens'][who]}", **kw.pop("headers", {})}
    return httpx.request(method, api["url"] + path, headers=headers, timeout=60, **kw)


def count(model: Any) -> int:
    """Rows of a table: what a refused request must leave as it was."""
    with session_scope() as s:
        return s.scalar(select(func.count()).select_from(model)) or 0


def refused_422(r: httpx.Response, loc: list[str], text: str = "") -> str:
    """A 422 on the body field ``loc`` whose message holds ``text``; returns the message."""
    assert r.status_code == 422, (r.status_code, r.text[:500])
    detail = r.json()["detail"]
    assert detail[0]["loc"] == ["body", *loc], detail
    assert text in detail[0]["msg"], detail
    return str(detail[0]["msg"])
