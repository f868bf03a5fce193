"""The web UI: server-rendered pages over the API's service layer, with a little JavaScript
for live curves, keyboard navigation and the corrector registry."""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path as FsPath
from typing import Annotated, Any
from urllib.parse import quote, unquote, urlencode

from fastapi import APIRouter, Depends, Form, HTTPException, Path, Query, Request, status
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError
from sqlalchemy.orm import Session

from services.api import runlist, service
from services.api.auth import COOKIE_NAME, from_our_pages, lookup_token, raw_token
from services.api.deps import get_db
from services.api.diff import readable, word_diff
from services.api.launch import check_launch
from services.controller.correction_stats import failure_reasons, run_totals
from shared.db.models import RUN_STATUSES, TERMINAL_STATUSES, ApiToken, Episode, Run
from shared.schemas import RunConfig

HERE = FsPath(__file__).resolve().parent.parent
STATIC = HERE / "static"
CONFIGS = HERE.parents[1] / "configs"
PAGE_SIZE = 50
COOKIE_MAX_AGE = 7 * 24 * 3600

router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=HERE / "templates")


def thought_line(text: str | None) -> str:
    """A stored thought (the output's JSON minus its action) as one line a person reads:
    'key: value' pairs, JSON escapes decoded (\\ufffd shown as the character it stands for)."""
    return " · ".join(readable(text).splitlines()) if text else "∅"


templates.env.filters["thought_line"] = thought_line
Db = Annotated[Session, Depends(get_db)]
INT32 = 2**31 - 1
RunId = Annotated[int, Path(ge=1, le=INT32)]
EpisodeId = Annotated[int, Path(ge=1, le=INT32)]
StepId = Annotated[int, Path(ge=1, le=2**63 - 1)]
PageNo = Annotated[int, Query(ge=1, le=1_000_000)]


# ---- auth -----------------------------------------------------------------------------------


def page_token(request: Request, db: Db) -> ApiToken:
    """The cookie's token, or a redirect to the login page that comes back here."""
    raw = raw_token(request)
    token = lookup_token(db, raw)
    if token is None:
        # A wrong cookie counts as a failed authentication of this address (middleware.RateLimit)
        request.state.auth_failed = bool(raw)
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise HTTPException(
            status.HTTP_303_SEE_OTHER, headers={"Location": f"/login?next={quote(target)}"}
        )
    return token


User = Annotated[ApiToken, Depends(page_token)]


def _writer(request: Request, token: ApiToken) -> None:
    """Write actions need a write token and a same-origin form (defence beside SameSite)."""
    if token.scope not in ("write", "admin"):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"token '{token.name}' is read-only")
    if not from_our_pages(request):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "cross-origin form rejected")


def _same_origin(request: Request) -> None:
    """Login and logout too: a foreign page must not log a visitor in as another team's token
    (login CSRF) nor out."""
    if not from_our_pages(request):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "cross-origin login or logout rejected")


def _safe_next(target: str | None) -> str:
    """Only local paths: an open redirect would make the login page a phishing tool."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/runs"
    return target


def render(
    request: Request, name: str, token: ApiToken | None, code: int = 200, **ctx: Any
) -> HTMLResponse:
    ctx.update(
        me=token,
        can_write=bool(token and token.scope in ("write", "admin")),
        is_admin=bool(token and token.scope == "admin"),
    )
    return templates.TemplateResponse(request, name, ctx, status_code=code)


@router.get("/login")
def login_page(request: Request, next: str | None = None) -> HTMLResponse:
    """The login form."""
    return render(request, "login.html", None, next=_safe_next(next))


@router.post("/login")
def login(
    request: Request, db: Db, token: Annotated[str, Form()], next: Annotated[str, Form()] = "/runs"
) -> Response:
    """Check the token and keep it in an HttpOnly cookie."""
    _same_origin(request)
    row = lookup_token(db, token.strip())
    if row is None:
        return render(
            request,
            "login.html",
            None,
            401,
            next=_safe_next(next),
            error="Unknown or revoked token.",
        )
    response = RedirectResponse(_safe_next(next), status.HTTP_303_SEE_OTHER)
    response.set_cookie(
        COOKIE_NAME,
        token.strip(),
        max_age=COOKIE_MAX_AGE,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )
    return response


@router.api_route("/logout", methods=["GET", "POST"])
def logout(request: Request) -> RedirectResponse:
    """Forget the token cookie."""
    _same_origin(request)
    response = RedirectResponse("/login", status.HTTP_303_SEE_OTHER)
    response.delete_cookie(COOKIE_NAME, path="/")
    return response


# ---- runs -----------------------------------------------------------------------------------


def _pages(total: int, page: int) -> dict[str, int]:
    last = max(1, math.ceil(total / PAGE_SIZE))
    return {"page": min(page, last), "last": last, "total": total}


def _presets() -> dict[str, str]:
    if not CONFIGS.is_dir():
        return {}
    return {p.name: p.read_text() for p in sorted(CONFIGS.glob("*.toml"))[:100]}


@router.get("/")
def home() -> RedirectResponse:
    """The runs list is the home page."""
    return RedirectResponse("/runs", status.HTTP_303_SEE_OTHER)


@router.get("/runs")
def runs_page(
    request: Request,
    db: Db,
    me: User,
    status: str | None = None,
    study: str | None = None,
    name: Annotated[str | None, Query(max_length=200)] = None,
    page: PageNo = 1,
    clone: Annotated[int | None, Query(ge=1, le=INT32)] = None,
) -> HTMLResponse:
    """The team's runs by recent activity (running first), filtered by status, study and name;
    a study's runs fold into one row. ``clone`` fills the launch form with a run's config."""
    ctx: dict[str, Any] = {}
    if clone is not None:
        try:
            ctx["config_text"] = service.config_toml(service.get_run(db, me, clone), copy=True)
            ctx["open_launch"] = True
        except service.NotFound:
            return not_found_page(request, me, f"run {clone}")
    state, study_id = (status or "").strip() or None, (study or "").strip() or None
    filter_errors = []
    if state is not None and state not in RUN_STATUSES:
        filter_errors.append(f"status: one of {', '.join(RUN_STATUSES)} (blank for all)")
        state = None
    if (
        study_id is not None
        and study_id != runlist.NO_STUDY
        and not re.fullmatch(r"[1-9][0-9]{0,8}", study_id)
    ):
        filter_errors.append("study: a study of the list (blank for all)")
        study_id = None
    filters = {"status": state, "study": study_id, "name": (name or "").strip() or None}
    code = 422 if filter_errors else 200
    return _runs(request, db, me, filters, max(1, page), code, filter_errors=filter_errors, **ctx)


def _runs(
    request: Request,
    db: Session,
    me: ApiToken,
    filters: dict[str, str | None],
    page: int,
    code: int = 200,
    **ctx: Any,
) -> HTMLResponse:
    if ctx.get("filter_errors"):  # no list under a filter the page could not read
        listing = runlist.Listing([], 0, [])
    else:
        listing = runlist.list_runs(
            db, me, filters.get("status"), filters.get("study"), filters.get("name"),
            PAGE_SIZE, (page - 1) * PAGE_SIZE,
        )  # fmt: skip
    runs = [
        (r, _with_eval(db, r.id), service.run_timing(db, r))
        if isinstance(r, Run)
        else (r, None, None)
        for r in listing.rows
    ]
    query = urlencode({k: v for k, v in filters.items() if v})
    return render(
        request,
        "runs.html",
        me,
        code,
        runs=runs,
        status=filters.get("status"),
        filters=filters,
        studies=listing.studies,
        no_study=runlist.NO_STUDY,
        query=query,
        pager=_pages(listing.total, page),
        statuses=RUN_STATUSES,
        presets=_presets(),
        page_size=PAGE_SIZE,
        **ctx,
    )


def _with_eval(db: Session, run_id: int) -> dict[str, Any]:
    """The latest metrics, with the latest evaluation kept between evaluations."""
    latest = service.latest_metrics(db, run_id)
    if latest.get("eval/success_rate") is None and (ev := service.latest_eval(db, run_id)):
        latest["eval/success_rate"] = ev[0]
    return latest


def parse_config(text: str) -> tuple[RunConfig | None, list[str]]:
    """A pasted TOML or JSON run config, or the errors naming each bad field."""
    text = text.strip()
    if not text:
        return None, ["the config is empty: paste a TOML or JSON run config"]
    try:
        data = json.loads(text) if text.startswith("{") else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        return None, [f"not valid {'JSON' if text.startswith('{') else 'TOML'}: {e}"]
    try:
        return RunConfig.model_validate(data), []
    except ValidationError as e:
        return None, [
            f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors()
        ]


@router.post("/runs/new")
def launch(
    request: Request, db: Db, me: User, config: Annotated[str, Form(max_length=200_000)]
) -> Response:
    """Launch a run from a pasted or uploaded config."""
    _writer(request, me)
    parsed, errors = parse_config(config)
    if parsed is None:
        return _runs(request, db, me, {}, 1, 422, errors=errors, config_text=config)
    try:
        run = service.create_run(db, check_launch(db, parsed, me.team), me.team)
    except service.Invalid as e:
        return _runs(request, db, me, {}, 1, 422, errors=[str(e)], config_text=config)
    db.commit()
    return RedirectResponse(f"/runs/{run.id}", status.HTTP_303_SEE_OTHER)


FLASH_COOKIE = "gtr_flash"


def back_to_run(run_id: int, flash: str | None = None) -> RedirectResponse:
    """To the run's page. What the page shows comes from the run's state (cancel pending, queued
    again); a message the state does not hold (a refusal) is shown once, from a short cookie,
    never from the URL, where a reload or a shared link would show it again."""
    response = RedirectResponse(f"/runs/{run_id}", status.HTTP_303_SEE_OTHER)
    if flash:
        response.set_cookie(
            FLASH_COOKIE,
            quote(flash[:300]),
            max_age=60,
            httponly=True,
            samesite="strict",
            path=f"/runs/{run_id}",
        )
    return response


@router.post("/runs/{run_id}/cancel")
def cancel(request: Request, run_id: RunId, db: Db, me: User) -> Response:
    """Ask a run to stop."""
    _writer(request, me)
    try:
        service.cancel_run(db, me, run_id)
        db.commit()
    except service.Conflict as e:
        return back_to_run(run_id, str(e))
    except service.NotFound:
        return not_found_page(request, me, f"run {run_id}")
    return back_to_run(run_id)


def bad_query_page(request: Request, db: Session, errors: list[str]) -> Response:
    """A UI page asked with a value its query cannot hold (?page=abc, ?runs=x): the page's
    answer is HTML naming the value, not the API's JSON 422 (the step search and the episodes
    page show it in their own form)."""
    token = lookup_token(db, raw_token(request))
    if token is None:  # the login page first, as for any page
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        return RedirectResponse(f"/login?next={quote(target)}", status.HTTP_303_SEE_OTHER)
    message = "This page cannot read its address: " + "; ".join(errors) + "."
    return render(request, "error.html", token, 422, message=message, title="Bad request")


def not_found_page(request: Request, me: ApiToken, what: str) -> HTMLResponse:
    """The 404 page for something absent or not visible to the user's team."""
    return render(
        request,
        "error.html",
        me,
        404,
        message=f"No {what} here (or not visible to team '{me.team}').",
    )


@router.get("/runs/{run_id}")
def run_page(request: Request, run_id: RunId, db: Db, me: User) -> HTMLResponse:
    """One run: curves, collapse monitors, config and checkpoints."""
    try:
        run = service.get_run(db, me, run_id)
    except service.NotFound:
        return not_found_page(request, me, f"run {run_id}")
    latest = service.latest_metrics(db, run.id)
    flash = unquote(request.cookies.get(FLASH_COOKIE, ""))[:300] or None
    page = render(
        request,
        "run.html",
        me,
        failure_reasons=failure_reasons(db, run.id) if latest.get("corrections_alarm") else [],
        run=run,
        latest=latest,
        last_eval=service.latest_eval(db, run.id),
        timing=service.run_timing(db, run),
        all_failed=latest.get("corrections", 0) > 0
        and latest.get("corrections_failed") == latest.get("corrections"),
        checkpoints=service.list_checkpoints(db, run),
        flash=flash,
        terminal=run.status in TERMINAL_STATUSES,
        config_toml=service.config_toml(run),
        cost=service.corrector_cost(db, run.id) if service.sends_to_corrector(run) else None,
        coverage=run_totals(db, run.id) if latest.get("corrections") else None,
    )
    if flash:  # shown once
        page.delete_cookie(FLASH_COOKIE, path=f"/runs/{run_id}")
    return page


@router.post("/runs/{run_id}/resume")
def resume(request: Request, run_id: RunId, db: Db, me: User) -> Response:
    """Queue a failed or cancelled run again; it resumes after its last trained update."""
    _writer(request, me)
    try:
        service.resume_run(db, me, run_id)
        db.commit()
    except (service.Conflict, service.Invalid) as e:
        return back_to_run(run_id, str(e))
    except service.NotFound:
        return not_found_page(request, me, f"run {run_id}")
    return back_to_run(run_id)


COMPARE_MAX = 64  # a study cell's runs: both arms of a comparison over every seed


@router.get("/compare")
def compare_page(
    request: Request,
    db: Db,
    me: User,
    runs: Annotated[list[int] | None, Query(max_length=COMPARE_MAX)] = None,
) -> HTMLResponse:
    """Overlay the curves of runs (e.g. GTR against RL4VLM, or every run behind a study's
    cell): all of those asked for, up to COMPARE_MAX."""
    shown, missing = [], []
    for run_id in dict.fromkeys(runs or []):
        try:
            run = service.get_run(db, me, run_id) if 1 <= run_id <= INT32 else None
        except service.NotFound:
            run = None
        if run is None:
            missing.append(str(run_id))
        else:
            shown.append((run, service.latest_metrics(db, run.id)))
    return render(
        request,
        "compare.html",
        me,
        runs=shown,
        missing=missing,
        runs_json=[{"id": r.id, "name": r.name} for r, _ in shown],
    )


# ---- trace browser --------------------------------------------------------------------------


def _tristate(value: str | None) -> bool | None:
    return {"true": True, "false": False}.get((value or "").lower())


UPDATE_ERROR = "update: a whole number from 0 (updates are numbered as on the charts)"


@router.get("/runs/{run_id}/episodes")
def episodes_page(
    request: Request,
    run_id: RunId,
    db: Db,
    me: User,
    update: str | None = None,
    success: str | None = None,
    corrected: str | None = None,
    page: PageNo = 1,
) -> HTMLResponse:
    """Episodes of a run, filtered by update, success and correction."""
    try:
        run = service.get_run(db, me, run_id)
    except service.NotFound:
        return not_found_page(request, me, f"run {run_id}")
    upd = int(update) if update and re.fullmatch(r"[0-9]{1,9}", update.strip()) else None
    errors = [] if upd is not None or not (update or "").strip() else [UPDATE_ERROR]
    ok, corr = _tristate(success), _tristate(corrected)
    # One rule for every page's filters, as the step search: a value the form cannot hold is
    # named in the form (422), never silently dropped.
    for name, raw, got in (("success", success, ok), ("corrected", corrected, corr)):
        if got is None and (raw or "").strip():
            errors.append(f"{name}: true or false (blank for any)")
    filters = {"update": upd, "success": ok, "corrected": corr}
    page = max(1, page)
    # Newest first, as the runs list: the pager's "Older →" then opens older episodes.
    offset = (page - 1) * PAGE_SIZE
    rows, total = service.list_episodes(db, run, upd, ok, corr, PAGE_SIZE, offset, True)
    if errors:  # no list under a filter the page could not read
        rows, total = [], 0
    query = {k: str(v).lower() for k, v in filters.items() if v is not None}
    return render(
        request,
        "episodes.html",
        me,
        422 if errors else 200,
        errors=errors,
        run=run,
        episodes=rows,
        filters=filters,
        pager=_pages(total, page),
        query=urlencode(query),
    )


@router.get("/runs/{run_id}/episodes/{episode_id}")
def episode_page(
    request: Request, run_id: RunId, episode_id: EpisodeId, db: Db, me: User
) -> Response:
    """An episode opens at its first step; one of another run than the URL's is a 404."""
    try:
        episode = service.get_episode(db, me, episode_id)
        if episode.run_id != run_id:
            raise service.NotFound(f"episode {episode_id}")
        steps = service.list_steps(db, episode)
    except service.NotFound:
        return not_found_page(request, me, f"episode {episode_id}")
    if not steps:
        return _stepless(request, me, service.get_episode(db, me, episode_id))
    return RedirectResponse(f"/runs/{run_id}/steps/{steps[0][0].id}", status.HTTP_303_SEE_OTHER)


# A verdict in the words of the step search's filter, on the step's header and its card alike.
VERDICT_WORDS = {"incorrect": "corrected", "correct": "correct"}


def _stepless(request: Request, me: ApiToken, episode: Episode) -> HTMLResponse:
    """An episode without a step: one still waiting for its first (404: nothing to show yet),
    or one the run's end cut off before it took any (a fact about the run: shown, not 404)."""
    if not episode.finished:
        return render(
            request, "error.html", me, 404, message=f"Episode {episode.id} has no steps yet."
        )
    return render(
        request,
        "error.html",
        me,
        message=f"Episode {episode.id} was cut off before its first step: the run ended (or was "
        "interrupted) just after the env began it, so it has nothing to show.",
        title="No steps",
        back=f"/runs/{episode.run_id}/episodes",
    )


@router.get("/runs/{run_id}/steps/{step_id}")
def step_page(request: Request, run_id: RunId, step_id: StepId, db: Db, me: User) -> Response:
    """One step: image, prompt, thought vs corrected thought, verdict, action, reward, value."""
    try:
        step, corrections, nav = service.get_step(db, me, step_id)
    except service.NotFound:
        return not_found_page(request, me, f"step {step_id}")
    if step.run_id != run_id:  # a step of another run than the URL's: the same 404
        return not_found_page(request, me, f"step {step_id}")
    episode = service.get_episode(db, me, step.episode_id)
    diffs = {
        c.id: word_diff(step.thought or "", c.corrected_thought)
        for c in corrections
        if c.corrected_thought
    }
    return render(
        request,
        "step.html",
        me,
        run=service.get_run(db, me, run_id),
        step=step,
        episode=episode,
        corrections=corrections,
        nav=nav,
        diffs=diffs,
        timeline=service.list_steps(db, episode),
        state_json=json.dumps(step.state, indent=1, sort_keys=True),
        verdict_words=VERDICT_WORDS,
    )


# ---- correctors and static files ------------------------------------------------------------


@router.get("/docs")
def api_docs(request: Request) -> HTMLResponse:
    """The API reference: Swagger UI from vendored files, under the same CSP as every page."""
    return templates.TemplateResponse(request, "docs.html", {})


@router.get("/correctors")
def correctors_page(request: Request, db: Db, me: User) -> HTMLResponse:
    """The built-in oracle and the registered correctors: register, test, latency and failure
    rate (the oracle's over the team's runs; admin tokens: over every team's)."""
    from services.corrector.registry import corrector_stats
    from services.corrector.service import ORACLE

    team = None if me.scope == "admin" else me.team
    return render(request, "correctors.html", me, oracle=corrector_stats(db, ORACLE, team))


@router.get("/static/{path:path}")
def static(path: str) -> FileResponse:
    """Vendored JS/CSS; nothing is fetched from a CDN."""
    target = (STATIC / path).resolve()
    if STATIC not in target.parents or not target.is_file():
        raise HTTPException(status.HTTP_404_NOT_FOUND, "no such file")
    return FileResponse(target, headers={"Cache-Control": "public, max-age=3600"})
