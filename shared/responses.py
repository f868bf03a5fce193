"""A route's response model sent as JSON as it is, past FastAPI's second look at it.

FastAPI checks a returned model against the route's ``response_model``: it dumps it, validates
the dump and encodes it again, which for a batch of generations (per-token lists) or of env
steps (frames, states) costs more than the rest of the response: 5.7 against 1.8 ms a request
for 16 generations of 64 tokens (bench/response_bench.py, docs/benchmarks.md). The route keeps
``response_model`` for its OpenAPI schema and returns ``model_response(body)``; ``body`` was
validated when it was built.
"""

from __future__ import annotations

from fastapi import Response
from pydantic import BaseModel


def model_response(body: BaseModel) -> Response:
    """`body` as an application/json response."""
    return Response(body.model_dump_json(), media_type="application/json")
