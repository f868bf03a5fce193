"""The full stack as separate processes, started once for every end-to-end module that needs it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from services.api.auth import create_token
from shared.db.session import session_scope
from tests.conftest import free_port
from tests.e2e.helpers import process


@pytest.fixture(scope="session")
def full_stack(
    pg_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict]:
    """API, env and policy services, a trainer worker and a controller, on the test database.

    Corrector workers are left to the tests (some kill theirs). The policy service starts on the
    default tiny model and follows each run's checkpoints to that run's own base model.
    """
    from services.controller.stack import _wait_healthy, default_model

    logs = tmp_path_factory.mktemp("stack-logs")
    model = default_model()
    port = free_port()
    urls = {
        "api": f"http://127.0.0.1:{port}",
        "env": f"http://127.0.0.1:{free_port()}",
        "policy": f"http://127.0.0.1:{free_port()}",
    }
    env = {"GTR_ENV_SERVICE_URL": urls["env"], "GTR_POLICY_SERVICE_URL": urls["policy"]}
    env_port, policy_port = urls["env"].rsplit(":", 1)[1], urls["policy"].rsplit(":", 1)[1]
    with ExitStack() as stack:
        procs = {
            "api": stack.enter_context(
                process(["serve", "--port", str(port)], logs / "api.log", env)
            ),
            "env": stack.enter_context(
                process(["env", "serve", "--port", env_port], logs / "env.log", env)
            ),
            "policy": stack.enter_context(
                process(
                    ["policy", "serve", "--model", str(model), "--port", policy_port],
                    logs / "policy.log",
                    env,
                )
            ),
            "trainer": stack.enter_context(
                process(["worker", "trainer"], logs / "trainer.log", env)
            ),
            "controller": stack.enter_context(
                process(["controller", "--poll", "0.5"], logs / "controller.log", env)
            ),
        }
        for name in ("api", "env", "policy"):
            _wait_healthy(name, urls[name], procs[name])
        with session_scope() as s:
            token = create_token(s, "e2e")[1]
        yield {
            "urls": urls,
            "procs": procs,
            "env": env,
            "logs": logs,
            "token": token,
            "headers": {"Authorization": f"Bearer {token}"},
        }
