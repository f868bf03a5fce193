"""Hand-made hostile requests the schema-driven fuzzer does not think of: deep JSON, oversized and
chunked bodies, unicode edge cases, path traversal in blob ids, SQL-looking strings."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from sqlalchemy import func, select

from services.api.app import MAX_BODY_BYTES, create_app
from services.api.auth import create_token
from shared.db.models import Run
from shared.db.session import session_scope
from tests.conftest import live_server


@pytest.fixture(scope="module")
def api(pg_url: str) -> Iterator[dict]:
    with session_scope() as s:
        token = create_token(s, "hostile", "write", "hostile-team")[1]
    with live_server(create_app()) as url:
        yield {"url": url, "headers": {"Authorization": f"Bearer {token}"}}


def _runs() -> int:
    with session_scope() as s:
        return s.scalar(select(func.count()).select_from(Run)) or 0


def _post_run(api: dict, **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
    headers = {**api["headers"], "content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(f"{api['url']}/api/runs", headers=headers, timeout=60, **kw)


def _refused(r: httpx.Response) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert "Traceback" not in r.text and "sqlalchemy" not in r.text.lower()


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deeply_nested_json_is_refused(api: dict, depth: int) -> None:
    before = _runs()
    body = '{"name": "x", "task": "numberline", "env": ' + "[" * depth + "]" * depth + "}"
    _refused(_post_run(api, content=body))
    assert _runs() == before


def test_an_oversized_body_is_refused_before_it_is_read(api: dict) -> None:
    r = _post_run(api, content=b"{" + b" " * (MAX_BODY_BYTES + 1) + b"}")
    assert r.status_code == 413


def test_an_oversized_chunked_body_is_refused(api: dict) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"name": "'
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b"a" * 65536
        yield b'", "task": "numberline"}'

    before = _runs()
    r = _post_run(api, content=chunks())
    assert r.status_code == 413, r.status_code
    assert r.json() == {"detail": f"request body over {MAX_BODY_BYTES} bytes"}
    assert _runs() == before


def test_a_chunked_body_under_the_limit_is_read_whole(api: dict) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"name": "chunked", '
        yield b'"task": "numberline"}'

    r = _post_run(api, content=chunks())
    assert r.status_code == 201, r.text
    assert r.json()["name"] == "chunked"
    cancel = httpx.post(f"{api['url']}/api/runs/{r.json()['id']}/cancel", headers=api["headers"])
    assert cancel.status_code == 200


@pytest.mark.parametrize(
    "name",
    [
        "nul \u0000 byte",
        "lone surrogate \udcff",
        "rtl \u202e evil.exe",
        "emoji 🧠" * 20,
        "'; DROP TABLE runs; --",
        '" OR 1=1 --',
        "%00%2e%2e%2f",
        "a" * 10_000,
    ],
)
def test_unicode_and_sql_looking_names_are_stored_verbatim_or_refused(api: dict, name: str) -> None:
    before = _runs()
    import json

    body = json.dumps({"name": name, "task": "numberline"})  # escapes keep a lone surrogate
    r = _post_run(api, content=body)
    if r.status_code == 201:
        run = r.json()
        assert run["name"] == name
        assert (
            httpx.post(
                f"{api['url']}/api/runs/{run['id']}/cancel", headers=api["headers"]
            ).status_code
            == 200
        )
        assert _runs() == before + 1
    else:
        _refused(r)
        assert _runs() == before


@pytest.mark.parametrize(
    "sha",
    [
        "../../../../etc/passwd",
        "..%2F..%2F..%2Fetc%2Fpasswd",
        "%2e%2e/%2e%2e/etc/passwd",
        "a" * 63 + "/",
        "0" * 64 + "/../../x",
        "..\\..\\windows",
        "%00",
        "A" * 64,
    ],
)
def test_path_traversal_in_blob_ids_is_refused(api: dict, sha: str) -> None:
    r = httpx.get(f"{api['url']}/api/blobs/{sha}", headers=api["headers"], follow_redirects=True)
    assert r.status_code in (400, 404, 422), (sha, r.status_code)
    assert b"root:" not in r.content and "Traceback" not in r.text


@pytest.mark.parametrize(
    "query",
    [
        "status=running' OR '1'='1",
        "limit=-1",
        "limit=99999999999999999999",
        "offset=1e9",
        "status=%00",
        "limit=1;DROP TABLE runs",
    ],
)
def test_hostile_query_strings_are_refused(api: dict, query: str) -> None:
    r = httpx.get(f"{api['url']}/api/runs?{query}", headers=api["headers"])
    _refused(r)
