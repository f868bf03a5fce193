"""The corrector registry page: register (admin), see statistics, test an endpoint."""

from __future__ import annotations

from contextlib import AbstractContextManager

from tests.conftest import free_port
from tests.services.corrector.conftest import FakeOpenAI, serving
from tests.services.corrector.test_structure_probe import prose_unless_shown
from tests.ui.conftest import login, shot
from tests.ui.seed import Seeded


def test_admin_registers_and_tests_a_corrector(page, base_url: str, seeded: Seeded) -> None:
    login(page, base_url, seeded.admin_token, "/correctors")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the test must report the failure
    page.fill("input[name=name]", "ui-dead-endpoint")
    page.select_option("select[name=kind]", "http")
    page.fill("input[name=base_url]", dead)
    page.fill("textarea[name=params]", '{"timeout_s": 2}')
    page.click("#register-form button[type=submit]")
    row = page.locator("tr[data-corrector='ui-dead-endpoint']")
    row.wait_for()
    assert dead in row.inner_text()
    row.locator("button", has_text="Test").click()
    result = row.locator(".test-result .bad")
    result.wait_for(timeout=30_000)
    assert "failed" in result.inner_text()
    shot(page, "correctors")


def _ignores_response_format() -> AbstractContextManager[FakeOpenAI]:
    """A chat server that answers 200 in prose whatever ``response_format`` asks."""
    fake = FakeOpenAI()
    fake.respond = prose_unless_shown
    return serving(fake)


def test_the_test_button_says_what_the_server_honours(page, base_url: str, seeded: Seeded) -> None:
    """The page's Test runs the probe of `gtr corrector test` and shows its findings."""
    with _ignores_response_format() as fake:
        login(page, base_url, seeded.admin_token, "/correctors")
        page.fill("input[name=name]", "ui-ignores-format")
        page.select_option("select[name=kind]", "openai")
        page.fill("input[name=base_url]", fake.url)
        page.fill("input[name=model]", "m")
        page.click("#register-form button[type=submit]")
        row = page.locator("tr[data-corrector='ui-ignores-format']")
        row.wait_for()
        row.locator("button", has_text="Test").click()
        said = row.locator(".test-result .structured")
        said.wait_for(timeout=30_000)
        assert "the schema is NOT enforced by this server" in said.inner_text()
        assert "ok · correct" in row.locator(".test-result .ok").inner_text()
        levels = row.locator(".test-result ul.probe li").all_inner_texts()
        assert levels == [
            f"{level} ignored: malformed: answer is not JSON"
            for level in ("json_schema", "json_object_schema", "json_object")
        ]
        assert len(fake.requests) == 4  # three probes and the sample
        shot(page, "corrector-probe")


def test_read_only_token_cannot_register(page, base_url: str, seeded: Seeded) -> None:
    login(page, base_url, seeded.read_token, "/correctors")
    assert page.locator("#register-locked").is_visible()
    assert page.locator("#register-form button[type=submit]").is_disabled()
