"""``GET /api/runs/{id}/export``: a run's steps as a dataset, streamed (jsonl) or as a file."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse, StreamingResponse
from starlette.background import BackgroundTask

from services.api import service
from services.api.routes.runs import Db, Reader, RunId
from services.controller.export import ExportFilter, jsonl_lines, records, write_parquet

router = APIRouter(prefix="/api", tags=["export"])


@router.get(
    "/runs/{run_id}/export",
    response_model=None,
    responses={
        200: {
            "description": "JSON lines (format=jsonl) or a Parquet file (format=parquet)",
            "content": {"application/x-ndjson": {}, "application/vnd.apache.parquet": {}},
        }
    },
)
def export_run(
    run_id: RunId,
    db: Db,
    token: Reader,
    format: Literal["jsonl", "parquet"] = "jsonl",
    corrected: bool | None = None,
    verdict: Literal["correct", "incorrect"] | None = None,
    update_from: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    update_to: Annotated[int | None, Query(ge=0, le=2**31 - 1)] = None,
    format_valid: bool | None = None,
    limit: Annotated[int | None, Query(ge=1, le=10_000_000)] = None,
) -> StreamingResponse | FileResponse:
    """The run's steps with frame (PNG), prompt, output, corrected thought, verdict and reward;
    ``corrected=true`` keeps the steps the corrector disagreed with (the SFT data)."""
    service.get_run(db, token, run_id)  # 404 for a run this token's team cannot see
    f = ExportFilter(corrected, verdict, update_from, update_to, format_valid, limit)
    name = f"run-{run_id}-steps.{format}"
    if format == "jsonl":
        return StreamingResponse(
            _stream(run_id, f),
            media_type="application/x-ndjson",
            headers={"Content-Disposition": f'attachment; filename="{name}"'},
        )
    # Parquet's footer comes last: build the file, send it, delete it.
    tmp = Path(tempfile.mkstemp(suffix=".parquet", prefix="gtr-export-")[1])
    write_parquet(records(run_id, f), tmp)
    return FileResponse(
        tmp,
        media_type="application/vnd.apache.parquet",
        filename=name,
        background=BackgroundTask(tmp.unlink, missing_ok=True),
    )


def _stream(run_id: int, f: ExportFilter) -> Iterator[bytes]:
    # Its own sessions, page by page: the request's session is closed before streaming starts.
    yield from jsonl_lines(records(run_id, f))
