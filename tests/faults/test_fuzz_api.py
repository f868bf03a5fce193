"""Property-based fuzzing (schemathesis) of all four OpenAPI documents: the REST API, the env,
policy and corrector services, each on a real uvicorn server. Positive and negative cases of
every operation, a bounded number in all: no 5xx, no traceback, every status documented, every
answer matching its documented schema (422s included: one `detail` shape), and a rejected API
request changes nothing in the database."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import CHECKS as CHECK_REGISTRY
from schemathesis.checks import load_all_checks
from schemathesis.generation import GenerationMode
from sqlalchemy import func, select

from services.api.app import create_app
from services.api.auth import create_token
from services.corrector.app import create_app as corrector_app
from services.corrector.oracle import OracleCorrector
from services.env.app import create_app as env_app
from services.env.service import EnvPool
from services.policy.app import create_app as policy_app
from shared.db.models import Corrector, Run
from shared.db.session import session_scope
from shared.settings import Settings
from tests.conftest import live_server

pytestmark = pytest.mark.slow

TOKEN = "fuzz-service-token-" + "f" * 32
load_all_checks()
CHECKS = CHECK_REGISTRY.get_all()  # the CLI's --checks all
# Examples per document (positive and negative cases together): bounded for CI's two cores.
BUDGET = {"api": 150, "api-anonymous": 30, "env": 40, "policy": 25, "corrector": 25}


def _cases(app: Any, keep: Callable[[str], bool], exclude_delete: bool = False) -> Any:
    spec = app.openapi()
    spec["paths"] = {p: v for p, v in spec["paths"].items() if keep(p)}
    schema = schemathesis.openapi.from_dict(spec)
    if exclude_delete:  # a valid admin token may legitimately delete
        schema = schema.exclude(method="DELETE")
    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    return st.one_of(
        [
            op.ok().as_strategy(generation_mode=m)
            for op in schema.get_all_operations()
            for m in modes
        ]
    )


def _fuzz(name: str, strategy: Any, run_one: Callable[[Any], None]) -> None:
    @given(case=strategy)
    @settings(
        max_examples=BUDGET[name],
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any) -> None:
        run_one(case)

    run()


def _validate(case: Any, response: Any) -> None:
    if not response.headers.get("content-type", [""])[0].startswith("image/"):  # a step's frame
        assert "Traceback" not in response.text
    case.validate_response(response, checks=CHECKS)


# ---- the REST API ------------------------------------------------------------------------------

_api = create_app()


@pytest.fixture(scope="module")
def api(pg_url: str) -> Iterator[dict]:
    with session_scope() as s:
        token = create_token(s, "fuzz", "admin")[1]
    with live_server(create_app()) as url:
        yield {"url": url, "token": token}


def _rows() -> tuple[int, int]:
    with session_scope() as s:
        return (
            s.scalar(select(func.count()).select_from(Run)) or 0,
            s.scalar(select(func.count()).select_from(Corrector)) or 0,
        )


def _api_call(case: Any, url: str, headers: dict[str, str]) -> Any:
    before = _rows()
    response = case.call(base_url=url, headers=headers, timeout=30)
    _validate(case, response)
    if response.status_code >= 400 and case.method.upper() in ("POST", "PATCH", "PUT", "DELETE"):
        assert _rows() == before, (
            f"rejected {case.method} {case.formatted_path} changed the database"
        )
    return response


def test_fuzz_the_api_with_a_valid_token(api: dict) -> None:
    cases = _cases(_api, lambda p: p.startswith("/api/"), exclude_delete=True)
    auth = {"Authorization": f"Bearer {api['token']}"}
    _fuzz("api", cases, lambda case: _api_call(case, api["url"], auth))


def test_fuzz_the_api_without_a_token_is_always_refused(api: dict) -> None:
    def one(case: Any) -> None:
        response = _api_call(case, api["url"], {})
        # 401 for a well-formed request; a malformed one may be refused earlier (404/422).
        assert 400 <= response.status_code < 500, (case.method, case.formatted_path)

    _fuzz("api-anonymous", _cases(_api, lambda p: p.startswith("/api/")), one)


# ---- the internal services ---------------------------------------------------------------------

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _service(name: str, app: Any) -> None:
    with live_server(app) as url:
        cases = _cases(app, lambda p: True)
        _fuzz(
            name,
            cases,
            lambda case: _validate(case, case.call(base_url=url, headers=AUTH, timeout=60)),
        )


def test_fuzz_the_env_service() -> None:
    settings = Settings(service_token=TOKEN)  # type: ignore[arg-type]
    _service("env", env_app(EnvPool(max_sessions=64, max_image_size=256), settings))


def test_fuzz_the_policy_service(tiny_model_dir: Path, tmp_path: Path) -> None:
    from services.policy.service import Policy

    settings = Settings(service_token=TOKEN, checkpoint_dir=tmp_path, checkpoint_roots=[])  # type: ignore[arg-type]
    policy = Policy.load(tiny_model_dir, lora_r=4)
    _service("policy", policy_app(policy, max_batch=4, max_wait_ms=1, settings=settings))


def test_fuzz_the_corrector_service() -> None:
    settings = Settings(service_token=TOKEN)  # type: ignore[arg-type]
    _service("corrector", corrector_app(OracleCorrector(), "oracle", settings=settings))
