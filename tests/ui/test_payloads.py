"""Stored text never runs as script (#16 item 1): a run, a corrector, an episode, a step and a
correction whose every text field holds quote, HTML and JavaScript payloads; then every button
of every page is clicked with a dialog listener. No inline handler or script exists to inject
into, and the CSP's script-src has no 'unsafe-inline' (so even a slip would not run)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from playwright.sync_api import Error as PlaywrightError

from tests.ui.conftest import login

PAYLOAD = (
    'bob\'s "run" </script><script>window.__xss=1</script>'
    "<img src=x onerror=window.__xss=2> ');window.__xss=3;// {{7*7}} ${7*7}"
)


class _Corrector(BaseHTTPRequestHandler):
    """A real local service speaking POST /v1/correct, answering with the payload everywhere."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        body = json.dumps(
            {
                "verdict": "incorrect",
                "corrected_thought": PAYLOAD,
                "reasoning": PAYLOAD,
                "extras": {"note": PAYLOAD},
            }
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@dataclass
class PayloadRun:
    run_id: int
    step_id: int
    token: str


@pytest.fixture(scope="module")
def payload_run(base_url: str) -> Iterator[PayloadRun]:
    from services.api.auth import create_token
    from services.controller.recorder import add_step, close_episode, open_episode
    from services.corrector.service import build_corrector, record_correction
    from shared.db.session import session_scope
    from shared.settings import get_settings
    from shared.storage import blob_store

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Corrector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    with session_scope() as s:
        token = create_token(s, "xss-admin", "admin", "xss-team")[1]
    auth = {"Authorization": f"Bearer {token}"}
    corrector = {
        "name": "xss-corrector",
        "kind": "http",
        "base_url": f"http://127.0.0.1:{server.server_port}",
        "model": PAYLOAD,
        "params": {"timeout_s": 5, "note": PAYLOAD},
    }
    r = httpx.post(f"{base_url}/api/correctors", json=corrector, headers=auth)
    if r.status_code == 422:  # a stricter registry may refuse free-form params
        r = httpx.post(f"{base_url}/api/correctors", json={**corrector, "params": {}}, headers=auth)
    assert r.status_code == 201, r.text
    config = {"name": PAYLOAD, "task": "numberline", "corrector": {"name": "xss-corrector"}}
    r = httpx.post(f"{base_url}/api/runs", json=config, headers=auth)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    with session_scope() as s:
        cursor = open_episode(s, run_id, 0, 0, 0, meta={"note": PAYLOAD})
        step = add_step(
            s, blob_store(), run_id=run_id, episode_id=cursor.episode_id, idx=0, update_idx=0,
            rollout_pos=0, prompt=PAYLOAD, output=PAYLOAD, thought=PAYLOAD, action_text=PAYLOAD,
            parsed_action=PAYLOAD[:200], format_valid=True, action_valid=False, reward=-1.0,
            done=True, value=0.1, logprob=-1.0, state={"note": PAYLOAD, PAYLOAD: 1},
        )  # fmt: skip
        s.flush()
        cursor.length, cursor.total_return = 1, -1.0
        close_episode(s, cursor, False)
        built = build_corrector("xss-corrector", s, get_settings())
        correction = record_correction(s, step.id, "xss-corrector", built)
        assert correction.status == "done", correction.error
        step_id = step.id
    yield PayloadRun(run_id, step_id, token)
    server.shutdown()


def _pages(p: PayloadRun) -> list[str]:
    run = f"/runs/{p.run_id}"
    return [
        "/runs",
        run,
        f"{run}/episodes",
        f"{run}/steps?q=script",
        f"{run}/steps/{p.step_id}",
        "/correctors",
        f"/compare?runs={p.run_id}",
    ]


def test_payloads_never_run_on_any_page_or_button(  # type: ignore[no-untyped-def]
    page, base_url: str, payload_run: PayloadRun
) -> None:
    dialogs: list[tuple[str, str]] = []

    def on_dialog(d) -> None:  # type: ignore[no-untyped-def]
        dialogs.append((d.type, d.message))
        d.dismiss()  # never confirm: nothing is cancelled or deleted

    page.on("dialog", on_dialog)
    login(page, base_url, payload_run.token, "/runs")

    def assert_clean(where: str) -> None:
        for _ in range(5):  # a click may still be navigating: look again on the new page
            try:
                page.wait_for_load_state("load")
                assert page.evaluate("() => window.__xss") is None, where
                assert not page.locator("img[src=x]").count(), where
                return
            except PlaywrightError:
                page.wait_for_timeout(200)
        raise AssertionError(f"{where}: the page never settled")

    clicked = 0
    for path in _pages(payload_run):
        page.goto(f"{base_url}{path}")
        page.wait_for_load_state("networkidle")
        assert_clean(path)
        assert "window.__xss" in page.locator("main").inner_text(), f"payload not shown on {path}"
        n = page.locator("main button:visible").count()
        for i in range(n):
            page.goto(f"{base_url}{path}")
            page.wait_for_load_state("networkidle")
            button = page.locator("main button:visible").nth(i)
            if not button.is_enabled():
                continue
            button.click(no_wait_after=True)
            page.wait_for_timeout(100)
            page.wait_for_load_state("networkidle")
            assert_clean(f"{path} button {i}")
            clicked += 1
    assert clicked >= 6  # cancel, compare, filter, search, test, delete, register, ...
    assert all(kind == "confirm" for kind, _ in dialogs), dialogs
    assert all("__xss" not in message for _, message in dialogs), dialogs
    assert not page.js_errors
