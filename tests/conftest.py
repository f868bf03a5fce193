"""Test fixtures: real PostgreSQL, Redis, uvicorn servers and Celery workers.

A fresh PostgreSQL database is created and migrated for the session; settings point every
component at it (and at a temporary data folder) before anything reads them. When a service is
missing, tests skip with the reason, and fail where GTR_REQUIRE_SERVICES=1 (CI).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

REQUIRE = os.environ.get("GTR_REQUIRE_SERVICES") == "1"
PG_ADMIN = os.environ.get("GTR_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
REDIS_BASE = os.environ.get("GTR_TEST_REDIS", "redis://127.0.0.1:6379")
ROOT = Path(__file__).resolve().parent.parent

_state: dict[str, str | None] = {}


def need(ok: bool, reason: str) -> None:
    """Skip without the thing a test needs, or fail where services are required."""
    if ok:
        return
    if REQUIRE:
        pytest.fail(f"{reason} (required: GTR_REQUIRE_SERVICES=1)")
    pytest.skip(reason)


def _pg_available() -> bool:
    try:
        import psycopg

        with psycopg.connect(PG_ADMIN, connect_timeout=3):
            return True
    except Exception:
        return False


def _redis_available(url: str) -> bool:
    try:
        import redis

        return bool(redis.Redis.from_url(url, socket_timeout=2).ping())
    except Exception:
        return False


def _xdist_controller(config: pytest.Config) -> bool:
    """This process hands tests to pytest-xdist workers and runs none itself."""
    workers = (
        config.getoption("numprocesses", None) if config.pluginmanager.hasplugin("xdist") else None
    )
    return bool(workers) and not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if _xdist_controller(config):
        return  # each worker makes its own database, data folder and Redis index
    data_dir = tempfile.mkdtemp(prefix="gtr-test-data-")
    os.environ["GTR_DATA_DIR"] = data_dir
    os.environ.setdefault("GTR_API_RATE_LIMIT_PER_MINUTE", "0")
    os.environ.setdefault("GTR_AUTH_FAILURES_PER_MINUTE", "0")
    # Explicit allowances the tests need (each refusal is proven in tests/faults/test_security.py
    # and test_hardening.py with its own settings): fake corrector servers on 127.0.0.1, and
    # models and checkpoints the fixtures build under the temporary folder.
    os.environ.setdefault("GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS", "true")
    tmp_root = json.dumps([str(Path(tempfile.gettempdir()).resolve())])
    os.environ.setdefault("GTR_CHECKPOINT_ROOTS", tmp_root)
    os.environ.setdefault("GTR_MODEL_ROOTS", tmp_root)
    # ALFWorld games: made under the temporary folder, or the sample beside the repository.
    sample = Path(os.environ.get("GTR_ALFWORLD_SAMPLE", ROOT.parent / "shared" / "alfworld_sample"))
    games = [str(Path(tempfile.gettempdir()).resolve()), str(sample.resolve().parent)]
    os.environ.setdefault("GTR_GAMES_ROOTS", json.dumps(games))
    # One torch thread per process: tests run several processes on 2 cores (workers, servers).
    os.environ.setdefault("GTR_TORCH_THREADS", "1")
    _state["data_dir"] = data_dir
    if _pg_available():
        import psycopg

        name = f"gtr_test_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
        from shared.db.migrate import upgrade

        upgrade(url)
        os.environ["GTR_DATABASE_URL"] = url
        _state["pg_name"], _state["pg_url"] = name, url
    # A Redis database index of our own keeps concurrent test sessions' queues apart: one per
    # pytest-xdist worker of this session (gw0, gw1 ...; distinct while there are at most 15),
    # the session told apart by the pid of the process that started the workers.
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    session = os.getppid() if "PYTEST_XDIST_WORKER" in os.environ else os.getpid()
    redis_url = f"{REDIS_BASE}/{1 + (worker + workers * session) % 15}"
    if _redis_available(redis_url):
        os.environ["GTR_REDIS_URL"] = redis_url
        _state["redis_url"] = redis_url


def pytest_unconfigure(config: pytest.Config) -> None:
    name = _state.get("pg_name")
    if name:
        try:
            from shared.db.session import get_engine

            get_engine().dispose()
            import psycopg

            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        except Exception:
            pass


@pytest.fixture(scope="session")
def pg_url() -> str:
    """A fresh PostgreSQL database migrated to head (the settings already point at it)."""
    need(_state.get("pg_url") is not None, f"PostgreSQL is not reachable at {PG_ADMIN}")
    return str(_state["pg_url"])


@pytest.fixture(scope="session")
def redis_url() -> str:
    need(_state.get("redis_url") is not None, f"Redis is not reachable at {REDIS_BASE}")
    return str(_state["redis_url"])


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return Path(str(_state["data_dir"]))


@pytest.fixture
def db(pg_url: str) -> Iterator:
    """A session on the test database, rolled back at the end of the test."""
    from shared.db.session import session_factory

    session = session_factory(pg_url)()
    try:
        yield session
    finally:
        session.rollback()
        session.close()


def _shared_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The temporary folder every pytest-xdist worker of this session shares (the session's own
    without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@contextmanager
def _session_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` across the processes of the session (pytest-xdist workers)."""
    import fcntl

    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (1M LLaVA, 64 px, the envs' corpus), built once per session into
    the session's model folder, where every run without ``model.path`` finds it (the warm
    checkpoint, the stacks' policy services). A test with a data folder of its own points
    GTR_MODEL_DIR at ``default_model_dir.parent`` rather than build it again (~7 s of CPU).
    Under pytest-xdist one worker builds it; the other copies that build (``build_tiny`` is
    deterministic) into its own model folder."""
    import shutil

    from services.controller.stack import default_model
    from shared.settings import get_settings

    shared = _shared_dir(tmp_path_factory) / "default-model"
    with _session_lock(shared.with_suffix(".lock")):
        built = sorted(shared.glob("*/config.json"))
        if not built:
            model = default_model()
            shutil.copytree(model, shared / model.name)
            return model
    own = get_settings().models_path / built[0].parent.name
    if not (own / "config.json").exists():
        shutil.copytree(built[0].parent, own, dirs_exist_ok=True)
    model = default_model()
    assert model == own, (model, own)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(default_model_dir: Path) -> Path:
    """The tiny 1M LLaVA every model test uses: the default model, so built once per session
    (``build_tiny(dir, "llava", "1m")`` would build exactly this folder again)."""
    return default_model_dir


@pytest.fixture(scope="session")
def warm_checkpoint(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Path:
    """One short warm start shared by every test run of the session.

    Under pytest-xdist the first worker that needs it builds it (~30 s of CPU, more on a busy
    machine) in the folder the workers share; the other copies it and points it at its own
    default model, which is the same build (``build_tiny`` is deterministic and a full checkpoint
    holds every weight), so each worker gets the checkpoint it would have built itself."""
    import shutil

    from tests.e2e.helpers import make_warm_checkpoint

    shared = _shared_dir(tmp_path_factory) / "warm-shared"
    with _session_lock(shared.with_suffix(".lock")):
        if not (shared / "policy" / "policy.json").exists():
            make_warm_checkpoint(shared)
    meta = json.loads((shared / "policy" / "policy.json").read_text())
    if meta["base_model"] == str(default_model_dir):
        return shared / "policy"
    assert Path(meta["base_model"]).name == default_model_dir.name, meta
    own = tmp_path_factory.mktemp("warm") / "policy"
    shutil.copytree(shared / "policy", own)
    (own / "policy.json").write_text(json.dumps({**meta, "base_model": str(default_model_dir)}))
    return own


# Tracking in the real run feeds tests/e2e/test_observe.py (each tracker read back by its own
# library); the UI tests browse the same run.
REAL_RUN_EXTRA = """eval_episodes = 2
eval_every = 1
[tracking]
tensorboard = true
wandb = true
mlflow = true
mlflow_experiment = "observe-test"
"""


@dataclass
class RealRun:
    """A short run the platform really trained (embedded: envs, policy, trainer, a noisy
    oracle, the three trackers), shared by every test that reads what a run writes: the UI
    pages, the exports, the trackers, the Prometheus counts."""

    run_id: int
    read_token: str
    write_token: str
    corrected_step_ids: list[int]
    episodes: int


@pytest.fixture(scope="session")
def real_run(
    pg_url: str, warm_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> RealRun:
    """Two updates of 4 envs x 4 steps from the session's warm checkpoint, evaluated after each
    update, with the three trackers on (a few seconds): one run for the session, not one per
    module that reads a run."""
    from sqlalchemy import func, select

    from services.api.auth import create_token
    from services.api.service import create_run
    from services.controller.backends import InProcessPolicy, InProcessTrainer, ThreadCorrections
    from services.controller.console import load_config
    from services.controller.service import RunDriver
    from services.env import EnvPool
    from shared.db.models import Correction, Episode
    from shared.db.session import session_scope
    from shared.settings import get_settings
    from tests.e2e.helpers import tiny_config

    cfg_file = tmp_path_factory.mktemp("real-run") / "real.toml"
    cfg_file.write_text(tiny_config(warm_checkpoint, envs=4, steps=4, updates=2) + REAL_RUN_EXTRA)
    cfg = load_config(cfg_file, name="real-tiny-run")
    cfg = cfg.model_copy(update={"corrector": cfg.corrector.model_copy(update={"noise": 0.5})})
    with session_scope() as s:
        run_id = create_run(s, cfg, "real-ui").id
        read = create_token(s, "real-ui-read", "read", "real-ui")[1]
        write = create_token(s, "real-ui-write", "write", "real-ui")[1]
    corrections = ThreadCorrections("oracle", 0.5, 0, get_settings())
    driver = RunDriver(
        run_id, EnvPool(), InProcessPolicy(cfg.model), corrections, InProcessTrainer()
    )
    assert driver.run() == "completed"
    with session_scope() as s:
        corrected = s.scalars(
            select(Correction.step_id)
            .where(Correction.run_id == run_id, Correction.verdict == "incorrect")
            .order_by(Correction.step_id)
        ).all()
        episodes = s.scalar(select(func.count()).where(Episode.run_id == run_id)) or 0
    assert corrected, "a noisy oracle corrects some steps"
    return RealRun(run_id, read, write, list(corrected), int(episodes))


@pytest.fixture(scope="session")
def real_study(pg_url: str, default_model_dir: Path):  # type: ignore[no-untyped-def]
    """A tiny study the platform really ran (2 arms x 2 seeds, hostile names), read by the
    report and study-page tests; like real_run, never written to by a test."""
    from tests.services.study.tiny_study import run_tiny_study

    return run_tiny_study("real-study")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int = 1) -> int:
    """The first of `n` consecutive ports free on 127.0.0.1 (`gtr up` takes port .. port+2).

    Drawn at random below the kernel's ephemeral range: a port the kernel hands out for bind(0)
    is also what it gives the next outgoing connection, so with pytest-xdist workers opening
    connections and servers at once, a port found free that way can be taken again before the
    server binds it; below the range only another draw can take it."""
    low, rng = _ephemeral_low(), random.SystemRandom()
    if low > 10_000 + n:
        for _ in range(500):
            base = rng.randrange(10_000, low - n)
            if all(_bindable(base + i) for i in range(n)):
                return base
    with socket.socket() as s:  # an unusual port range: whatever the kernel gives
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_port() -> int:
    return free_ports(1)


def wait_serving(url: str, proc: subprocess.Popen, timeout_s: float = 90) -> None:  # type: ignore[type-arg]
    """Until ``url``/healthz answers 200; fails if ``proc`` (the server) exits or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, f"{url} did not start"
        time.sleep(0.3)


@contextmanager
def live_server(app, port: int | None = None) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """Serve an ASGI app with a real uvicorn server in a thread; yields its base URL."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@contextmanager
def celery_worker(
    queues: str, *, concurrency: int = 1, extra_env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """A real Celery worker process on the test Redis and database."""
    env = {**os.environ, **(extra_env or {})}
    cmd = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "shared.queues",
        "worker",
        "-Q",
        queues,
        "--pool",
        "prefork" if concurrency > 1 else "solo",
        "--concurrency",
        str(concurrency),
        "--without-heartbeat",
        "--without-gossip",
        "--without-mingle",
        "-l",
        "warning",
        "-n",
        f"test-{uuid.uuid4().hex[:8]}@%h",
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
