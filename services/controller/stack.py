"""``gtr up``: the whole platform as separate processes on one machine, logs in data_dir/logs.

A part that exits is restarted with a growing delay; one that keeps exiting stops the stack.
Ctrl-C, SIGTERM (a service manager, ``kill``) and SIGHUP (the terminal closed) stop every part.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import click
import httpx

from shared.settings import HOSTED_ENVS, Settings, get_settings


def default_model() -> Path:
    """The tiny model every tiny config uses (built once into the model folder)."""
    from services.trainer.warmstart import base_model_path
    from shared.schemas import ModelConfig

    return base_model_path(ModelConfig())


def _wait_healthy(name: str, url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise click.ClickException(f"{name} exited with code {proc.returncode}; see its log")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise click.ClickException(f"{name} did not answer {url}/healthz within {timeout_s:.0f} s")


@dataclass(frozen=True)
class RestartPolicy:
    """Restart a part that exits, as compose's `restart: always` and Kubernetes do, with a
    doubling delay; a part that exits `max_restarts` times within `window_s` stops the stack
    (a crash loop is a bug to read in the logs, not to hide)."""

    max_restarts: int = 5  # 0: the first exit stops the stack
    window_s: float = 300.0
    backoff_base_s: float = 1.0
    backoff_max_s: float = 30.0

    def delay(self, recent_exits: int) -> float:
        return min(self.backoff_base_s * 2 ** max(recent_exits - 1, 0), self.backoff_max_s)


@dataclass
class Part:
    name: str
    cmd: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    exits: deque[float] = field(default_factory=deque)  # monotonic times, within the window
    restart_at: float | None = None  # set while the part waits out its backoff


class Supervisor:
    """Starts the parts, restarts those that exit, and stops the stack on a crash loop."""

    def __init__(
        self,
        commands: dict[str, list[str]],
        env: dict[str, str],
        logs: Path,
        policy: RestartPolicy | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.env = env
        self.policy = policy or RestartPolicy()
        self.echo = echo or (lambda msg: click.echo(msg, err=True))
        self.parts = {n: Part(n, cmd, logs / f"{n}.log") for n, cmd in commands.items()}

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return {n: p.proc for n, p in self.parts.items() if p.proc is not None}

    def start(self) -> None:
        for part in self.parts.values():
            self._launch(part)

    def _launch(self, part: Part) -> None:
        with open(part.log, "ab") as log:  # the child keeps its own copy of the descriptor
            part.proc = subprocess.Popen(
                part.cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        part.restart_at = None

    def check(self) -> None:
        """One pass: schedule the restart of parts that exited, launch those whose delay is over;
        raises ClickException when a part exited too often."""
        now = time.monotonic()
        for part in self.parts.values():
            if part.restart_at is not None:
                if now >= part.restart_at:
                    self._launch(part)
                    assert part.proc is not None
                    self._say(part, f"restarted (pid {part.proc.pid})")
                continue
            code = part.proc.poll() if part.proc is not None else None
            if code is None:
                continue
            part.exits.append(now)
            while part.exits and now - part.exits[0] > self.policy.window_s:
                part.exits.popleft()
            n = len(part.exits)
            if n > self.policy.max_restarts:
                why = (
                    f"exited {n} times within {self.policy.window_s:g} s (last exit code {code})"
                    if self.policy.max_restarts
                    else f"exited with code {code} (restarts are off)"
                )
                raise click.ClickException(f"{part.name} {why}; stopping the stack; see {part.log}")
            delay = self.policy.delay(n)
            part.restart_at = now + delay
            self._say(
                part,
                f"exited with code {code}; restarting in {delay:g} s "
                f"(restart {n} of {self.policy.max_restarts} "
                f"allowed within {self.policy.window_s:g} s)",
            )

    def _say(self, part: Part, what: str) -> None:
        line = f"{datetime.now():%Y-%m-%d %H:%M:%S} gtr up: {part.name} {what}"
        self.echo(line)
        with open(part.log, "a") as log:  # the part's own log shows where it was restarted
            log.write(line + "\n")

    def watch(self, poll_s: float = 0.5) -> None:
        """Supervises until a part exits too often (ClickException) or Ctrl-C."""
        while True:
            self.check()
            time.sleep(poll_s)

    def stop(self) -> None:
        stop_all(list(self.procs.values()))


def stack_env(urls: dict[str, str], settings: Settings) -> dict[str, str]:
    """The environment of every part: service URLs, and the service token the env and policy
    services require (a fresh one per `gtr up` unless the operator set GTR_SERVICE_TOKEN)."""
    return {
        **os.environ,
        "GTR_ENV_SERVICE_URL": urls["env"],
        "GTR_POLICY_SERVICE_URL": urls["policy"],
        "GTR_SERVICE_TOKEN": settings.service_token_value or secrets.token_urlsafe(32),
    }


def stack_urls(port: int, policy_hosts_envs: bool = False) -> dict[str, str]:
    """The env and policy services' URLs of a stack on ``port``; the env service's routes are
    the policy service's ``/env`` where it hosts the envs (GTR_POLICY_HOSTS_ENVS)."""
    policy = f"http://127.0.0.1:{port + 2}"
    env = f"{policy}{HOSTED_ENVS}" if policy_hosts_envs else f"http://127.0.0.1:{port + 1}"
    return {"env": env, "policy": policy}


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class StopSignal(Exception):
    """SIGTERM or SIGHUP asked ``gtr up`` to stop: its parts must go with it (their default
    action would end ``gtr up`` alone and leave them running under PID 1, ports bound)."""


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP raise StopSignal in the main thread."""

    def handler(signum: int, _frame: object) -> None:
        raise StopSignal(signal.Signals(signum).name)

    for s in STOP_SIGNALS:
        signal.signal(s, handler)


def ignore_signals() -> None:
    """While the parts stop, a second signal (or Ctrl-C) must not interrupt that half-way.
    An ignored disposition is inherited across exec, so no part is launched after this."""
    for s in (*STOP_SIGNALS, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)


def run_stack(port: int, model: Path | None, policy: RestartPolicy | None = None) -> None:
    settings = get_settings()
    if not settings.database_url or not settings.redis_url:
        raise click.ClickException(
            "gtr up runs against PostgreSQL and Redis: set GTR_DATABASE_URL "
            "(postgresql+psycopg://USER@HOST/DB) and GTR_REDIS_URL (redis://HOST:6379/0)"
        )
    from shared.db.migrate import upgrade

    upgrade()
    model = model or default_model()
    logs = settings.data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    urls = stack_urls(port, settings.policy_hosts_envs)
    env = stack_env(urls, settings)
    gtr = [sys.executable, "-m", "services.cli"]
    commands = {
        "api": [*gtr, "serve", "--port", str(port)],
        "env": [*gtr, "env", "serve", "--port", str(port + 1)],
        "policy": [*gtr, "policy", "serve", "--model", str(model), "--port", str(port + 2)],
        "corrector": [*gtr, "worker", "corrector"],
        "trainer": [*gtr, "worker", "trainer"],
        "controller": [*gtr, "controller"],
    }
    if settings.policy_hosts_envs:  # the policy service serves the envs: no env service
        del commands["env"]
    stack = Supervisor(commands, env, logs, policy)

    def ready() -> None:
        # A part that cannot even start (port taken, bad model) fails here rather than loop.
        _wait_healthy("api", f"http://127.0.0.1:{port}", stack.procs["api"])
        _wait_healthy("policy service", urls["policy"], stack.procs["policy"])
        env_proc = stack.procs.get("env", stack.procs["policy"])
        _wait_healthy("env service", urls["env"], env_proc)
        click.echo(f"gtr-lab is up: API and UI on http://127.0.0.1:{port}  (logs in {logs})")
        click.echo(
            "launch a run: gtr run create configs/numberline-tiny.toml"
            "  (GTR_TOKEN from 'gtr token create me')"
        )

    supervise(stack, ready)


def supervise(stack: Supervisor, ready: Callable[[], None]) -> None:
    """Start the parts, wait until ``ready`` returns, and supervise them until Ctrl-C, SIGTERM,
    SIGHUP or a crash loop; every part is stopped on the way out, whichever it was."""
    stop_on_signals()
    try:
        stack.start()
        ready()
        stack.watch()
    except KeyboardInterrupt:
        click.echo("stopping")
    except StopSignal as e:
        click.echo(f"stopping ({e})")
    finally:
        ignore_signals()
        stack.stop()


def stop_all(procs: list[subprocess.Popen], grace_s: float = 15) -> None:
    """SIGTERM everything at once, then SIGKILL whatever outlives one shared grace period."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
