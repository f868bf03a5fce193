"""Prometheus `/metrics` of the env, policy and corrector services (real uvicorn servers), JSON
log lines with the run id, and a tracker that fails without failing anything."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from shared.logs import RUN_HEADER, JsonFormatter, RunIdFilter, run_context
from tests.conftest import live_server


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(m: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in m.items() if n == name and labels.items() <= dict(lab).items())


def test_env_service_counts_steps_batches_and_requests_per_route() -> None:
    from services.env.app import create_app
    from services.env.client import EnvClient

    with live_server(create_app()) as url:
        before = _scrape(url)
        client = EnvClient(url)
        sids = [client.create("numberline", None, seed=i) for i in range(3)]
        client.reset(sids[0], options=None)
        client.step_batch([(sid, '{"action": "+"}') for sid in sids])
        client.step_batch([(sid, '{"action": "-"}') for sid in sids[:2]])
        after = _scrape(url)
    steps = _get(after, "gtr_env_steps_total") - _get(before, "gtr_env_steps_total")
    assert steps == 5
    batches = _get(after, "gtr_env_step_batch_size_count") - _get(
        before, "gtr_env_step_batch_size_count"
    )
    assert batches == 2
    # Per route template, never per session id (bounded label sets).
    created = dict(service="env", route="/envs", method="POST", status="201")
    assert (
        _get(after, "gtr_http_requests_total", **created)
        - _get(before, "gtr_http_requests_total", **created)
        == 3
    )
    assert not any(sid in str(k) for k in after for sid in sids)
    assert _get(after, "gtr_http_request_duration_seconds_count", service="env") > 0


def test_corrector_service_counts_verdicts_latency_and_tokens() -> None:
    from services.corrector.app import create_app
    from services.corrector.oracle import OracleCorrector

    state = {"task": "numberline", "current": 1, "target": 4, "max_position": 5, "steps": 0}
    wrong = {"current number": 3, "target number": 4, "thoughts": "<b>3</b>", "action": "+"}
    with live_server(create_app(OracleCorrector(), "oracle")) as url:
        before = _scrape(url)
        body = {"task": "numberline", "prompt": "p", "output": json.dumps(wrong), "state": state}
        assert httpx.post(f"{url}/v1/correct", json=body).json()["verdict"] == "incorrect"
        bad = httpx.post(f"{url}/v1/correct", json={**body, "state": None})
        assert bad.status_code >= 400
        after = _scrape(url)
    delta = lambda name, **kw: _get(after, name, **kw) - _get(before, name, **kw)  # noqa: E731
    assert delta("gtr_corrector_requests_total", backend="oracle", outcome="incorrect") == 1
    assert delta("gtr_corrector_latency_seconds_count", backend="oracle") >= 1
    assert delta("gtr_http_requests_total", service="corrector", route="/v1/correct") == 2


def test_policy_service_counts_generated_tokens_and_batch_sizes(tiny_model_dir: Path) -> None:
    from services.policy.app import create_app
    from services.policy.client import PolicyClient
    from services.policy.service import Policy

    policy = Policy.load(tiny_model_dir, lora_r=4)
    with live_server(create_app(policy, max_wait_ms=1)) as url:
        before = _scrape(url)
        images = [np.zeros((64, 64, 3), dtype=np.uint8)] * 3
        gens = PolicyClient(url).generate(images, ["a", "b", "c"], max_new_tokens=5)
        after = _scrape(url)
    tokens = sum(len(g.token_ids) for g in gens)
    assert tokens > 0
    assert (
        _get(after, "gtr_policy_generated_tokens_total")
        - _get(before, "gtr_policy_generated_tokens_total")
        == tokens
    )
    assert _get(after, "gtr_policy_batch_size_sum") - _get(before, "gtr_policy_batch_size_sum") == 3


def test_json_log_lines_carry_the_run_id() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RunIdFilter())
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("gtr.test.json")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        with run_context(42):
            log.info('step "%s" <script>', 3, extra={"update": 1})
        log.warning("outside")
    finally:
        log.removeHandler(handler)
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["run_id"] == 42 and first["message"] == 'step "3" <script>'
    assert first["update"] == 1 and first["level"] == "INFO" and first["logger"] == "gtr.test.json"
    assert second["run_id"] is None
    assert RUN_HEADER == "X-GTR-Run-Id"


def test_a_failing_tracker_is_recorded_and_switched_off(tmp_path: Path) -> None:
    from services.controller.console import info_lines
    from services.controller.tracking import TensorBoard, Trackers
    from shared.schemas import RunConfig

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the event folder should be")
    cfg = RunConfig.model_validate({"task": "numberline"})
    hub = Trackers(1, cfg, [TensorBoard(blocker / "tb"), TensorBoard(tmp_path / "ok")])
    hub.trackers[1].name = "tensorboard-ok"  # two of a kind, told apart
    m0 = hub.log(0, {"success_rate": 0.5, "rollout_sha": "ab", "nan": float("nan")})
    m1 = hub.log(1, {"success_rate": 0.75})
    hub.finish("completed", {"status": "completed"})
    assert m0["tracking/failures"] == m1["tracking/failures"] == 1.0
    status = hub.status()
    assert status["tensorboard"]["ok"] is False and "start" in status["tensorboard"]["error"]
    assert status["tensorboard-ok"]["ok"] is True
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "ok"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("success_rate")] == [(0, 0.5), (1, 0.75)]
    assert "nan" not in acc.Tags()["scalars"] and "rollout_sha" not in acc.Tags()["scalars"]
    lines = info_lines({"tracking": status})
    assert any("tensorboard FAILED" in line for line in lines)
