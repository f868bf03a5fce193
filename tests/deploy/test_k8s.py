"""k8s/: both overlays rendered as kustomize would, every manifest validated against the Kubernetes
OpenAPI schemas (offline, kubernetes-validate), then read for wiring a cluster would only reveal
at run time: selectors, references, ports, probes, GPUs, autoscaling and pod security."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from tests.deploy.kustomize import Resource, pod_specs, render
from tests.deploy.manifests import (
    K8S,
    OPERATOR_FILES,
    OVERLAYS,
    container_env,
    find,
    k8s_processes,
    option_value,
    render_overlay,
    settings_for,
)

# The oldest Kubernetes minor still widely supported by managed services, and the newest shipped.
K8S_VERSIONS = ("1.30.0", "1.37.0")
GPU = "nvidia.com/gpu"
SHARED_CLAIMS = {"gtr-blobs", "gtr-checkpoints", "gtr-models"}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Resource]]:
    workdir: Path = tmp_path_factory.mktemp("k8s")
    return {name: render_overlay(name, workdir) for name in OVERLAYS}


@pytest.fixture(params=OVERLAYS)
def resources(
    request: pytest.FixtureRequest, rendered: dict[str, list[Resource]]
) -> list[Resource]:
    return rendered[request.param]


@pytest.fixture
def dev(rendered: dict[str, list[Resource]]) -> list[Resource]:
    return rendered["dev"]


@pytest.fixture
def gpu(rendered: dict[str, list[Resource]]) -> list[Resource]:
    return rendered["gpu"]


def _containers(res: Resource) -> list[dict[str, Any]]:
    return [
        c for spec in pod_specs(res) for c in spec.get("initContainers", []) + spec["containers"]
    ]


def _ours(container: dict[str, Any]) -> bool:
    return any(
        s.get("configMapRef", {}).get("name") == "gtr-config" for s in container.get("envFrom", [])
    )


def _deployment(resources: list[Resource], component: str) -> Resource:
    return find(resources, "Deployment", f"gtr-{component}")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_is_valid_kubernetes(resources: list[Resource], version: str) -> None:
    errors = []
    for res in resources:
        try:
            kubernetes_validate.validate(res, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{res['kind']}/{res['metadata']['name']}: {e.message}")
    assert not errors, "\n".join(errors)


def test_the_services_of_the_issue_are_all_there(resources: list[Resource]) -> None:
    for component in ("api", "env", "policy", "corrector", "controller", "trainer"):
        _deployment(resources, component)
    for component in ("api", "env", "policy"):
        find(resources, "Service", f"gtr-{component}")
    assert find(resources, "Job", "gtr-migrate")["spec"]["template"]["spec"]["containers"][0][
        "command"
    ] == ["gtr", "db", "upgrade"]
    for claim in SHARED_CLAIMS:
        find(resources, "PersistentVolumeClaim", claim)


def test_selectors_match_their_pods_and_services_reach_a_port(resources: list[Resource]) -> None:
    workloads = [r for r in resources if pod_specs(r)]
    for res in workloads:
        if res["kind"] != "Job":
            labels = res["spec"]["template"]["metadata"]["labels"]
            assert res["spec"]["selector"]["matchLabels"].items() <= labels.items(), res["metadata"]
    for svc in (r for r in resources if r["kind"] == "Service"):
        selected = [
            w
            for w in workloads
            if svc["spec"]["selector"].items()
            <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(selected) == 1, (
            f"Service {svc['metadata']['name']} selects {len(selected)} workloads"
        )
        ports = {
            p.get("name"): p["containerPort"]
            for c in _containers(selected[0])
            for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            target = port["targetPort"]
            assert (ports.get(target) if isinstance(target, str) else target) in ports.values(), svc


def test_everything_referenced_exists(resources: list[Resource]) -> None:
    names = {(r["kind"], r["metadata"]["name"]) for r in resources}
    for res in resources:
        for spec in pod_specs(res):
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            templates = {t["metadata"]["name"] for t in res["spec"].get("volumeClaimTemplates", [])}
            for vol in volumes.values():
                if "persistentVolumeClaim" in vol:
                    assert (
                        "PersistentVolumeClaim",
                        vol["persistentVolumeClaim"]["claimName"],
                    ) in names
            for container in spec.get("initContainers", []) + spec["containers"]:
                for mount in container.get("volumeMounts", []):
                    assert mount["name"] in volumes or mount["name"] in templates, mount
                for source in container.get("envFrom", []):
                    for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                        if key in source:
                            assert (kind, source[key]["name"]) in names, source
    for hpa in (r for r in resources if r["kind"] == "HorizontalPodAutoscaler"):
        assert (
            hpa["spec"]["scaleTargetRef"]["kind"],
            hpa["spec"]["scaleTargetRef"]["name"],
        ) in names


def _probe_port(container: dict[str, Any], probe: dict[str, Any]) -> int:
    port = probe["httpGet"]["port"]
    named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    return named[port] if isinstance(port, str) else port


def test_servers_listen_where_their_ports_and_probes_say(resources: list[Resource]) -> None:
    expected_paths = {
        "api": ("/readyz", "/healthz"),
        "env": ("/healthz", "/healthz"),
        "policy": ("/healthz", "/healthz"),
    }
    for component, (ready, live) in expected_paths.items():
        container = _deployment(resources, component)["spec"]["template"]["spec"]["containers"][0]
        port = int(option_value(container["command"], "--port") or 0)
        assert option_value(container["command"], "--host") == "0.0.0.0", component
        assert [p["containerPort"] for p in container["ports"]] == [port], component
        for probe_name, path in (("readinessProbe", ready), ("livenessProbe", live)):
            probe = container[probe_name]
            assert probe["httpGet"]["path"] == path, (component, probe_name)
            assert _probe_port(container, probe) == port, (component, probe_name)


def test_service_urls_in_the_config_reach_the_right_server(resources: list[Resource]) -> None:
    config = find(resources, "ConfigMap", "gtr-config")["data"]
    for var, component in (("GTR_ENV_SERVICE_URL", "env"), ("GTR_POLICY_SERVICE_URL", "policy")):
        host, port = config[var].removeprefix("http://").split(":")
        service = find(resources, "Service", host)
        assert int(port) in [p["port"] for p in service["spec"]["ports"]], var
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == component, var


def test_dev_is_one_replica_each_on_cpu(dev: list[Resource]) -> None:
    resources = dev
    assert not [r for r in resources if r["kind"] == "HorizontalPodAutoscaler"]
    for res in resources:
        if res["kind"] in ("Deployment", "StatefulSet"):
            assert res["spec"]["replicas"] == 1, res["metadata"]["name"]
        for spec in pod_specs(res):
            assert "nodeSelector" not in spec and "tolerations" not in spec, res["metadata"]["name"]
            for c in _containers(res):
                assert GPU not in str(c.get("resources")), (res["metadata"]["name"], c["name"])
                assert not c["image"].endswith("-cuda"), c["image"]
    for claim in SHARED_CLAIMS:
        assert find(resources, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == [
            "ReadWriteOnce"
        ]


def test_gpu_pods_request_a_gpu_land_on_gpu_nodes_and_run_the_cuda_image(
    gpu: list[Resource],
) -> None:
    resources = gpu
    for component in ("trainer", "policy"):
        spec = _deployment(resources, component)["spec"]["template"]["spec"]
        container = spec["containers"][0]
        assert container["resources"]["limits"][GPU] == "1", component
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}, component
        assert any(t["key"] == GPU and t["effect"] == "NoSchedule" for t in spec["tolerations"])
        assert container["image"].endswith("-cuda"), container["image"]
        assert _deployment(resources, component)["spec"]["strategy"]["type"] == "Recreate"
    for component in ("api", "env", "corrector", "controller"):
        spec = _deployment(resources, component)["spec"]["template"]["spec"]
        assert "nodeSelector" not in spec, f"{component} must not take a GPU node"
    for claim in SHARED_CLAIMS:
        assert find(resources, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == [
            "ReadWriteMany"
        ]


def test_gpu_overlay_autoscales_env_and_corrector(gpu: list[Resource]) -> None:
    resources = gpu
    hpas = {
        r["spec"]["scaleTargetRef"]["name"]: r
        for r in resources
        if r["kind"] == "HorizontalPodAutoscaler"
    }
    assert set(hpas) == {"gtr-env", "gtr-corrector"}
    for target, hpa in hpas.items():
        deployment = find(resources, "Deployment", target)
        # With `replicas` in the manifest every `kubectl apply` would undo the autoscaler.
        assert "replicas" not in deployment["spec"], target
        assert hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"] >= 1
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            assert "cpu" in c["resources"]["requests"], "CPU utilisation needs a CPU request"
    assert find(resources, "Deployment", "gtr-controller")["spec"]["replicas"] == 1


def test_gpu_overlay_takes_its_secrets_from_the_operator_file(gpu: list[Resource]) -> None:
    resources = gpu
    api = _deployment(resources, "api")["spec"]["template"]["spec"]["containers"][0]
    env = container_env(resources, api)
    assert "example.internal" in env["GTR_DATABASE_URL"], "the Secret still holds the dev values"
    assert env["GTR_ENVIRONMENT"] == "production"


def test_pods_run_non_root_with_limits_and_resolved_images(resources: list[Resource]) -> None:
    for res in resources:
        for spec in pod_specs(res):
            where = f"{res['kind']}/{res['metadata']['name']}"
            assert spec["securityContext"]["runAsNonRoot"] is True, where
            assert spec["automountServiceAccountToken"] is False, where
            for c in _containers(res):
                assert c["securityContext"]["allowPrivilegeEscalation"] is False, where
                assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], where
                assert {"cpu", "memory"} <= c["resources"]["requests"].keys(), where
                assert "memory" in c["resources"]["limits"], where
                # Every image carries an explicit tag: the overlay resolved the logical names.
                last = c["image"].rsplit("/", 1)[-1]
                assert ":" in last and not last.endswith(":latest"), c["image"]
                if _ours(c):
                    assert spec["securityContext"]["runAsUser"] == 10001, where
                    assert c["securityContext"]["readOnlyRootFilesystem"] is True, where


def test_base_dev_secret_cannot_run_in_production(monkeypatch: pytest.MonkeyPatch) -> None:
    # If an overlay forgot to replace the Secret, production must refuse to start, not run with it.
    base = render(K8S / "base")
    api = _deployment(base, "api")["spec"]["template"]["spec"]["containers"][0]
    with pytest.raises(ValueError, match="GTR_SECRET_KEY must be set"):
        settings_for(container_env(base, api), monkeypatch)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_hosted_envs_component_points_every_process_at_the_policy_service(
    overlay: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """k8s/components/hosted-envs added to an overlay, as its comment says: every process reaches
    the env routes at the policy service's /env, the policy service is told to host them, and
    its Service keeps a client on the pod that holds its sessions."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    for target, example in OPERATOR_FILES.items():
        shutil.copy(copy / example, copy / target)
    kustomization = copy / "overlays" / overlay / "kustomization.yaml"
    kust = yaml.safe_load(kustomization.read_text())
    kust["components"] = ["../../components/hosted-envs"]
    kustomization.write_text(yaml.safe_dump(kust))
    resources = render(copy / "overlays" / overlay)
    for res in resources:
        kubernetes_validate.validate(res, K8S_VERSIONS[-1], strict=True)
    policy = find(resources, "Service", "gtr-policy")
    assert policy["spec"]["sessionAffinity"] == "ClientIP"
    policy_port = _deployment(resources, "policy")["spec"]["template"]["spec"]["containers"][0]
    procs = k8s_processes(resources, overlay)
    assert procs
    for proc in procs:
        url = urlsplit(proc.env["GTR_ENV_SERVICE_URL"])
        assert url.hostname == "gtr-policy" and url.path == "/env", proc.where
        assert url.port in [p["port"] for p in policy["spec"]["ports"]], proc.where
        assert str(url.port) == option_value(policy_port["command"], "--port"), proc.where
        assert settings_for(proc.env, monkeypatch).policy_hosts_envs, proc.where
    # The overlay as shipped still points at the env service.
    shipped = render_overlay(overlay, tmp_path / "shipped")
    assert find(shipped, "ConfigMap", "gtr-config")["data"]["GTR_ENV_SERVICE_URL"].startswith(
        "http://gtr-env:"
    )
