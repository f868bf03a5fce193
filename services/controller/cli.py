"""``gtr train``, ``gtr up``, ``gtr controller``, ``gtr worker`` and ``gtr run``."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from services.controller.console import (
    load_config,
    print_summary,
    progress_printer,
    success_cell,
    update_done,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


@click.command()
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--name", help="Override the run's name.")
@click.option("--updates", type=click.IntRange(1, 100_000), help="Override train.num_updates.")
@click.option("--seed", type=click.IntRange(0, 2**31 - 1), help="Override the seed.")
def train(config: Path, name: str | None, updates: int | None, seed: int | None) -> None:
    """Train a run in this process (embedded: SQLite and ./gtr-data unless settings say else)."""
    cfg = load_config(config, name=name, updates=updates, seed=seed)
    from services.controller.preflight import PreflightError, preflight

    try:  # before the run row exists: a bad path is one line, not a failed run
        preflight(cfg)
    except PreflightError as e:
        raise click.ClickException(str(e)) from None
    from services.controller.launch import Invalid, create_run
    from services.controller.loop import drive
    from shared.db.migrate import ensure_schema
    from shared.db.session import session_scope
    from shared.logs import json_logs, setup_logging
    from shared.settings import get_settings

    settings = get_settings()
    if json_logs():  # else the progress lines and the summary are the output
        setup_logging()
    if settings.database_url is None:
        ensure_schema()
    try:
        with session_scope() as s:
            run_id = create_run(s, cfg, team="default").id
    except Invalid as e:
        raise click.BadParameter(str(e), param_hint="CONFIG") from None
    click.echo(
        f"run {run_id}: {cfg.name} ({cfg.task}, {cfg.algorithm}), {cfg.total_env_steps} env steps"
    )
    started = time.monotonic()
    with progress_printer(cfg) as on_progress:
        status = drive(run_id, settings, on_progress=on_progress)
    print_summary(run_id, time.monotonic() - started)
    if status != "completed":
        sys.exit(1)


def controller_command(each_poll: Callable[[Session], object] | None = None) -> click.Command:
    """``gtr controller``; ``each_poll`` runs in a transaction before each claim (the layer above
    passes the studies' scheduler: services/study/cli.py)."""

    @click.command("controller")
    @click.option(
        "--poll",
        default=2.0,
        show_default=True,
        type=click.FloatRange(0.1, 60),
        help="Seconds between polls.",
    )
    @click.option(
        "--stale-after",
        default=60.0,
        show_default=True,
        type=click.FloatRange(5, 3600),
        help="Resume a running run whose heartbeat is older than this.",
    )
    def controller(poll: float, stale_after: float) -> None:
        """Drive queued runs (and resume orphaned ones) through the services, and queue each
        study's next runs."""
        from services.controller.loop import serve_forever
        from shared.logs import setup_logging

        setup_logging()
        serve_forever(poll_s=poll, stale_after_s=stale_after, each_poll=each_poll)

    return controller


@click.command()
@click.argument("role", type=click.Choice(["corrector", "trainer"]))
@click.option(
    "--concurrency",
    type=click.IntRange(1, 1024),
    help="Corrector: threads, each one call in flight (default 64); the run's in-flight "
    "corrections are replicas x min(this, the corrector's params.concurrency).",
)
def worker(role: str, concurrency: int | None) -> None:
    """Run a Celery worker: 'corrector' (I/O-bound, threads) or 'trainer' (one update at a time)."""
    from shared.settings import get_settings

    if not get_settings().redis_url:
        raise click.ClickException(
            "a worker needs Redis: set GTR_REDIS_URL (e.g. redis://127.0.0.1:6379/0)"
        )
    pool = (
        ["--pool", "threads", "--concurrency", str(concurrency or 64)]
        if role == "corrector"
        else ["--pool", "solo"]
    )
    args = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "shared.queues",
        "worker",
        "-Q",
        role,
        "-n",
        f"{role}@%h",
        "-l",
        "info",
        *pool,
    ]
    os.execvp(args[0], args)


@click.command()
@click.option(
    "--port",
    default=8000,
    show_default=True,
    type=click.IntRange(1, 65000),
    help="API port; services use the next ones.",
)
@click.option(
    "--model",
    type=click.Path(path_type=Path),
    help="Base model for the policy service (default: the tiny one).",
)
@click.option(
    "--max-restarts",
    default=5,
    show_default=True,
    type=click.IntRange(0, 1000),
    help="Restarts of a part within --restart-window before the stack stops; 0: never restart.",
)
@click.option(
    "--restart-window",
    default=300.0,
    show_default=True,
    type=click.FloatRange(1, 86_400),
    help="Seconds over which a part's restarts are counted.",
)
def up(port: int, model: Path | None, max_restarts: int, restart_window: float) -> None:
    """Start the full stack as separate processes against PostgreSQL and Redis (Ctrl-C stops it).

    A part that exits is restarted after 1 s, then 2, 4, ... up to 30 s; one that exits more than
    --max-restarts times within --restart-window stops the stack."""
    from services.controller.stack import RestartPolicy, run_stack

    run_stack(port, model, RestartPolicy(max_restarts=max_restarts, window_s=restart_window))


@click.group()
def run() -> None:
    """Launch and follow runs over the REST API (GTR_API_URL, GTR_TOKEN)."""


def _client(url: str | None, token: str | None) -> Any:
    import httpx

    url = url or os.environ.get("GTR_API_URL", "http://127.0.0.1:8000")
    token = token or os.environ.get("GTR_TOKEN")
    if not token:
        raise click.ClickException(
            "no API token: pass --token or set GTR_TOKEN (create one with 'gtr token create NAME')"
        )
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def _call(client: Any, method: str, path: str, **kw: Any) -> Any:
    import httpx

    try:
        r = client.request(method, path, **kw)
    except httpx.HTTPError as e:
        raise click.ClickException(f"cannot reach the API at {client.base_url}: {e}") from None
    if r.status_code >= 400:
        detail = (
            r.json().get("detail")
            if r.headers.get("content-type", "").startswith("application/json")
            else r.text
        )
        raise click.ClickException(f"{r.status_code}: {detail}")
    return r.json()


_api = [
    click.option("--url", help="API base URL (GTR_API_URL)."),
    click.option("--token", help="API token (GTR_TOKEN)."),
]


def _with_api(f: Any) -> Any:
    for opt in reversed(_api):
        f = opt(f)
    return f


@run.command("create")
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@_with_api
def run_create(config: Path, url: str | None, token: str | None) -> None:
    """Launch a run from a TOML config."""
    cfg = load_config(config)
    out = _call(_client(url, token), "POST", "/api/runs", json=cfg.model_dump(mode="json"))
    click.echo(out["id"])


@run.command("list")
@click.option(
    "--status",
    type=click.Choice(
        ["queued", "running", "completed", "degraded", "failed", "cancelled", "superseded"]
    ),
)
@_with_api
def run_list(status: str | None, url: str | None, token: str | None) -> None:
    """List runs."""
    params = {"status": status} if status else {}
    for r in _call(_client(url, token), "GET", "/api/runs", params=params)["items"]:
        click.echo(
            f"{r['id']}\t{r['status']}\t{r['task']}\t{r['algorithm']}\t{r['updates_done']}/{r['num_updates']}\t{r['name']}"
        )


@run.command("cancel")
@click.argument("run_id", type=int)
@_with_api
def run_cancel(run_id: int, url: str | None, token: str | None) -> None:
    """Cancel a run."""
    click.echo(_call(_client(url, token), "POST", f"/api/runs/{run_id}/cancel")["status"])


@run.command("resume")
@click.argument("run_id", type=int)
@_with_api
def run_resume(run_id: int, url: str | None, token: str | None) -> None:
    """Queue a failed run again; it resumes after its last trained update."""
    click.echo(_call(_client(url, token), "POST", f"/api/runs/{run_id}/resume")["status"])


def _duration(sec: float) -> str:
    """As the run page writes it: 42s, 3m 05s, 1h 02m."""
    s = int(sec)
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


def phase_text(r: dict[str, Any]) -> str:
    """What the run is doing now, worded as the run page's phase line (_macros.html phase)."""
    if r["status"] != "running":
        return str(r["status"])
    phase, step, total = r.get("phase"), r.get("phase_step") or 0, r.get("phase_total")
    of = f" {step} of {total}" if total else ""
    text = {
        "warm_start": f"warm start{of}",
        "rollout": f"rollout{' step' + of if of else ''}",
        "corrections": "waiting for corrections",
    }.get(phase or "", phase or "starting")
    if r.get("elapsed_s") is not None:
        text += f" · {_duration(r['elapsed_s'])} elapsed"
    if r.get("eta_s") is not None:
        # A stage past its measured time makes the ETA a floor: say so, and by how much.
        over = float(r.get("eta_over_s") or 0.0)
        notes = ["warm start"] if r.get("eta_of") == "warm start" else []
        notes += [f"this stage {_duration(over)} past its usual"] if over >= 1 else []
        text += f" · ETA {'≥ ' if over >= 1 else ''}{_duration(r['eta_s'])}"
        text += f" ({'; '.join(notes)})" if notes else ""
    return text


def update_line(r: dict[str, Any], u: dict[str, Any]) -> str:
    """One finished update, numbered as the charts, the step search and the step pages number
    it (from 0), with how many of the run's updates are done (``update_done``)."""
    m, nan = u["metrics"], float("nan")
    ev = m.get("eval/success_rate")  # only after an evaluated update
    return (
        f"[{r['status']}] {update_done(u['idx'], r['num_updates'])}"
        f"  env steps {r['env_steps']}/{r['total_env_steps']}"
        f"  success {success_cell(m)}"
        f"  corrected {m.get('corrected_rate', nan):.2f}"
        f"{'' if ev is None else f'  eval {ev:.2f}'}"
        f"{coverage_cell(m)}"
        f"{'  ALARM: ' + str(m.get('alarm_reason', '')) if u['alarm'] else ''}"
    )


def coverage_cell(m: dict[str, Any]) -> str:
    """``  corrections 120 of 128 (94%), lag 0.4`` for a run that asked for corrections."""
    if not m.get("corrections"):
        return ""
    text = f"  corrections {int(m.get('corrections_done', 0))} of {int(m['corrections'])}"
    if "corrections_coverage" in m:
        text += f" ({m['corrections_coverage']:.0%})"
    if "corrections_lag" in m:
        text += f", lag {m['corrections_lag']:.1f}"
    return text


ETA_EVERY_S = 10.0  # `gtr run watch`: a phase line at least this often while an ETA counts down


@run.command("watch")
@click.argument("run_id", type=int)
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(0.2, 600))
@_with_api
def run_watch(run_id: int, interval: float, url: str | None, token: str | None) -> None:
    """Follow a run until it ends: its phase as it changes (the warm start's progress, rollout,
    corrections, training, evaluating) and a line per finished update; exits non-zero unless
    it completed."""
    client = _client(url, token)
    seen, phase, said = 0, "", 0.0
    while True:
        r = _call(client, "GET", f"/api/runs/{run_id}")
        # Every update finished since the last look, each with its own metrics.
        while seen < r["updates_done"]:
            page = _call(client, "GET", f"/api/runs/{run_id}/updates?offset={seen}&limit=50")
            done = [u for u in page["items"] if seen <= u["idx"] < r["updates_done"]]
            for u in done:
                click.echo(update_line(r, u))
            if not done:
                break
            seen = done[-1]["idx"] + 1
        # A rollout's step count moves too fast to be worth a line; a warm start's chunks do not.
        now = r.get("phase") or "", r.get("phase_step") if r.get("phase") == "warm_start" else None
        # A phase line when the phase changes, and while it goes on, every ETA_EVERY_S with
        # the ETA counted down (a long update or warm start is not a frozen figure).
        ticking = r.get("eta_s") is not None and time.monotonic() - said >= ETA_EVERY_S
        if r["status"] == "running" and (str(now) != phase or ticking):
            phase, said = str(now), time.monotonic()
            click.echo(f"[{r['status']}] {phase_text(r)}")
        if r["status"] in ("completed", "degraded", "failed", "cancelled", "superseded"):
            if r["error"]:
                click.echo(f"error: {r['error']}")
            click.echo(r["status"])
            sys.exit(0 if r["status"] == "completed" else 1)
        time.sleep(interval)
