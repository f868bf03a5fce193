"""Monitoring, validated offline: the ServiceMonitor reaches the Services that serve /metrics,
every PromQL expression of the Grafana dashboard names a metric the code exports, and the
compose Prometheus (profile monitoring) scrapes the servers where they listen."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

from tests.deploy.kustomize import load_documents, render
from tests.deploy.manifests import K8S, ROOT, compose_config, option_value

MONITORING = K8S / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"


def _served_metric_names() -> set[str]:
    """Every sample name the services and the API export, as Prometheus stores them."""
    import shared.observe  # noqa: F401  (registers the service metrics)
    from services.api.prom import StoreCollector

    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gauge": ("",),
        "unknown": ("",),
    }
    names = set()
    for fam in [*REGISTRY.collect(), *StoreCollector().collect()]:
        names |= {fam.name + s for s in suffixes.get(fam.type, ("",))}
    return names


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In"
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def test_servicemonitor_scrapes_the_services_that_serve_metrics() -> None:
    kust = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    docs = [d for r in kust["resources"] for d in load_documents(MONITORING / r)]
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert (monitor["apiVersion"], monitor["kind"]) == (
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
    )
    services = [r for r in render(K8S / "base") if r["kind"] == "Service"]
    picked = {
        s["metadata"]["name"]: s
        for s in services
        if _matches(monitor["spec"]["selector"], s["metadata"]["labels"])
    }
    assert set(picked) == {"gtr-api", "gtr-env", "gtr-policy"}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    for name, svc in picked.items():
        assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}, name
    # The generated ConfigMap holds the dashboard for Grafana's sidecar.
    (gen,) = kust["configMapGenerator"]
    assert gen["files"] == [DASHBOARD.name] and gen["options"]["labels"]["grafana_dashboard"]


def test_each_served_app_has_a_metrics_route() -> None:
    from services.api.app import create_app as api
    from services.corrector.app import create_app as corrector
    from services.corrector.oracle import OracleCorrector
    from services.env.app import create_app as env
    from services.policy.app import create_app as policy

    for app in (api(), env(), policy(None), corrector(OracleCorrector(), "oracle")):
        assert "/metrics" in {getattr(r, "path", "") for r in app.routes}, app.title


def test_dashboard_panels_query_only_metrics_the_code_exports(pg_url: str) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "gtr-lab" and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, f"panel {p['title']} overlaps another"
        cells |= mine
        assert g["x"] + g["w"] <= 24
    served = _served_metric_names()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bgtr_[a-z0-9_]+", e)}
    assert used and used <= served, f"unknown metrics: {sorted(used - served)}"
    for e in exprs:  # balanced brackets: a typo a Grafana import would only show as "no data"
        for a, b in ("()", "[]", "{}"):
            assert e.count(a) == e.count(b), e
    # The list: requests/latency per route, env steps/s, tokens/s, batch sizes,
    # corrections per corrector, trainer update time, queue depths, runs by status.
    for needed in (
        "gtr_http_requests_total",
        "gtr_http_request_duration_seconds_bucket",
        "gtr_env_steps_total",
        "gtr_policy_generated_tokens_total",
        "gtr_policy_batch_size_sum",
        "gtr_corrections",
        "gtr_correction_latency_ms_mean",
        "gtr_corrector_tokens",
        "gtr_run_train_s",
        "gtr_queue_depth",
        "gtr_runs",
    ):
        assert needed in used, needed


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return compose_config()


def test_compose_prometheus_is_a_profile_and_scrapes_where_servers_listen(compose) -> None:
    prom = compose["services"]["prometheus"]
    assert prom["profiles"] == ["monitoring"]
    host_file = next(v.split(":")[0] for v in prom["volumes"] if v.startswith("./"))
    scrape = yaml.safe_load((ROOT / host_file).read_text())
    targets = {
        t for job in scrape["scrape_configs"] for c in job["static_configs"] for t in c["targets"]
    }
    assert all(job["metrics_path"] == "/metrics" for job in scrape["scrape_configs"])
    for target in targets:
        host, port = target.split(":")
        argv = compose["services"][host]["command"]
        assert option_value(argv, "--port") == port, target
    assert {t.split(":")[0] for t in targets} == {"api", "env", "policy"}
    assert all(p.startswith("127.0.0.1:") for p in prom["ports"])  # loopback only
