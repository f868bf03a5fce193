"""Terminal output of ``gtr train``: config errors, a progress bar, and the closing summary."""

from __future__ import annotations

import math
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
from pydantic import ValidationError

from shared.schemas import RunConfig


def load_config(
    path: Path, *, name: str | None = None, updates: int | None = None, seed: int | None = None
) -> RunConfig:
    """Read and validate a TOML run config; every problem becomes one readable line."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise click.ClickException(f"config file not found: {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise click.ClickException(f"{path} is not valid TOML: {e}") from None
    from shared.config_paths import resolve_config_paths

    resolve_config_paths(raw, Path(path).resolve().parent)  # paths are relative to the file
    if name:
        raw["name"] = name
    if seed is not None:
        raw["seed"] = seed
    if updates is not None:
        raw.setdefault("train", {})["num_updates"] = updates
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        lines = [
            f"  {'.'.join(str(p) for p in err['loc']) or '(config)'}: {err['msg']}"
            for err in e.errors()
        ]
        raise click.ClickException(f"invalid run config {path}:\n" + "\n".join(lines)) from None


def _fmt(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def update_done(idx: int, total: int) -> str:
    """A finished update as every view numbers it (charts, step search, step pages, `gtr run
    watch`, `gtr train`): from 0, with how many of the run's updates are done."""
    return f"update {idx} done ({idx + 1} of {total})"


def progress_line(cfg: RunConfig, p: Any, last_eval: float | None, seconds: float) -> str:
    """One plain line per update (what the bar shows), for logs read by machines and people."""
    m = p.metrics
    reason = m.get("alarm_reason")
    alarm = f"  COLLAPSE ALARM: {reason}" if reason else ""
    evaluated = "" if last_eval is None else f"  eval {_fmt(last_eval)}"
    corrections = _corrections(cfg, m)  # the same facts as the bar, without its colour
    failing = "  CORRECTIONS FAILING" if corrections and m.get("corrections_alarm") else ""
    return (
        f"{update_done(p.update_idx, cfg.train.num_updates)}"
        f"  env steps {p.env_steps}/{p.total_env_steps}"
        f"  success {success_cell(m)}{evaluated}"
        f"  corrected {_fmt(m.get('corrected_rate'))}"
        f"  relevance {_fmt(m.get('probe_relevance'))}"
        f"{corrections}  {seconds:.0f} s{alarm}{failing}"
    )


@contextmanager
def plain_printer(cfg: RunConfig) -> Iterator[Callable[[Any], None]]:
    """Stdout is not a terminal (CI, nohup, k8s): a line per update instead of a bar."""
    started, last_eval = time.monotonic(), [None]

    def on_progress(p: Any) -> None:
        last_eval[0] = p.metrics.get("eval/success_rate", last_eval[0])
        line = progress_line(cfg, p, last_eval[0], time.monotonic() - started)
        print(line, flush=True)

    yield on_progress


@contextmanager
def progress_printer(cfg: RunConfig) -> Iterator[Callable[[Any], None]]:
    if not sys.stdout.isatty():
        with plain_printer(cfg) as on_progress:
            yield on_progress
        return
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("env steps", total=cfg.total_env_steps, stats="warm start…")
        last_eval: list[float | None] = [None]  # evaluations are sparse: show the latest

        def on_progress(p: Any) -> None:
            m = p.metrics
            reason = m.get("alarm_reason")
            alarm = f"  [red]COLLAPSE ALARM: {escape(str(reason))}[/red]" if reason else ""
            if "eval/success_rate" in m:
                last_eval[0] = m["eval/success_rate"]
            evaluated = "" if last_eval[0] is None else f"  eval {_fmt(last_eval[0])}"
            stats = (
                f"{update_done(p.update_idx, cfg.train.num_updates)}"
                f"  success {success_cell(m)}"
                f"{evaluated}"
                f"  corrected {_fmt(m.get('corrected_rate'))}"
                f"  relevance {_fmt(m.get('probe_relevance'))}{alarm}"
                f"{_corrections_markup(cfg, m)}"
            )
            bar.update(task, completed=p.env_steps, stats=stats)

        yield on_progress


def _corrections(cfg: RunConfig, m: dict[str, Any]) -> str:
    """This update's corrections by outcome, plain text ("" for RL4VLM, which has none)."""
    if cfg.algorithm == "rl4vlm":
        return ""
    from services.controller.correction_stats import describe

    return f"  corrections {describe(m)}"


def _corrections_markup(cfg: RunConfig, m: dict[str, Any]) -> str:
    """``_corrections`` for the bar: escaped, and red when more than half failed."""
    from rich.markup import escape

    text = escape(_corrections(cfg, m))
    failing = text and m.get("corrections_alarm")
    return f"[red]{text}  CORRECTIONS FAILING[/red]" if failing else text


def success_cell(m: dict[str, Any]) -> str:
    """The success rate, or "0 of N finished" while no episode has ended."""
    if isinstance(m.get("success_rate"), int | float):
        return _fmt(m["success_rate"])
    if "episodes_started" in m:
        return f"{m.get('episodes_finished', 0):.0f} of {m['episodes_started']:.0f} finished"
    return "-"


SUMMARY_KEYS = (
    "eval/success_rate",
    "success_rate",
    "episode_return",
    "format_valid_rate",
    "corrected_rate",
    "corrections_done",
    "corrections_failed",
    "corrections_skipped",
    "corrections_coverage",
    "corrections_lag",
    "probe_relevance",
    "probe_top_thought_share",
    "state_relevance",
    "thought_length",
    "losses/policy",
    "losses/sft",
)


def summary_columns(metrics: list[dict[str, Any]], most: int = 6) -> list[int]:
    """Which updates the summary shows: the evaluated ones (else evenly spaced), first and last."""
    n = len(metrics)
    if n == 0:
        return []
    picked = [i for i, m in enumerate(metrics) if "eval/success_rate" in m]
    if len(picked) < 2:
        picked = sorted({round(j * (n - 1) / (most - 1)) for j in range(most)})
    if len(picked) > most:  # keep the first and last, thin the middle evenly
        picked = [picked[round(j * (len(picked) - 1) / (most - 1))] for j in range(most)]
    return sorted(set(picked) | {0, n - 1})


def summary_notes(metrics: list[dict[str, Any]]) -> list[str]:
    """Warnings under the summary table: collapse alarms with their reasons, and games that are
    not ALFWorld benchmark games."""
    notes = [
        f"collapse alarm at update {i}: {m['alarm_reason']}"
        for i, m in enumerate(metrics)
        if m.get("alarm_reason")
    ]
    shares = [m["benchmark_share"] for m in metrics if "benchmark_share" in m]
    if shares and min(shares) < 1:
        notes.append(
            f"{1 - sum(shares) / len(shares):.0%} of the steps were on synthetic or derived "
            "(goal-swap) games: these results are not ALFWorld scores"
        )
    return notes


def print_summary(run_id: int, seconds: float) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from sqlalchemy import select

    from services.controller.correction_stats import failure_reasons, reasons_text, run_totals
    from shared.db.models import Run, Update
    from shared.db.session import session_scope

    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run is not None
        rows = s.scalars(select(Update).where(Update.run_id == run_id).order_by(Update.idx)).all()
        metrics = [u.metrics for u in rows]
        status, error, steps = run.status, run.error, run.env_steps
        gtr = run.algorithm != "rl4vlm"
        totals = run_totals(s, run_id) if gtr else {}
        failed = totals.get("corrections_failed") or totals.get("corrections_skipped")
        reasons = failure_reasons(s, run_id) if failed else []
        info = dict(run.info or {})
    table = Table(
        title=f"run {run_id}: {status} in {seconds:.0f} s, {steps} env steps",
        caption="columns: after update # (from 0, as the charts number them)",
    )
    cols = summary_columns(metrics)
    # Full metric names, never cut; short headers keep 7 columns within 80 characters
    # (up to update 99 999).
    table.add_column("metric", no_wrap=True, min_width=max(len(k) for k in SUMMARY_KEYS))
    for i in cols:
        table.add_column(f"#{i}", justify="right", no_wrap=True)
    for k in SUMMARY_KEYS:
        cells = [metrics[i].get(k) for i in cols]
        if k == "success_rate" and cols:  # always a row: "0 of N finished" when none ended
            table.add_row(k, *(success_cell(metrics[i]) for i in cols))
        elif any(isinstance(v, int | float) for v in cells):
            table.add_row(k, *(_fmt(v) if isinstance(v, int | float) else "" for v in cells))
    console = Console()
    console.print(table)
    if gtr:
        console.print(_corrections_line(totals), soft_wrap=True)
    if reasons:  # the model's own words are on each step (GET /api/steps/{id}: raw)
        console.print(f"why: {escape(reasons_text(reasons))}", soft_wrap=True, highlight=False)
    for line in summary_notes(metrics):
        console.print(escape(line), style="yellow")
    if error:  # escaped: a message such as pip install 'gtr-lab[alfworld]' is not markup
        console.print(f"[red]error:[/red] {escape(error)}")
    for line in info_lines(info):
        console.print(line, highlight=False)
    console.print(
        f"Browse the run: [bold]gtr token create me[/bold], then [bold]gtr serve[/bold] and open "
        f"http://127.0.0.1:8000/runs/{run_id}"
    )


def _corrections_line(totals: dict[str, Any]) -> str:
    """The run's corrections in one line, red when more than half failed."""
    from services.controller.correction_stats import describe

    calls = int(totals.get("corrector_calls", 0))
    text = f"corrections: {describe(totals)}" + (f"; {calls} corrector calls" if calls else "")
    if totals.get("corrections_alarm"):
        return f"[red]{text}: most corrections FAILED, the run trained without them[/red]"
    return text


def info_lines(info: dict[str, Any]) -> list[str]:
    """The run record beside training: the warm start's reuse, where trackers wrote, failures."""
    from rich.markup import escape

    out = []
    warm = info.get("warm_start")
    if warm and warm.get("reused"):
        out.append(
            f"warm start reused from the cache in {warm['seconds']:.1f} s "
            f"(built in {warm['built_seconds']:.0f} s; key {warm['key'][:12]})"
        )
    elif warm:
        out.append(f"warm start built in {warm['seconds']:.0f} s and cached for the next run")
    for name, t in sorted((info.get("tracking") or {}).items()):
        if t.get("ok"):
            out.append(f"{name}: {escape(str(t.get('where')))}")
        else:
            where, err = escape(str(t.get("where"))), escape(str(t.get("error")))
            out.append(f"[red]{name} FAILED[/red] ({where}): {err}")
    return out
