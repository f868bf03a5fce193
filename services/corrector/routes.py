"""`POST /v1/correct` and `GET /healthz`: our corrector behind the public protocol."""

from __future__ import annotations

import hmac

from fastapi import APIRouter, HTTPException, Request

from services.corrector.base import CorrectorError
from shared import observe
from shared.schemas import Correction, CorrectionRequest
from shared.service_auth import excerpt

router = APIRouter()

# How each failure kind answers over HTTP; 5xx and 429 tell clients to retry. An unusable model
# answer is 422, not 502: asking the same model again would only multiply the calls.
STATUS = {
    "input": 422,
    "malformed": 422,
    "config": 500,
    "budget": 429,
    "circuit_open": 503,
    "transport": 502,
}


def _authorize(request: Request) -> None:
    expected: str | None = request.app.state.token
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    given = header[7:].strip() if header.lower().startswith("bearer ") else ""
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise HTTPException(
            401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
        )


@router.post("/v1/correct", response_model=Correction)
def correct(req: CorrectionRequest, request: Request) -> Correction:
    """Evaluate the agent's thought and, when wrong, return a corrected one."""
    _authorize(request)
    backend = request.app.state.backend
    try:
        with observe.CORRECTION_LATENCY.labels(backend).time():
            out: Correction = request.app.state.corrector.correct(req)
        observe.CORRECTIONS.labels(backend, out.verdict).inc()
        observe.CORRECTION_TOKENS.labels(backend).inc(out.tokens)
        return out
    except CorrectorError as e:
        observe.CORRECTIONS.labels(backend, f"error:{e.kind}").inc()
        detail = {
            "kind": e.kind,
            "reason": excerpt(e.reason),
            "raw": (e.raw or "")[:20_000] or None,  # the model's answer, for the caller to audit
        }
        raise HTTPException(STATUS.get(e.kind, 502), detail) from e
    except (KeyError, IndexError, TypeError, ValueError) as e:
        # The oracle reads the privileged state: one lacking the task's keys is the caller's.
        raise HTTPException(
            422,
            {"kind": "input", "reason": excerpt(f"the state lacks what {req.task} needs: {e!r}")},
        ) from e


@router.get("/healthz")
def healthz(request: Request) -> dict[str, str]:
    """Liveness, and which backend answers."""
    return {"status": "ok", "backend": request.app.state.backend}
