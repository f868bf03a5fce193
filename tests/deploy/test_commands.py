"""What compose and k8s run is what the code offers: every command exists (`--help` starts it) and
takes the options given; every GTR_ variable is a Settings field; each process's settings parse
to a deployment (PostgreSQL, Redis, the shared folders mounted), never the embedded default."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import flower.options  # noqa: F401  (defines flower's command-line options)
import pytest
from tornado.options import options as tornado_options

from shared.settings import Settings
from tests.deploy.manifests import (
    ENV_EXAMPLE,
    K8S,
    OPERATOR_FILES,
    OVERLAYS,
    Process,
    compose_config,
    compose_processes,
    k8s_processes,
    program_commands,
    read_env_file,
    render_overlay,
    settings_for,
)

BIN = Path(sys.executable).parent
# Roles and the shared folders they read or write (docs/deploy.md).
SHARED_FOLDERS = {
    ("gtr", "serve"): ("blobs", "checkpoints"),
    ("gtr", "controller"): ("blobs", "checkpoints", "models"),
    ("gtr", "worker"): ("blobs",),
    ("gtr", "policy"): ("blobs", "checkpoints", "models"),
}
TRAINER_FOLDERS = ("blobs", "checkpoints", "models")


@cache
def all_processes() -> tuple[Process, ...]:
    """Every container of our image in docker-compose.yml and in both overlays."""
    procs = compose_processes(compose_config(), read_env_file(ENV_EXAMPLE))
    with tempfile.TemporaryDirectory() as workdir:
        for name in OVERLAYS:
            procs += k8s_processes(render_overlay(name, Path(workdir)), name)
    return tuple(procs)


def _commands() -> dict[tuple[str, ...], list[str]]:
    """Each distinct command line -> where it runs."""
    found: dict[tuple[str, ...], list[str]] = {}
    for proc in all_processes():
        for argv in program_commands(proc.argv):
            if argv[0] in ("gtr", "celery"):
                found.setdefault(tuple(argv), []).append(proc.where)
    return found


COMMANDS = _commands()


@cache
def _run_help(argv: tuple[str, ...]) -> str:
    result = subprocess.run(
        [str(BIN / argv[0]), *argv[1:], "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
    )
    assert result.returncode == 0, f"{' '.join(argv)} --help: {result.stdout}{result.stderr}"
    return result.stdout


def _mentions(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def _split(argv: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Command words (values such as paths left out) and the option names used."""
    words = [a for a in argv[1:] if not a.startswith("-") and "/" not in a]
    options = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
    # Option values are not command words.
    values = {argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--") and "=" not in a}
    return [w for w in words if w not in values], options


@pytest.mark.parametrize("argv", sorted(COMMANDS), ids=lambda a: " ".join(a[:3]))
def test_command_exists_and_takes_its_options(argv: tuple[str, ...]) -> None:
    if argv[0] == "celery":
        _check_flower(argv)
        return
    words, options = _split(argv)
    assert words, argv
    leaf = _run_help(("gtr", *words))
    parent = _run_help(("gtr", *words[:-1]))
    assert _mentions(parent, words[-1]), (
        f"'{words[-1]}' is not offered by gtr {' '.join(words[:-1])}"
    )
    for option in options:
        assert _mentions(leaf, option), f"gtr {' '.join(words)} has no option {option}"


def _check_flower(argv: tuple[str, ...]) -> None:
    assert argv[:4] == ("celery", "-A", "shared.queues", "flower"), argv
    _run_help(argv[:4])
    # Flower's own options are tornado options (defined by flower.options), absent from --help.
    for option in argv[4:]:
        name = option.split("=", 1)[0].removeprefix("--").replace("-", "_")
        assert name in tornado_options, option


def test_every_gtr_variable_is_a_setting() -> None:
    fields = {f"GTR_{name.upper()}" for name in Settings.model_fields}
    names = set(read_env_file(ENV_EXAMPLE, include_commented=True))
    for example in OPERATOR_FILES.values():
        names |= set(read_env_file(K8S / example, include_commented=True))
    for proc in all_processes():
        names |= set(proc.env)
    # Corrector API keys live under their own documented prefix, not in the settings.
    gtr = {n for n in names if n.startswith("GTR_") and not n.startswith("GTR_CORRECTOR_KEY_")}
    assert len(gtr) >= 10, gtr
    assert gtr - fields == set()


@pytest.mark.parametrize("proc", all_processes(), ids=lambda p: p.where)
def test_settings_make_a_deployment_not_the_embedded_default(
    proc: Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_for(proc.env, monkeypatch)
    assert settings.database_url and settings.database_url.startswith("postgresql+psycopg://")
    assert settings.redis_url and settings.redis_url.startswith("redis://")
    assert settings.env_service_url and settings.policy_service_url
    role = tuple(proc.argv[:2])
    trainer = proc.argv[:3] == ["gtr", "worker", "trainer"]
    folders = TRAINER_FOLDERS if trainer else SHARED_FOLDERS.get(role, ())
    paths = {
        "blobs": settings.blobs_path,
        "checkpoints": settings.checkpoints_path,
        "models": settings.models_path,
    }
    for folder in folders:
        volume = proc.mounts.get(str(paths[folder]))
        assert volume and volume.endswith(folder), f"{proc.where}: {paths[folder]} is not shared"
