"""Who can reach the env and policy services (issue #16): in compose only the controller and the
workers share their internal network; in Kubernetes a NetworkPolicy admits only those pods (and,
with k8s/monitoring applied, Prometheus on the metrics port); and every process of both
deployments carries the service token those services require."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.kustomize import Resource, load_documents
from tests.deploy.manifests import (
    K8S,
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


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int]  # container port name -> number

    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace}  # set by Kubernetes itself


# Prometheus as k8s/monitoring/network-policy.yaml describes it (kube-prometheus-stack's pods),
# and two look-alikes that must stay out: another pod of its namespace, Prometheus elsewhere.
PROMETHEUS = Pod(
    "prometheus",
    "monitoring",
    {"app.kubernetes.io/name": "prometheus", "prometheus": "kube-prometheus-stack-prometheus"},
    {},
)
OUTSIDERS = [
    Pod("grafana", "monitoring", {"app.kubernetes.io/name": "grafana"}, {}),
    Pod("prometheus-elsewhere", "default", PROMETHEUS.labels, {}),
]


def _pods(resources: list[Resource]) -> list[Pod]:
    out = []
    for r in resources:
        if r["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        ports = {
            port["name"]: port["containerPort"]
            for c in r["spec"]["template"]["spec"]["containers"]
            for port in c.get("ports") or []
        }
        labels = r["spec"]["template"]["metadata"]["labels"]
        out.append(Pod(r["metadata"]["name"], r["metadata"]["namespace"], labels, ports))
    return out


def _peer_admits(peer: dict[str, Any], policy_ns: str, client: Pod) -> bool:
    """NetworkPolicy peer semantics: podSelector alone means the policy's own namespace."""
    assert "ipBlock" not in peer, peer
    if "namespaceSelector" in peer:
        if not _selected(peer["namespaceSelector"], client.namespace_labels()):
            return False
    elif client.namespace != policy_ns:
        return False
    return _selected(peer.get("podSelector") or {}, client.labels)


def _port_admits(rule: dict[str, Any], target: Pod, port: int) -> bool:
    if not rule.get("ports"):
        return True
    for p in rule["ports"]:
        assert p.get("protocol", "TCP") == "TCP", p
        if p["port"] == port or target.ports.get(str(p["port"])) == port:
            return True
    return False


def _admitted_ports(policies: list[dict[str, Any]], target: Pod, client: Pod) -> set[int]:
    """The ports of ``target`` (its declared ones, and one it does not serve) that ``client``
    may connect to; every port while no policy isolates ``target`` for ingress."""
    ports = {*target.ports.values(), 9}  # 9: discard, a port no container serves
    isolating = [
        p
        for p in policies
        if p["metadata"].get("namespace", target.namespace) == target.namespace
        and "Ingress" in p["spec"]["policyTypes"]
        and _selected(p["spec"]["podSelector"], target.labels)
    ]
    if not isolating:
        return ports
    return {
        port
        for p in isolating
        for rule in p["spec"].get("ingress") or []
        if any(_peer_admits(peer, target.namespace, client) for peer in rule.get("from") or [{}])
        for port in ports
        if _port_admits(rule, target, port)
    }


def _monitoring() -> list[Resource]:
    """k8s/monitoring's resources; `kubectl apply -k k8s/monitoring -n NS` puts them in NS."""
    kust = yaml.safe_load((K8S / "monitoring" / "kustomization.yaml").read_text())
    return [d for r in kust["resources"] for d in load_documents(K8S / "monitoring" / r)]


@pytest.mark.parametrize("overlay", ["dev", "gpu"])
@pytest.mark.parametrize("monitoring", [False, True])
def test_k8s_network_policy_admits_only_the_controller_and_workers(
    overlay: str, monitoring: bool, tmp_path: Path
) -> None:
    """Who may connect to which pod on which port, with and without k8s/monitoring applied."""
    resources = render_overlay(overlay, tmp_path)
    pods = _pods(resources)
    (namespace,) = {p.namespace for p in pods}
    extra = _monitoring() if monitoring else []
    policies = _policies(resources) + [
        {**p, "metadata": {**p["metadata"], "namespace": namespace}} for p in _policies(extra)
    ]
    component = {p.name: p.labels.get(COMPONENT, "datastore") for p in pods}
    for target in pods:
        admitted = {
            (component[c.name], port) for c in pods for port in _admitted_ports(policies, target, c)
        }
        scrapers = {
            (c.name, port)
            for c in [PROMETHEUS, *OUTSIDERS]
            for port in _admitted_ports(policies, target, c)
        }
        role = component[target.name]
        http = target.ports.get("http")
        if role in INTERNAL:
            clients = CLIENTS - {"trainer-gpu", "prometheus"}
            if role == "env":  # the policy service steps a rollout's envs (POST /rollout)
                clients = clients | {"policy"}
            assert admitted == {(c, http) for c in clients}, (
                target.name,
                admitted,
            )
            # Prometheus on the metrics port only, and only once k8s/monitoring is applied.
            assert scrapers == ({("prometheus", http)} if monitoring else set()), scrapers
        elif role in ("controller", "trainer", "corrector", "migrate"):  # serve nothing
            assert not admitted and not scrapers, (target.name, admitted, scrapers)


@pytest.mark.parametrize("overlay", ["dev", "gpu"])
def test_k8s_prometheus_may_scrape_every_service_its_servicemonitor_names(
    overlay: str, tmp_path: Path
) -> None:
    resources = render_overlay(overlay, tmp_path)
    pods = _pods(resources)
    extra = _monitoring()
    (monitor,) = [d for d in extra if d["kind"] == "ServiceMonitor"]
    policies = _policies(resources) + [
        {**p, "metadata": {**p["metadata"], "namespace": pods[0].namespace}}
        for p in _policies(extra)
    ]
    for policy in _policies(extra):  # the ServiceMonitor is a CRD: test_monitoring reads it
        kubernetes_validate.validate(policy, "1.30.0", strict=True)
    (endpoint,) = monitor["spec"]["endpoints"]
    scraped = [
        s
        for s in resources
        if s["kind"] == "Service"
        and _selected(monitor["spec"]["selector"], s["metadata"]["labels"])
    ]
    assert {s["metadata"]["name"] for s in scraped} == {"gtr-api", "gtr-env", "gtr-policy"}
    for svc in scraped:
        (port,) = [p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"]]
        backends = [
            p for p in pods if _selected({"matchLabels": svc["spec"]["selector"]}, p.labels)
        ]
        assert backends, svc["metadata"]["name"]
        for pod in backends:
            target = (
                pod.ports[port["targetPort"]]
                if isinstance(port["targetPort"], str)
                else (port["targetPort"])
            )
            assert target in _admitted_ports(policies, pod, PROMETHEUS), (pod.name, target)


def test_every_process_of_both_deployments_has_the_service_token(tmp_path: Path) -> None:
    procs = compose_processes(compose_config(), compose_variables())
    for overlay in ("dev", "gpu"):
        procs += k8s_processes(render_overlay(overlay, tmp_path / overlay), overlay)
    assert procs
    for proc in procs:
        assert proc.env.get("GTR_SERVICE_TOKEN"), proc.where
