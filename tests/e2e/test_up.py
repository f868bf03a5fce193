"""The documented full-stack path: `gtr up`, then `gtr run create` and `gtr run watch`; a part
killed under `gtr up` comes back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from shared.db.models import Update
from shared.db.session import session_scope
from tests.conftest import free_ports
from tests.e2e.helpers import ROOT, cancel_active_runs, counts, tiny_config

pytestmark = pytest.mark.slow


def _gtr(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _child(parent: int, role: str) -> int:
    """The pid of the `gtr <role>` process that `parent` started."""
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone meanwhile
        if ppid == parent and role.encode() in argv:
            return int(proc.name)
    raise AssertionError(f"no {role} child of {parent}")


def _children(parent: int) -> list[int]:
    """The pids of the processes ``parent`` started (its services under `gtr up`)."""
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                out.append(int(proc.name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextmanager
def _up(
    port: int, env: dict[str, str], stop: signal.Signals = signal.SIGINT
) -> Iterator[subprocess.Popen]:
    """``gtr up --port port``, once it says it is up; stopped by ``stop``, which must take every
    service it started with it within their grace period (15 s)."""
    # Its own session: the whole process group (gtr up and every service) is stopped at the end.
    up = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert up.stdout is not None
        for line in up.stdout:
            if "gtr-lab is up" in line or up.poll() is not None:
                break
        assert up.poll() is None, "gtr up exited early"
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        yield up
        services = _children(up.pid)
        assert len(services) == 6 - ("GTR_POLICY_HOSTS_ENVS" in env), services
        up.send_signal(stop)
        assert up.wait(timeout=30) == 0
        left = [pid for pid in services if _alive(pid)]
        assert not left, f"gtr up stopped by {stop.name} left {left} running"
    finally:
        if up.poll() is None:
            up.kill()
        # No service may outlive the test: a stray worker would take the next tests' tasks.
        try:
            os.killpg(up.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_gtr_up_then_run_create_and_watch(
    pg_url: str, redis_url: str, warm_checkpoint: Path, default_model_dir: Path, tmp_path: Path
) -> None:
    # A data folder of its own, but the session's model folder: `gtr up` finds its default
    # model there instead of building it again (the build itself: tests/conftest.py).
    env = {
        **os.environ,
        "GTR_DATA_DIR": str(tmp_path / "data"),
        "GTR_MODEL_DIR": str(default_model_dir.parent),
    }
    port = free_ports(3)  # the API, then the env and policy services on port+1, port+2
    cancel_active_runs()
    with _up(port, env, stop=signal.SIGTERM) as up:
        assert up.stdout is not None
        # A part killed outright is restarted, and the restarted controller drives the run below.
        os.kill(_child(up.pid, "controller"), signal.SIGKILL)
        said: list[str] = []
        for line in up.stdout:
            said.append(line)
            if "controller restarted" in line or up.poll() is not None:
                break
        assert any("controller exited with code -9; restarting in 1 s" in x for x in said), said
        assert up.poll() is None, said
        token = _gtr("token", "create", "up-test", env=env).stdout.strip()
        api = ["--url", f"http://127.0.0.1:{port}", "--token", token]
        cfg = tmp_path / "run.toml"
        cfg.write_text(tiny_config(warm_checkpoint, envs=2, steps=4, updates=2))
        created = _gtr("run", "create", str(cfg), *api, env=env)
        assert created.returncode == 0, created.stderr
        run_id = int(created.stdout.strip())
        watched = _gtr("run", "watch", str(run_id), "--interval", "1", *api, env=env, timeout=400)
        assert watched.returncode == 0, watched.stdout + watched.stderr
        assert "completed" in watched.stdout and "update 1 done (2 of 2)" in watched.stdout
        c = counts(run_id)
        assert c["steps"] == 16 and c["checkpoints"] == 2 and c["dup_steps"] == 0
        bad = _gtr(
            "run",
            "create",
            str(cfg),
            "--url",
            f"http://127.0.0.1:{port}",
            "--token",
            "nope",
            env=env,
        )
        assert bad.returncode != 0 and "401" in bad.stderr and "Traceback" not in bad.stderr
    for log in ("api", "env", "policy", "corrector", "trainer", "controller"):
        assert (tmp_path / "data" / "logs" / f"{log}.log").exists()


def test_gtr_up_with_the_envs_in_the_policy_service(
    pg_url: str, redis_url: str, warm_checkpoint: Path, default_model_dir: Path, tmp_path: Path
) -> None:
    """GTR_POLICY_HOSTS_ENVS=true: no env service is started, the env routes answer under the
    policy service's /env, and a run launched as the README says completes through them."""
    env = {
        **os.environ,
        "GTR_DATA_DIR": str(tmp_path / "data"),
        "GTR_MODEL_DIR": str(default_model_dir.parent),
        "GTR_POLICY_HOSTS_ENVS": "true",
    }
    port = free_ports(3)
    cancel_active_runs()
    with _up(port, env, stop=signal.SIGHUP) as up:
        with pytest.raises(AssertionError, match="no env child"):
            _child(up.pid, "env")
        assert httpx.get(f"http://127.0.0.1:{port + 2}/env/healthz").json()["status"] == "ok"
        token = _gtr("token", "create", "up-hosted", env=env).stdout.strip()
        api = ["--url", f"http://127.0.0.1:{port}", "--token", token]
        cfg = tmp_path / "run.toml"
        cfg.write_text(tiny_config(warm_checkpoint, envs=2, steps=2, updates=1, wait="none"))
        created = _gtr("run", "create", str(cfg), *api, env=env)
        assert created.returncode == 0, created.stderr
        run_id = int(created.stdout.strip())
        watched = _gtr("run", "watch", str(run_id), "--interval", "1", *api, env=env, timeout=400)
        assert watched.returncode == 0, watched.stdout + watched.stderr
        assert "completed" in watched.stdout
        c = counts(run_id)
        assert c["steps"] == 4 and c["dup_steps"] == 0, c
        with session_scope() as s:
            (metrics,) = s.scalars(select(Update.metrics).where(Update.run_id == run_id)).all()
        assert metrics["time/stream_wait_s"] > 0  # the policy service's loop stepped them
    assert not (tmp_path / "data" / "logs" / "env.log").exists()
    assert (tmp_path / "data" / "logs" / "policy.log").exists()
