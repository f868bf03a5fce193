"""Every router of the API, in mount order."""

from __future__ import annotations

import importlib

from fastapi import APIRouter

# Routers owned by other parts load if present, so the API starts while they are built.
_MODULES = ["health", "runs", "correctors", "ui", "export", "search", "studies", "ui_studies"]


def routers() -> list[APIRouter]:
    out = []
    for name in _MODULES:
        try:
            module = importlib.import_module(f"services.api.routes.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"services.api.routes.{name}":
                raise
            continue
        out.append(module.router)
    return out
