"""docker-compose.yml: the compose specification's schema, interpolation, dependencies, profiles,
volumes, health checks and ports, read as `docker compose` reads them."""

from __future__ import annotations

import copy
import json
import re
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest

from tests.deploy.manifests import (
    COMPOSE_FILE,
    ENV_EXAMPLE,
    TEST_SECRETS,
    InterpolationError,
    compose_config,
    compose_processes,
    compose_variables,
    option_value,
    read_env_file,
)

# The official compose-spec schema (compose-spec/compose-spec, Apache-2.0), as vendored and kept
# current by check-jsonschema, with its licence beside it in that package.
SCHEMA = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
TRAINER = ["gtr", "worker", "trainer"]


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return compose_config()


def _validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA.read_text())
    return jsonschema.validators.validator_for(schema)(schema)


def _app_services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: svc for name, svc in config["services"].items() if "env_file" in svc}


def test_compose_file_matches_the_compose_specification(config: dict[str, Any]) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in _validator().iter_errors(config)]
    assert not errors, "\n".join(errors)


def test_schema_check_rejects_a_broken_file(config: dict[str, Any]) -> None:
    broken = copy.deepcopy(config)
    broken["services"]["api"]["comand"] = ["gtr"]
    broken["services"]["api"]["depends_on"]["migrate"]["condition"] = "service_done"
    assert len(list(_validator().iter_errors(broken))) >= 2


@pytest.mark.parametrize("secret", sorted(TEST_SECRETS))
def test_compose_refuses_to_start_without_each_secret(secret: str) -> None:
    variables = compose_variables()
    variables[secret] = ""
    with pytest.raises(InterpolationError, match=secret):
        compose_config(variables)


def test_every_interpolated_variable_is_documented_in_env_example() -> None:
    documented = read_env_file(ENV_EXAMPLE, include_commented=True)
    used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", COMPOSE_FILE.read_text()))
    assert used, "no interpolation found: the parser is broken"
    assert used - documented.keys() == set()


def test_env_example_profiles_exist(config: dict[str, Any]) -> None:
    declared = {p for svc in config["services"].values() for p in svc.get("profiles", [])}
    chosen = set(read_env_file(ENV_EXAMPLE)["COMPOSE_PROFILES"].split(","))
    assert chosen <= declared
    assert {"cpu", "gpu", "datastores"} <= declared


def test_dependencies_exist_and_wait_for_the_right_condition(config: dict[str, Any]) -> None:
    services = config["services"]
    for name, svc in services.items():
        for dep, rule in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on a missing service {dep}"
            if rule["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], (
                    f"{name} waits for {dep}'s missing healthcheck"
                )
            if rule["condition"] == "service_completed_successfully":
                assert services[dep]["restart"] == "no", f"{dep} is one-shot, it must not restart"
            # An optional dependency is exactly a service that a profile may leave out.
            assert rule.get("required", True) == (not services[dep].get("profiles")), (name, dep)


def test_processes_that_use_the_database_wait_for_the_migration(config: dict[str, Any]) -> None:
    for name, svc in _app_services(config).items():
        argv = svc["command"]
        if argv[:2] in (["gtr", "serve"], ["gtr", "controller"], ["gtr", "worker"]):
            rule = svc["depends_on"]["migrate"]
            assert rule["condition"] == "service_completed_successfully", name
    assert config["services"]["migrate"]["command"] == ["gtr", "db", "upgrade"]


def test_one_trainer_per_profile_and_only_the_gpu_one_reserves_a_gpu(
    config: dict[str, Any],
) -> None:
    services = _app_services(config)
    trainers = {name: svc for name, svc in services.items() if svc["command"] == TRAINER}
    by_profile = {tuple(svc.get("profiles", [])): name for name, svc in trainers.items()}
    assert set(by_profile) == {("cpu",), ("gpu",)}, by_profile
    gpu, cpu = trainers[by_profile[("gpu",)]], trainers[by_profile[("cpu",)]]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert gpu["build"]["args"]["VARIANT"] == "cuda" and cpu["build"]["args"]["VARIANT"] == "cpu"
    assert gpu["image"] != cpu["image"], "the CUDA build needs its own image tag"
    for name, svc in services.items():
        if name not in trainers:
            assert "profiles" not in svc, f"{name} must run on CPU-only machines too"
            assert "deploy" not in svc, f"{name} must not reserve devices"


def test_named_volumes_are_declared_and_shared_folders_mounted(config: dict[str, Any]) -> None:
    declared = set(config["volumes"])
    used = set()
    for svc in config["services"].values():
        used |= {v.split(":")[0] for v in svc.get("volumes", []) if not v.startswith((".", "/"))}
    assert used == declared
    assert {"pgdata", "blobs", "checkpoints", "models"} <= declared
    for name, svc in _app_services(config).items():
        mounts = {v.split(":")[1]: v.split(":")[0] for v in svc["volumes"]}
        env = svc["environment"]
        assert mounts.get(env["GTR_BLOB_DIR"]) == "blobs", name
        assert mounts.get(env["GTR_CHECKPOINT_DIR"]) == "checkpoints", name
        assert mounts.get(env["GTR_MODEL_DIR"]) == "models", name


def _healthcheck_url(svc: dict[str, Any]) -> str:
    test = " ".join(svc["healthcheck"]["test"])
    match = re.search(r"https?://[^'\" ]+", test)
    assert match, f"no URL in healthcheck {test}"
    return match.group(0)


def test_servers_listen_publish_and_check_health_on_the_same_port(config: dict[str, Any]) -> None:
    servers = 0
    for proc in compose_processes(config, read_env_file(ENV_EXAMPLE)):
        port = option_value(proc.argv, "--port")
        if port is None:
            continue
        servers += 1
        name = proc.where.split(":", 1)[1]
        url = urlsplit(_healthcheck_url(config["services"][name]))
        assert url.port == int(port), f"{name}: health check on {url.port}, listens on {port}"
        assert url.path in ("/healthz", "/readyz", "/healthcheck"), name
        assert proc.ports == {int(port)}, f"{name}: ports {proc.ports}, listens on {port}"
        if proc.argv[:2] == ["gtr", "serve"]:
            assert url.path == "/readyz", "the API is healthy only when its database is reachable"
    assert servers == 4  # api, env, policy, flower


def test_service_urls_point_at_the_service_that_serves_them(config: dict[str, Any]) -> None:
    procs = {
        p.where.split(":", 1)[1]: p for p in compose_processes(config, read_env_file(ENV_EXAMPLE))
    }
    wanted = {
        "GTR_ENV_SERVICE_URL": ["gtr", "env", "serve"],
        "GTR_POLICY_SERVICE_URL": ["gtr", "policy", "serve"],
    }
    for proc in procs.values():
        for var, argv in wanted.items():
            url = urlsplit(proc.env[var])
            target = procs[url.hostname]
            assert target.argv[: len(argv)] == argv, f"{var} -> {url.hostname} runs {target.argv}"
            assert option_value(target.argv, "--port") == str(url.port), var


def test_envs_hosted_by_the_policy_service_as_env_example_says(config: dict[str, Any]) -> None:
    """The two commented lines of .env.example: every process then reaches the env routes on
    the policy service, which is told to host them."""
    documented = read_env_file(ENV_EXAMPLE, include_commented=True)
    hosted = {k: documented[k] for k in ("GTR_POLICY_HOSTS_ENVS", "GTR_ENV_SERVICE_URL")}
    dotenv = {**read_env_file(ENV_EXAMPLE), **hosted}
    procs = {
        p.where.split(":", 1)[1]: p
        for p in compose_processes(compose_config({**compose_variables(), **hosted}), dotenv)
    }
    for proc in procs.values():
        url = urlsplit(proc.env["GTR_ENV_SERVICE_URL"])
        target = procs[url.hostname]
        assert target.argv[:3] == ["gtr", "policy", "serve"], target.argv
        assert option_value(target.argv, "--port") == str(url.port) and url.path == "/env"
        assert target.env["GTR_POLICY_HOSTS_ENVS"] == "true"
    assert urlsplit(procs["controller"].env["GTR_ENV_SERVICE_URL"]).hostname == "policy"
    # Without them, the env service's own URL, as before.
    default = compose_processes(config, read_env_file(ENV_EXAMPLE))
    assert {urlsplit(p.env["GTR_ENV_SERVICE_URL"]).hostname for p in default} == {"env"}
