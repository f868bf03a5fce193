"""The processes of the fault-injection tests: a private PostgreSQL cluster and Redis server, and
the platform's services, each of which can be killed and started again."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from services.controller.stack import _wait_healthy
from tests.conftest import free_port
from tests.e2e.helpers import ROOT

PG_BIN = next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin"))), "")


# ---- the private PostgreSQL cluster and Redis server ------------------------------------------


def _as_owner() -> list[str]:
    """PostgreSQL refuses to run as root: run its tools as the 'postgres' user there."""
    return ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []


class Postgres:
    def __init__(self, root: Path) -> None:
        self.dir, self.port = root / "pg", free_port()
        self.dir.mkdir()
        if os.geteuid() == 0:
            shutil.chown(root, "postgres")
            shutil.chown(self.dir, "postgres")
        subprocess.run(
            [
                *_as_owner(),
                f"{PG_BIN}/initdb",
                "-D",
                str(self.dir),
                "-U",
                "postgres",
                "-A",
                "trust",
            ],
            check=True,
            capture_output=True,
        )
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/gtr"

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            [
                *_as_owner(),
                f"{PG_BIN}/pg_ctl",
                "-D",
                str(self.dir),
                "-w",
                "-l",
                str(self.dir / "log"),
                "-o",
                f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1",
                *args,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def start(self) -> None:
        self._ctl("start")

    def crash_and_restart(self) -> None:
        self._ctl("stop", "-m", "immediate")  # no shutdown checkpoint: as after a crash
        time.sleep(1.0)
        self.start()

    def stop(self) -> None:
        self._ctl("stop", "-m", "fast")


class Redis:
    def __init__(self, root: Path) -> None:
        self.port, self.log = free_port(), root / "redis.log"
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    "redis-server",
                    "--port",
                    str(self.port),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--bind",
                    "127.0.0.1",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 20
        import redis

        while time.monotonic() < deadline:
            try:
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return
            except redis.RedisError:
                time.sleep(0.1)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ---- the stack -----------------------------------------------------------------------------


class Stack:
    """The platform's processes; any of them can be killed and started again."""

    def __init__(self, root: Path, env: dict[str, str], model: Path) -> None:
        self.root, self.env, self.procs = root, env, {}  # type: dict[str, subprocess.Popen]
        self.ports = {n: free_port() for n in ("api", "env", "policy")}
        self.urls = {n: f"http://127.0.0.1:{p}" for n, p in self.ports.items()}
        self.env.update(
            GTR_ENV_SERVICE_URL=self.urls["env"], GTR_POLICY_SERVICE_URL=self.urls["policy"]
        )
        self.args = {
            "api": ["serve", "--port", str(self.ports["api"])],
            "env": ["env", "serve", "--port", str(self.ports["env"])],
            "policy": [
                "policy",
                "serve",
                "--model",
                str(model),
                "--port",
                str(self.ports["policy"]),
            ],
            "trainer": ["worker", "trainer"],
            "corrector": ["worker", "corrector"],
            "controller": ["controller", "--poll", "0.5", "--stale-after", "6"],
        }

    def start(self, name: str) -> None:
        self._launch(name)
        if name in self.urls:
            _wait_healthy(name, self.urls[name], self.procs[name], timeout_s=180)

    def start_all(self) -> None:
        """Every part at once, then wait for the servers: their start-ups (imports, the policy's
        model) overlap instead of queueing one behind the other."""
        for name in self.args:
            self._launch(name)
        for name, url in self.urls.items():
            _wait_healthy(name, url, self.procs[name], timeout_s=180)

    def _launch(self, name: str) -> None:
        with open(self.root / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "services.cli", *self.args[name]],
                cwd=ROOT,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker's Celery children die with it
            proc.wait()

    def restart(self, name: str) -> None:
        self.kill(name)
        self.start(name)

    def alive(self, name: str) -> bool:
        return name in self.procs and self.procs[name].poll() is None

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.kill(name)

    def tails(self, names: tuple[str, ...] = ()) -> str:
        """The end of each log (of the named parts only, when given), for a failure's message."""
        logs = [self.root / f"{n}.log" for n in names] or sorted(self.root.glob("*.log"))
        return "\n".join(f"--- {p.name}\n{_tail(p.read_text(errors='replace'))}" for p in logs)


def _tail(text: str, size: int = 1500) -> str:
    """The last `size` characters, after the log's error lines: an exception's message comes
    before its SQL and parameters, which alone can fill the tail."""
    errors = [x[:300] for x in text.splitlines() if "Error" in x or "Traceback" in x][-8:]
    return "\n".join([*(f"! {x}" for x in errors), text[-size:]])
