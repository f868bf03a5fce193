"""The study page on a study the platform really ran (tests/services/study/tiny_study.py):
progress, curves with bands, verdicts with intervals, links to the runs, exports; hostile study
and arm names stay text under the strict CSP; other teams see nothing."""

from __future__ import annotations

import csv
import io
import json

import httpx

from services.api.auth import COOKIE_NAME
from services.study.report import build_report
from shared.db.session import session_scope
from tests.services.study.tiny_study import HOSTILE_ARM, QUOTED_ARM, TinyStudy
from tests.ui.conftest import login, shot


def _client(base_url: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=base_url, cookies={COOKIE_NAME: token}, timeout=60)


def test_study_page_shows_the_report(page, base_url: str, real_study: TinyStudy) -> None:  # type: ignore[no-untyped-def]
    sid = real_study.study_id
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    login(page, base_url, real_study.read_token, f"/studies/{sid}")
    with session_scope() as s:
        report = build_report(s, sid)
    (group,) = report.groups
    # Progress, and the primary metric declared up front.
    assert page.inner_text("[data-count=done]") == "4"
    assert page.inner_text("#primary-metric") == "eval/success_rate (final)"
    # Hostile names are shown as the text they are, never run (no dialog, no injected tags).
    assert real_study.arms[0] in page.inner_text("table.study-arms.primary")
    assert HOSTILE_ARM in page.inner_text("table.study-arms.primary")
    assert page.locator("main script, main img[src=x], main b").count() == 0
    assert "<img src=x" in page.inner_text("#study-name")
    # Each arm's cell: its interval, and links to exactly the runs behind it.
    for arm in group.primary.arms:
        row = page.locator("table.study-arms.primary tbody tr").filter(has_text=arm.arm)
        hrefs = row.locator("td.runs a").evaluate_all("as => as.map(a => a.getAttribute('href'))")
        assert hrefs == [f"/runs/{arm.runs[s]}" for s in sorted(arm.runs)]
        assert f"{arm.mean.point:.3f}" in row.locator("td").nth(1).inner_text()
    # Each seed's start beside each arm's score (folded under the primary table).
    page.click("details.seeds-fold summary")
    seeds = page.locator("table.study-seeds tbody tr")
    assert seeds.evaluate_all("rs => rs.map(r => r.dataset.seed)") == [
        str(s) for s in real_study.seeds
    ]
    for seed in real_study.seeds:
        cells = page.locator(f"table.study-seeds tr[data-seed='{seed}'] td").all_inner_texts()
        expected = [group.primary.start_scores[seed], *(a.scores[seed] for a in group.primary.arms)]
        assert cells == [str(seed), *(f"{v:.3f}" for v in expected)]
    assert HOSTILE_ARM in page.inner_text("table.study-seeds thead")
    assert page.locator("p.dead-seeds").count() == (1 if group.primary.dead_seeds else 0)
    verdict = page.locator("table.study-comparisons.primary td.study-verdict")
    assert verdict.all_inner_texts() == ["not decided at 2 seeds"]
    # What a run of each arm took, from its stored update seconds.
    cost = page.inner_text("p.cost")
    for c in group.cost:
        assert c.minutes is not None and c.cpu_minutes is not None
        assert f"{c.arm} {c.minutes:.1f} ({c.cpu_minutes:.1f} CPU)" in cost
    # Secondary and collapse figures are labelled so (folded below the primary table).
    page.click("details.secondary-fold summary")
    labels = page.locator("h4.secondary-label").all_inner_texts()
    assert any(t.startswith("secondary: eval/episode_return") for t in labels)
    assert any(t.startswith("collapse monitor · secondary: probe_relevance") for t in labels)
    assert page.locator("table.study-arms.secondary").count() == len(group.secondary)
    # Curves: a chart per metric with each arm's mean and its band.
    page.wait_for_selector(".study-charts[data-charts]")
    assert int(page.get_attribute(".study-charts", "data-charts") or 0) >= 3
    primary_chart = page.locator(".study-chart[data-role=primary]")
    assert primary_chart.count() == 1
    assert primary_chart.locator("canvas").evaluate("c => c.width * c.height") > 10_000
    change = page.locator(".study-chart[data-role=change]")  # each arm's change from the start
    assert change.count() == 1 and group.change_curves
    assert "change from each seed's start" in change.inner_text()
    shot(page, "study-page")
    # One run of the runs table opens.
    page.click(f"#study-runs a[href='/runs/{report.runs[0].run_id}']")
    page.wait_for_load_state("networkidle")
    assert page.url.endswith(f"/runs/{report.runs[0].run_id}")
    page.go_back()
    page.click("a[href='/studies']")
    assert page.locator("#studies a", has_text="onerror").count() == 1
    shot(page, "studies-list")
    assert not dialogs and not page.js_errors


def test_study_exports_and_team_scope(base_url: str, real_study: TinyStudy) -> None:
    sid = real_study.study_id
    with _client(base_url, real_study.read_token) as c:
        got = c.get(f"/studies/{sid}/report.json")
        assert got.status_code == 200
        assert "attachment" in got.headers["content-disposition"]
        data = json.loads(got.text)
        with session_scope() as s:
            assert data == json.loads(build_report(s, sid).model_dump_json())
        text = c.get(f"/studies/{sid}/report.csv").text
        rows = list(csv.DictReader(io.StringIO(text)))
        runs = [r for r in rows if r["kind"] == "run" and r["metric"] == "eval/success_rate"]
        assert len(runs) == 4
        assert {r["arm"] for r in runs} == {QUOTED_ARM, HOSTILE_ARM}
        starts = [r for r in rows if r["kind"] == "start" and r["metric"] == "eval/success_rate"]
        stored = data["groups"][0]["primary"]["start_scores"]  # the report's, as JSON
        assert {r["seed"]: float(r["value"]) for r in starts} == stored
        assert len(starts) == len(real_study.seeds)
        verdicts = [r["verdict"] for r in rows if r["kind"] == "paired difference"]
        assert "not decided at 2 seeds" in verdicts
        page = c.get(f"/studies/{sid}")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp.split("script-src")[1]
        assert "<script>alert(" not in page.text and "<img src=x" not in page.text
        assert c.get("/studies/2147483647").status_code == 404
        assert c.get("/studies/0").status_code in (404, 422)
    with _client(base_url, real_study.other_team_token) as other:
        assert other.get(f"/studies/{sid}").status_code == 404
        assert other.get(f"/studies/{sid}/report.json").status_code == 404
        assert other.get(f"/studies/{sid}/report.csv").status_code == 404
        assert "onerror" not in other.get("/studies").text
