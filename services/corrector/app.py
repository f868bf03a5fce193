"""The corrector service: any `Corrector` behind `POST /v1/correct`."""

from __future__ import annotations

from fastapi import FastAPI

from services.corrector.base import Corrector
from services.corrector.routes import router
from shared.observe import install as install_metrics
from shared.service_auth import secure_service
from shared.settings import Settings, get_settings


def create_app(
    corrector: Corrector, backend: str, token: str | None = None, settings: Settings | None = None
) -> FastAPI:
    """`token`, when set, is the bearer token every request must carry; unset, the settings'
    service token (GTR_SERVICE_TOKEN) is, when that is set."""
    settings = settings or get_settings()
    token = token or settings.service_token_value
    app = FastAPI(
        title="gtr-lab corrector",
        version="0.1.0",
        description="The corrector protocol: docs/corrector-protocol.md",
    )
    app.state.corrector, app.state.backend, app.state.token = corrector, backend, token
    app.include_router(router)
    install_metrics(app, "corrector")
    errors = {
        413: "Request body too large",
        422: "Validation error, or a state the task's corrector cannot read",
        429: "The corrector's budget is spent",
        500: "The corrector is misconfigured",
        502: "The upstream model failed or answered malformed",
        503: "The upstream's circuit is open",
    }
    return secure_service(app, token, errors)
