"""The corrector service: any `Corrector` behind `POST /v1/correct`."""

from __future__ import annotations

from fastapi import FastAPI

from services.corrector.base import Corrector
from services.corrector.routes import router
from shared.observe import install as install_metrics


def create_app(corrector: Corrector, backend: str, token: str | None = None) -> FastAPI:
    """`token`, when set, is the bearer token every request must carry."""
    app = FastAPI(
        title="gtr-lab corrector",
        version="0.1.0",
        description="The corrector protocol: docs/corrector-protocol.md",
    )
    app.state.corrector, app.state.backend, app.state.token = corrector, backend, token
    app.include_router(router)
    install_metrics(app, "corrector")
    return app
