"""Who can reach the env and policy services (issue #16): in compose only the controller and the
workers share their internal network; in Kubernetes a NetworkPolicy admits only those pods; and
every process of both deployments carries the service token those services require."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.deploy.kustomize import Resource
from tests.deploy.manifests import (
    compose_config,
    compose_processes,
    compose_variables,
    k8s_processes,
    render_overlay,
)

# The parts that call them, and Prometheus (profile monitoring) that scrapes their /metrics.
CLIENTS = {"controller", "trainer", "trainer-gpu", "corrector", "prometheus"}
INTERNAL = {"env", "policy"}
COMPONENT = "app.kubernetes.io/component"


def test_compose_puts_the_internal_services_on_an_internal_network_only() -> None:
    config = compose_config()
    networks = config["networks"]
    internal = {name for name, net in networks.items() if (net or {}).get("internal")}
    assert internal, "no internal network"
    on = {name: set(svc.get("networks") or ["default"]) for name, svc in config["services"].items()}
    for name in INTERNAL:
        assert on[name] <= internal, (name, on[name])
        assert "ports" not in config["services"][name], f"{name} is published"
    reach = {name for name, nets in on.items() if nets & on["env"]} - INTERNAL
    assert reach == CLIENTS, reach  # the API, Flower and the datastores cannot connect


def _policies(resources: list[Resource]) -> list[dict[str, Any]]:
    return [r for r in resources if r["kind"] == "NetworkPolicy"]


def _selected(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if not (selector.get("matchLabels") or {}).items() <= labels.items():
        return False
    for expr in selector.get("matchExpressions") or []:
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


@pytest.mark.parametrize("overlay", ["dev", "gpu"])
def test_k8s_network_policy_admits_only_the_controller_and_workers(
    overlay: str, tmp_path: Path
) -> None:
    resources = render_overlay(overlay, tmp_path)
    templates = [
        r["spec"]["template"]["metadata"]["labels"]
        for r in resources
        if r["kind"] in ("Deployment", "StatefulSet", "Job")
    ]
    pods = {labels.get(COMPONENT, "datastore"): labels for labels in templates}
    for component in INTERNAL:
        rules = [
            p for p in _policies(resources) if _selected(p["spec"]["podSelector"], pods[component])
        ]
        assert rules and all("Ingress" in p["spec"]["policyTypes"] for p in rules), component
        allowed = {
            name
            for p in rules
            for rule in p["spec"].get("ingress", [])
            for peer in rule["from"]
            for name, labels in pods.items()
            if _selected(peer["podSelector"], labels)
        }
        # k8s: the ServiceMonitor's Prometheus is not admitted yet (a note on issue 20).
        assert allowed == CLIENTS - {"trainer-gpu", "prometheus"}, (component, allowed)
    for component in ("controller", "trainer", "corrector"):  # serve nothing: no ingress
        rules = [
            p for p in _policies(resources) if _selected(p["spec"]["podSelector"], pods[component])
        ]
        assert rules and not any(p["spec"].get("ingress") for p in rules), component


def test_every_process_of_both_deployments_has_the_service_token(tmp_path: Path) -> None:
    procs = compose_processes(compose_config(), compose_variables())
    for overlay in ("dev", "gpu"):
        procs += k8s_processes(render_overlay(overlay, tmp_path / overlay), overlay)
    assert procs
    for proc in procs:
        assert proc.env.get("GTR_SERVICE_TOKEN"), proc.where
