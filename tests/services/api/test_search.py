"""Step search on PostgreSQL, on the steps and corrections a real short run wrote (the same
checks run on the embedded SQLite in tests/e2e/test_embedded.py), and over HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from services.api.app import create_app
from services.api.search import fts5_query
from tests.conftest import RealRun, live_server
from tests.services.api.search_checks import HOSTILE, check_search


def test_search_finds_what_a_real_run_wrote(pg_url: str, real_run: RealRun) -> None:
    check_search(pg_url, real_run.run_id)


def test_user_text_never_reaches_fts5_syntax() -> None:
    """Each word a quoted string (FTS5 has no escape inside one but a doubled quote, and a word
    holds none); no word at all: the empty string, which matches nothing."""
    assert fts5_query('NEAR(a b) AND "c" OR d* ^e col:f') == (
        '"NEAR" "a" "b" "AND" "c" "OR" "d" "e" "col" "f"'
    )
    assert all(fts5_query(q) == '""' for q in ('"', "*", "(((", "", "\u200b"))


@pytest.fixture(scope="module")
def base_url(pg_url: str) -> Iterator[str]:
    with live_server(create_app()) as url:
        yield url


def test_rest_pages_by_cursor_and_takes_any_text(base_url: str, real_run: RealRun) -> None:
    auth = {"Authorization": f"Bearer {real_run.read_token}"}
    api = f"{base_url}/api/runs/{real_run.run_id}/steps"
    corrected = sorted(set(real_run.corrected_step_ids))
    first = httpx.get(f"{api}?verdict=corrected&limit=5", headers=auth).json()
    assert [h["id"] for h in first["items"]] == corrected[:5] and first["prev_before"] is None
    later = httpx.get(f"{api}?verdict=corrected&limit=5&after={first['next_after']}", headers=auth)
    assert [h["id"] for h in later.json()["items"]] == corrected[5:10]
    back = httpx.get(f"{api}?verdict=corrected&limit=5&before={later.json()['prev_before']}")
    assert back.status_code == 401  # a token is needed, cursor or not
    back = httpx.get(
        f"{api}?verdict=corrected&limit=5&before={later.json()['prev_before']}", headers=auth
    )
    assert [h["id"] for h in back.json()["items"]] == corrected[:5]
    for q in HOSTILE:
        r = httpx.get(api, params={"q": q}, headers=auth)
        assert r.status_code == 200, (q, r.text[:300])
    page = httpx.get(
        f"{base_url}/runs/{real_run.run_id}/steps",
        params={"q": '<script>alert(1)</script> NEAR("'},
        cookies={"gtr_token": real_run.read_token},
    )
    assert page.status_code == 200 and "<script>alert(1)" not in page.text
    bad = httpx.get(f"{api}?after=-1", headers=auth)
    assert bad.status_code == 422 and "after" in bad.text
