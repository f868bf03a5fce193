"""Read the deployment files as their runtimes do: compose with its variable interpolation, the
kustomize overlays through the renderer, and every container reduced to a ``Process``."""

from __future__ import annotations

import base64
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.settings import Settings
from tests.deploy.kustomize import Resource, pod_specs, render

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
K8S = ROOT / "k8s"
OVERLAYS = ("dev", "gpu")
# Files an operator creates from their example before `kubectl apply -k`.
OPERATOR_FILES = {"overlays/gpu/secrets.env": "overlays/gpu/secrets.env.example"}
# Values for the secrets .env.example leaves empty on purpose (compose refuses to start without).
TEST_SECRETS = {
    "POSTGRES_PASSWORD": "0123456789abcdef",
    "GTR_SECRET_KEY": "f" * 64,
    "GTR_SERVICE_TOKEN": "e" * 64,
    "FLOWER_BASIC_AUTH": "admin:test",
}
SHELLS = {"sh", "bash"}


class InterpolationError(ValueError):
    """A ${VAR:?message} whose variable is unset or empty: compose refuses the file."""


@dataclass
class Process:
    """One container's process: where it is declared, its argv, environment and ports."""

    where: str
    argv: list[str]
    env: dict[str, str]
    ports: set[int] = field(default_factory=set)
    # mount path -> the shared volume behind it (compose named volume or PVC claim name)
    mounts: dict[str, str] = field(default_factory=dict)


# --- compose -----------------------------------------------------------------------------------


def read_env_file(path: Path, include_commented: bool = False) -> dict[str, str]:
    """KEY=VALUE lines of a dotenv file; optionally also the commented-out ``# KEY=VALUE`` ones."""
    pairs: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if include_commented and re.match(r"#\s*[A-Z][A-Z0-9_]*=", line):
            line = line.lstrip("#").strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, ${VAR?err}, $VAR, $$."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("${", i):
            end = _closing_brace(text, i + 2)
            out.append(_substitute(text[i + 2 : end], env))
            i = end + 1
        elif match := re.match(r"\$([A-Za-z_][A-Za-z0-9_]*)", text[i:]):
            out.append(env.get(match.group(1), ""))
            i += match.end()
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _closing_brace(text: str, start: int) -> int:
    depth = 1
    for j in range(start, len(text)):
        if text.startswith("${", j):
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    raise ValueError(f"unclosed ${{ in {text!r}")


def _substitute(expr: str, env: dict[str, str]) -> str:
    match = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])(.*))?", expr, re.S)
    if not match:
        raise ValueError(f"bad interpolation ${{{expr}}}")
    name, op, rest = match.groups()
    value = env.get(name)
    missing = value is None or (op is not None and op.startswith(":") and value == "")
    if op is None or not missing:
        return value or ""
    if op.endswith("?"):
        raise InterpolationError(f"{name}: {rest}")
    return interpolate(rest, env)


def _interpolate_tree(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolate_tree(n, env) for n in node]
    if isinstance(node, dict):
        return {k: _interpolate_tree(v, env) for k, v in node.items()}
    return node


def raw_compose() -> dict[str, Any]:
    """docker-compose.yml as parsed YAML (anchors and merge keys resolved), not interpolated."""
    return yaml.safe_load(COMPOSE_FILE.read_text())


def compose_variables() -> dict[str, str]:
    """What `docker compose` interpolates with: .env (from .env.example) with its secrets set."""
    env = read_env_file(ENV_EXAMPLE)
    env.update(TEST_SECRETS)
    return env


def compose_config(env: dict[str, str] | None = None) -> dict[str, Any]:
    return _interpolate_tree(raw_compose(), compose_variables() if env is None else env)


def compose_processes(config: dict[str, Any], dotenv: dict[str, str]) -> list[Process]:
    """Every compose service running our image (env_file .env) as a Process."""
    procs = []
    for name, svc in config["services"].items():
        if "env_file" not in svc:
            continue
        env = dict(dotenv)
        env.update({k: str(v) for k, v in (svc.get("environment") or {}).items()})
        ports = {
            int(str(p).rsplit(":", 1)[-1]) for p in svc.get("ports", []) + svc.get("expose", [])
        }
        mounts = {v.split(":")[1]: v.split(":")[0] for v in svc.get("volumes", [])}
        argv = list(map(str, svc["command"]))
        procs.append(Process(f"compose:{name}", argv, env, ports, mounts))
    return procs


# --- kubernetes --------------------------------------------------------------------------------


def render_overlay(name: str, workdir: Path) -> list[Resource]:
    """Render k8s/overlays/<name> in a copy of k8s/ holding the operator's files (from examples)."""
    copy = workdir / "k8s"
    if not copy.exists():
        shutil.copytree(K8S, copy)
        for target, example in OPERATOR_FILES.items():
            shutil.copy(copy / example, copy / target)
    return render(copy / "overlays" / name)


def find(resources: list[Resource], kind: str, name: str) -> Resource:
    hits = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def _config_values(resources: list[Resource], kind: str, name: str) -> dict[str, str]:
    res = find(resources, kind, name)
    values = dict(res.get("data", {}))
    if kind == "Secret":
        values = {k: base64.b64decode(v).decode() for k, v in values.items()}
        values.update(res.get("stringData", {}))
    return values


def container_env(resources: list[Resource], container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom, then env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(_config_values(resources, "ConfigMap", source["configMapRef"]["name"]))
        if "secretRef" in source:
            env.update(_config_values(resources, "Secret", source["secretRef"]["name"]))
    for var in container.get("env", []):
        env[var["name"]] = var.get("value", "")
    return env


def kubelet_expand(arg: str, env: dict[str, str]) -> str:
    """$(VAR) references in command/args, as the kubelet expands them ($$ escapes)."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        arg,
    )


def k8s_processes(resources: list[Resource], overlay: str) -> list[Process]:
    """Every container of our image (gtr-config in its envFrom) as a Process."""
    procs = []
    for res in resources:
        for spec in pod_specs(res):
            for container in spec.get("initContainers", []) + spec["containers"]:
                refs = [s.get("configMapRef", {}).get("name") for s in container.get("envFrom", [])]
                if "gtr-config" not in refs:
                    continue
                env = container_env(resources, container)
                argv = [
                    kubelet_expand(a, env) for a in container["command"] + container.get("args", [])
                ]
                ports = {p["containerPort"] for p in container.get("ports", [])}
                claims = {
                    v["name"]: v["persistentVolumeClaim"]["claimName"]
                    for v in spec.get("volumes", [])
                    if "persistentVolumeClaim" in v
                }
                mounts = {
                    m["mountPath"]: claims[m["name"]]
                    for m in container.get("volumeMounts", [])
                    if m["name"] in claims
                }
                where = f"k8s/{overlay}:{res['kind']}/{res['metadata']['name']}/{container['name']}"
                procs.append(Process(where, argv, env, ports, mounts))
    return procs


def settings_for(env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """Settings as a process with exactly ``env`` (its GTR_ variables, no .env file) reads them."""
    for name in [n for n in os.environ if n.startswith("GTR_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("GTR_"):
            monkeypatch.setenv(name, value)
    return Settings(_env_file=None)


# --- commands ----------------------------------------------------------------------------------


def program_commands(argv: list[str]) -> list[list[str]]:
    """The commands a container runs: argv itself, or each command of an `sh -c` script."""
    if argv[0] not in SHELLS:
        return [argv]
    assert argv[1] == "-c", f"shell without -c: {argv}"
    commands, current = [], []
    for token in shlex.split(argv[2]) + [";"]:
        if token in ("||", "&&", ";"):
            if current:
                commands.append(current[1:] if current[0] == "exec" else current)
            current = []
        else:
            current.append(token)
    return commands


def option_value(argv: list[str], option: str) -> str | None:
    """The value of ``--option VALUE`` or ``--option=VALUE`` in argv."""
    for i, token in enumerate(argv):
        if token == option and i + 1 < len(argv):
            return argv[i + 1]
        if token.startswith(option + "="):
            return token.split("=", 1)[1]
    return None
