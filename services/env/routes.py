"""REST routes of the env service: a thin adapter over ``EnvPool``."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from services.env.schemas import (
    FRAMES_HEADER,
    BatchStepRequest,
    BatchStepResponse,
    CreateEnvRequest,
    CreateEnvResponse,
    ObservationOut,
    ResetRequest,
    SessionOut,
    StepOut,
    StepRequest,
    TargetFormulaRequest,
    action_as_output,
)
from services.env.service import EnvError, EnvPool
from shared import observe
from shared.responses import model_response

router = APIRouter()


def _pool(request: Request) -> EnvPool:
    return request.app.state.pool


def _raw(request: Request) -> bool:
    """The client asked for raw frames (``X-GTR-Frames: raw``) instead of PNG."""
    return request.headers.get(FRAMES_HEADER, "").lower() == "raw"


def _output(pool: EnvPool, session_id: str, req: StepRequest) -> str:
    if req.output is not None:
        return req.output
    names = pool.describe(session_id)["action_names"]
    action = req.action or ""
    if action not in names:
        raise EnvError(f"illegal action {action!r}; legal: {', '.join(names)}")
    return action_as_output(action)


@router.get("/healthz")
def healthz(request: Request) -> dict[str, object]:
    """Liveness, with the number of open sessions and the pool's id."""
    pool = _pool(request)
    return {"status": "ok", "sessions": len(pool), "pool": pool.pool_id}


@router.post("/envs", status_code=201, response_model=CreateEnvResponse)
def create_env(req: CreateEnvRequest, request: Request) -> CreateEnvResponse:
    """Open a session and start its first episode."""
    pool = _pool(request)
    sid = pool.create(req.task, req.config, req.seed)
    obs = pool.reset(sid)
    names = pool.describe(sid)["action_names"]
    return CreateEnvResponse(
        id=sid, task=req.task, action_names=names, observation=ObservationOut.of(obs, _raw(request))
    )


@router.get("/envs/{session_id}", response_model=SessionOut)
def get_env(session_id: str, request: Request) -> SessionOut:
    """Task, seed, config and episode count of a session."""
    return SessionOut(id=session_id, **_pool(request).describe(session_id))


@router.post("/envs/{session_id}/reset", response_model=ObservationOut)
def reset_env(session_id: str, request: Request, req: ResetRequest | None = None) -> ObservationOut:
    """Start a new episode (options may fix the deal)."""
    options = req.options if req is not None else None
    return ObservationOut.of(_pool(request).reset(session_id, options), _raw(request))


@router.post("/envs/{session_id}/step", response_model=StepOut)
def step_env(session_id: str, req: StepRequest, request: Request) -> StepOut:
    """Step with the agent's output (or a legal action name); auto-resets when done."""
    pool = _pool(request)
    observe.ENV_STEPS.inc()
    return StepOut.of(pool.step(session_id, _output(pool, session_id, req)), _raw(request))


@router.post("/envs/step", response_model=BatchStepResponse)
def step_batch(req: BatchStepRequest, request: Request) -> Response:
    """Step many sessions at once."""
    pool = _pool(request)
    items = [(item.id, _output(pool, item.id, item)) for item in req.steps]
    observe.ENV_STEPS.inc(len(items))
    observe.ENV_BATCH.observe(len(items))
    raw = _raw(request)
    # sent as it is (shared/responses.py): one rollout step's frames and states, for every env
    results = [StepOut.of(r, raw) for r in pool.step_batch(items)]
    return model_response(BatchStepResponse(results=results))


@router.put("/envs/{session_id}/target_formula", status_code=204)
def set_target_formula(session_id: str, req: TargetFormulaRequest, request: Request) -> Response:
    """Points games: remember the corrector's target formula for this episode."""
    _pool(request).set_target_formula(session_id, req.formula)
    return Response(status_code=204)


@router.delete("/envs/{session_id}", status_code=204)
def close_env(session_id: str, request: Request) -> Response:
    """Close a session."""
    _pool(request).close(session_id)
    return Response(status_code=204)
