"""``gtr study``: run a study here (`run`), or on the full stack over REST (`create`, `list`,
`cancel`, `resume`), print its verdict table (`report`) or its learning curves (`figure`), and
carry it between stores as one file (`export`, `import`: services/study/bundle.py)."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from pydantic import ValidationError

from services.controller.cli import _call, _client, _with_api, controller_command

if TYPE_CHECKING:
    from services.study.schemas import StudyConfig


def load_study(path: Path) -> StudyConfig:
    """Read and validate a study file; every problem becomes one readable line."""
    from services.study.schemas import StudyConfig

    try:
        return StudyConfig.from_toml(path)
    except FileNotFoundError:
        raise click.ClickException(f"study file not found: {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise click.ClickException(f"{path} is not valid TOML: {e}") from None
    except ValidationError as e:
        lines = [
            f"  {'.'.join(str(p) for p in err['loc']) or '(study)'}: {_msg(err['msg'])}"
            for err in e.errors()
        ]
        raise click.ClickException(f"invalid study file {path}:\n" + "\n".join(lines)) from None
    except ValueError as e:  # a task's config file that cannot be read
        raise click.ClickException(f"invalid study file {path}: {e}") from None


def _msg(text: str) -> str:
    return text.removeprefix("Value error, ")


def _advance_studies(session: Any) -> int:
    from services.study.service import advance_all

    return advance_all(session)


# `gtr controller`: the controller loop, which also queues each study's next runs every poll.
controller = controller_command(each_poll=_advance_studies)


@click.group()
def study() -> None:
    """Studies: a grid of runs (tasks x arms x seeds) judged by a declared primary metric."""


@study.command("run")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--jobs",
    "-j",
    default=1,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Training processes at once.",
)
@click.option(
    "--stop-by",
    "stop_by",
    metavar="WHEN",
    help="Start only the runs expected to finish by WHEN, then pause (exit 0, cells left): a "
    "duration (90m, 2h, 1h30m), a clock time (18:40: its next, within 12 h) or a date-time "
    "(2026-12-06T18:40). "
    "A run still training then goes back to the queue, to resume after its last update.",
)
def study_run(file: Path, jobs: int, stop_by: str | None) -> None:
    """Run a study in this machine's processes (embedded default); rerun to resume it."""
    from services.study.runner import Paused, StudyUnreadable, parse_deadline, run_study
    from services.study.service import StudyRefused

    try:
        deadline = parse_deadline(stop_by) if stop_by is not None else None
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--stop-by") from None
    cfg = load_study(file)
    _preflight(cfg)
    _local_schema()
    try:
        study_id = run_study(cfg, jobs, say=click.echo, deadline=deadline)
    except (StudyRefused, StudyUnreadable) as e:
        raise click.ClickException(str(e)) from None
    except Paused as e:
        click.echo(str(e))
        _print_report(e.study_id)
        sys.exit(0)  # it did what --stop-by asked; the report says what is left
    except KeyboardInterrupt:
        sys.exit(130)
    ok = _print_report(study_id)
    sys.exit(0 if ok else 1)


@study.command("plan")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
def study_plan(file: Path) -> None:
    """List a study's runs and warm starts without running anything (nothing is written)."""
    for line in plan_lines(load_study(file)):
        click.echo(line)


def plan_lines(cfg: StudyConfig) -> list[str]:
    """The grid as `gtr study plan` prints it: runs per task, variant and arm, the env steps,
    and the warm starts the runs will build (one per distinct recipe, env and seed)."""
    from collections import Counter

    from services.study.service import warm_group

    cells = cfg.cells()
    configs = {cell: cfg.run_config(cell) for cell in cells}
    steps = sum(c.total_env_steps for c in configs.values())
    lines = [
        f"study {cfg.name}: {len(cells)} runs, {steps:,} env steps, primary {cfg.primary.label()}"
    ]
    from services.study.tuning import plan_lines as tuning_lines
    from services.study.tuning import tuning_cells

    tuning, tuning_steps = tuning_lines(cfg)
    if tuning:
        lines += tuning
        lines.append(f"cost with the tuning stage: at most {steps + tuning_steps:,} env steps")
    per = Counter((c.task, c.variant, c.arm) for c in cells)
    for task in cfg.tasks:
        seeds = cfg.seeds_of(task)
        lines.append(f"task {task}: seeds {', '.join(map(str, seeds))}")
        for variant in list(cfg.variants) or [""]:
            arms = [a for a in cfg.arms if per.get((task, variant, a))]
            if arms:
                label = f"variant {variant}" if variant else "no variant"
                lines.append(f"  {label}: {_runs(per, task, variant, arms)}")
        shared = [a for a in cfg.shared_arms if cfg.variants and per.get((task, "", a))]
        if shared:
            lines.append(f"  no variant, shared by every variant: {_runs(per, task, '', shared)}")
    # The tuning stage's runs warm-start on its own seeds (no knob changes [init]: one per arm's
    # config and seed); runs with init.cache = false build their own warm start each.
    every = [*configs.values(), *(cfg.run_config(c) for c in tuning_cells(cfg))]
    uncached = [c for c in every if c.init.kind == "warm_start" and not c.init.cache]
    warm = len({warm_group(c) for c in every} - {None}) + len(uncached)
    lines.append(
        f"warm starts to build: {warm} (runs of one task and seed share one when their "
        "model, env settings less early truncation, and [init] recipe agree)"
    )
    return lines


def _runs(per: Any, task: str, variant: str, arms: list[str]) -> str:
    return ", ".join(f"{arm} {per[(task, variant, arm)]}" for arm in arms)


def _preflight(cfg: StudyConfig) -> None:
    """What `gtr train` checks before a run exists (paths, corrector), for every cell."""
    from services.controller.preflight import PreflightError, preflight

    seen: set[str] = set()
    for cell in cfg.cells():
        run_cfg = cfg.run_config(cell)
        key = run_cfg.model_dump_json(exclude={"name", "seed"})
        if key in seen:
            continue
        seen.add(key)
        try:
            preflight(run_cfg)
        except PreflightError as e:
            raise click.ClickException(f"{cell.describe()}: {e}") from None


def _print_report(study_id: int) -> bool:
    """The verdict table; False when the study did not end done."""
    from services.study.report import build_report
    from shared.db.session import session_scope

    with session_scope() as s:
        report = build_report(s, study_id)
    render(report)
    return report.status == "done"


def render(report: Any) -> None:
    try:
        from services.study.console import print_report
    except ImportError:  # the rendered table is H-stats' part; a plain one until it lands
        click.echo(json.dumps(report.model_dump(mode="json"), indent=2)[:20_000])
        return
    print_report(report)


@study.command("report")
@click.argument("study_id", type=click.IntRange(1, 2**31 - 1))
@click.option("--json", "as_json", is_flag=True, help="The report as JSON.")
@click.option(
    "--markdown",
    "as_markdown",
    is_flag=True,
    help="The verdict section as Markdown, for a results page (no run ids, ETA or dates).",
)
@click.option(
    "--into",
    type=click.Path(exists=True, dir_okay=False, writable=True, path_type=Path),
    help="Write the Markdown section into this page, replacing what lies between its lines "
    "`<!-- begin: gtr study report ID --markdown -->` and `<!-- end: gtr study report -->` "
    "(implies --markdown; the rest of the page is kept as it is).",
)
@click.option(
    "--brief",
    is_flag=True,
    help="With --markdown or --into: the summary (the answers, each arm's score and change from "
    "its start, the tuned settings), for a page that opens with several studies' answers; "
    "--into writes it between `<!-- begin: gtr study report ID --markdown --brief -->` and "
    "`<!-- end: gtr study report -->`.",
)
def study_report(
    study_id: int, as_json: bool, as_markdown: bool, into: Path | None, brief: bool
) -> None:
    """Print a study's verdict table from the database the settings name."""
    if as_json and (as_markdown or into):
        raise click.UsageError("--json and --markdown/--into: choose one")
    if brief and not (as_markdown or into):
        raise click.UsageError("--brief is a Markdown summary: add --markdown or --into PAGE")
    if into is not None:  # a page that cannot take the section is refused before the report
        _write_into(into, study_id, brief)
        return
    report = _stored_report(study_id)
    if as_json:
        click.echo(json.dumps(report.model_dump(mode="json"), indent=2))
    elif as_markdown:
        from services.study.markdown import render_markdown

        click.echo(render_markdown(report, brief), nl=False)
    else:
        render(report)


def _write_into(page: Path, study_id: int, brief: bool) -> None:
    """Replace the page's section (its summary with ``brief``) for the study (markdown.splice),
    atomically: a page whose markers are wrong is refused, before the report is read, and left
    as it was."""
    from services.study.markdown import PageError, render_markdown, splice

    try:
        old = page.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise click.ClickException(f"cannot read {page}: {e}") from None
    try:
        splice(old, study_id, "", brief)
    except PageError as e:
        raise click.ClickException(f"{page}: {e}; nothing was written") from None
    section = render_markdown(_stored_report(study_id), brief)
    new = splice(old, study_id, section, brief)
    part = "summary" if brief else "section"
    if new == old:
        click.echo(f"{page}: study {study_id}'s {part} is already the report")
        return
    tmp = page.with_name(f".{page.name}.tmp")
    tmp.write_text(new, encoding="utf-8")
    tmp.replace(page)
    click.echo(f"{page}: study {study_id}'s {part} replaced ({section.count(chr(10))} lines)")


@study.command("create")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@_with_api
def study_create(file: Path, url: str | None, token: str | None) -> None:
    """Launch a study on the full stack (its runs go through the controllers' queue)."""
    cfg = load_study(file)
    out = _call(_client(url, token), "POST", "/api/studies", json=cfg.model_dump(mode="json"))
    click.echo(out["id"])


@study.command("list")
@_with_api
def study_list(url: str | None, token: str | None) -> None:
    """List the team's studies."""
    for r in _call(_client(url, token), "GET", "/api/studies")["items"]:
        c = r["counts"]
        click.echo(
            f"{r['id']}\t{r['status']}\t{c['done']}/{c['cells']} done, {c['failed']} failed"
            f"\t{r['primary_metric']}\t{r['name']}"
        )


@study.command("cancel")
@click.argument("study_id", type=click.IntRange(1, 2**31 - 1))
@_with_api
def study_cancel(study_id: int, url: str | None, token: str | None) -> None:
    """Cancel a study: its queued runs are cancelled, its running ones stopped."""
    click.echo(_call(_client(url, token), "POST", f"/api/studies/{study_id}/cancel")["status"])


@study.command("resume")
@click.argument("study_id", type=click.IntRange(1, 2**31 - 1))
@_with_api
def study_resume(study_id: int, url: str | None, token: str | None) -> None:
    """Resume a cancelled or stopped study; finished runs are never rerun."""
    click.echo(_call(_client(url, token), "POST", f"/api/studies/{study_id}/resume")["status"])


def _out_option(help: str) -> Any:
    """The file a command writes (its folder must exist: `_check_folder`)."""
    return click.option(
        "--out",
        "out",
        required=True,
        type=click.Path(dir_okay=False, writable=True, path_type=Path),
        help=help,
    )


@study.command("figure")
@click.argument("study_id", type=click.IntRange(1, 2**31 - 1))
@_out_option("The PNG to write.")
@click.option(
    "--metric",
    default=None,
    help="The metric whose curves to draw (default: the study's primary metric).",
)
@click.option(
    "--from-start",
    is_flag=True,
    help="Draw each arm's change from its seeds' starts (the primary metric less each seed's "
    "start evaluation), for a study whose seeds start from different weights.",
)
def study_figure(study_id: int, out: Path, metric: str | None, from_start: bool) -> None:
    """Draw a study's learning curves (mean over seeds, 95 % band) as one PNG."""
    from services.study.figure import NoCurve, draw_curves

    report = _stored_report(study_id)
    _check_folder(out)
    primary = next((g.primary.metric for g in report.groups), report.primary)
    chosen = metric or primary
    if from_start and chosen != primary:
        raise click.ClickException(f"--from-start draws the primary metric only ({primary})")
    try:
        panels = draw_curves(report, chosen, out, from_start=from_start)
    except NoCurve as e:
        raise click.ClickException(str(e)) from None
    what = f"{chosen} from the start" if from_start else chosen
    click.echo(f"study {study_id}: {panels} panel{'' if panels == 1 else 's'} of {what} -> {out}")


@study.command("export")
@click.argument("study_id", type=click.IntRange(1, 2**31 - 1))
@_out_option("The bundle to write: FILE.json.gz (gzip'd) or FILE.json.")
@click.option(
    "--warm-starts/--no-warm-starts",
    default=True,
    show_default=True,
    help="Carry the cached warm starts of the seeds that still have cells to train.",
)
def study_export(study_id: int, out: Path, warm_starts: bool) -> None:
    """Write a study's file and finished runs (what its report reads) to one bundle, with the
    warm starts its unfinished seeds need (from this machine's cache)."""
    from services.study.bundle import export_study, stopped_runs, write_bundle
    from services.study.service import StudyNotFound
    from shared.db.session import session_scope

    _local_schema()
    _check_folder(out)
    try:
        with session_scope() as s:
            bundle = export_study(s, study_id, warm_starts)
            stopped = stopped_runs(s, study_id)
    except StudyNotFound:
        raise click.ClickException(f"study {study_id} not found") from None
    write_bundle(bundle, out)
    done = sum(r["status"] == "completed" for r in bundle["runs"])
    click.echo(
        f"study {study_id}: {len(bundle['runs'])} finished runs ({done} completed) "
        f"-> {out} ({out.stat().st_size:,} bytes)"
    )
    if stopped:
        ids = ", ".join(map(str, stopped))
        click.echo(
            f"not carried: run{'s' if len(stopped) > 1 else ''} {ids}, stopped before "
            "the end (cancelled); their cells train again where the bundle is imported"
        )
    for item in bundle["warm_starts"]:
        seed = f"{item['cell']['task']} seed {item['cell']['seed']}"
        if item["entry"] is None:
            click.echo(f"no warm start of {seed} in this cache: its next runs will build one")
        else:
            size = sum(len(v) * 3 // 4 for v in item["entry"]["files"].values())
            click.echo(f"carried the warm start of {seed} ({size / 1e6:.1f} MB)")


@study.command("import")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--team",
    default=None,
    help="The team to own it (default: the operator's team 'default'; never the bundle's).",
)
@click.option(
    "--max-mib",
    type=click.IntRange(1, 4096),
    default=128,
    show_default=True,
    help="Refuse a bundle whose JSON inflates to more than this many MiB.",
)
def study_import(file: Path, team: str | None, max_mib: int) -> None:
    """Add a bundle's study and runs to this store (cells that have a run here are skipped) and
    its warm starts to this machine's cache. The study file and run configs pass the checks of
    a direct launch by the team; numbers out of range, nesting deeper than 32 and NUL characters
    refuse the bundle, which then writes nothing."""
    from services.study.bundle import BundleError, import_study, install_warm_starts, read_bundle
    from services.study.kept import report_of
    from services.study.tuning_carry import install_stage
    from shared.db.models import Study
    from shared.db.session import session_scope

    _local_schema()
    try:
        bundle = read_bundle(file, max_mib * 2**20)
        with session_scope() as s:
            got = import_study(s, bundle, team)
    except BundleError as e:
        raise click.ClickException(str(e)) from None
    click.echo(
        f"study {got.study_id} ({'new' if got.created else 'existing'}): "
        f"{len(got.added)} runs imported, {got.skipped} already here; "
        f"{got.waiting} cells have no finished run"
    )
    if got.stopped:
        click.echo(
            f"{got.stopped} runs stopped before their end were left out: their cells train again"
        )
    if got.waiting:
        click.echo(
            "rerun the study file with `gtr study run FILE` here (or `gtr study resume "
            f"{got.study_id}` on the full stack) to train them"
        )
    if got.spec is not None:  # its tuning stage, so that the study here does not tune again
        for line in install_stage(got.spec, got.study_id, got.tuning):
            click.echo(line)
    # Then the warm starts its unfinished cells (and the stage's unfinished arms) will reuse.
    with session_scope() as s:
        for line in install_warm_starts(s, bundle, got.study_id):
            click.echo(line, err=line.startswith("warning:"))
    # Build and keep the report now, so that the study's first page view reads it (the v3
    # study's bootstrap takes seconds) instead of building it under a visitor.
    with session_scope() as s:
        study_row = s.get(Study, got.study_id)
        if study_row is not None:
            report_of(s, study_row)


@study.command("rerun")
@click.argument("study_id", type=int)
@click.argument("run_ids", type=int, nargs=-1, required=True)
@click.option(
    "--why",
    required=True,
    help="The reason, kept on each run (e.g. 'started from another warm start than its seed').",
)
def study_rerun(study_id: int, run_ids: tuple[int, ...], why: str) -> None:
    """Train finished runs' cells again: the runs are marked superseded (kept, with their data,
    but out of the report and the bundle) and the study's next scheduling queues each cell."""
    from services.study.runner import cell_text
    from services.study.service import StudyConflict, StudyNotFound, supersede
    from shared.db.models import Study
    from shared.db.session import session_scope

    if not why.strip():
        raise click.BadParameter("say why the runs are trained again", param_hint="--why")
    _local_schema()
    try:
        with session_scope() as s:
            study = s.get(Study, study_id)
            if study is None:
                raise StudyNotFound(f"study {study_id}")
            runs = supersede(s, study, run_ids, why.strip())
            lines = [f"run {r.id} ({cell_text(r)}) superseded" for r in runs]
    except StudyNotFound:
        raise click.ClickException(f"study {study_id} not found") from None
    except StudyConflict as e:
        raise click.ClickException(f"{e}; nothing was changed") from None
    for line in lines:
        click.echo(line)
    click.echo(
        f"`gtr study run FILE` here (on the full stack the controllers; `gtr study resume "
        f"{study_id}` if it is stopped) trains {'its cell' if len(lines) == 1 else 'their cells'}"
        " again"
    )


def _stored_report(study_id: int) -> Any:
    """The study's report from the database the settings name; a missing study is one line.
    A study no one trains is read from the report kept in the data folder where its rows are
    unchanged (`gtr study import` keeps one), not bootstrapped again (services/study/kept.py)."""
    from services.study.kept import report_of
    from shared.db.models import Study
    from shared.db.session import session_scope

    _local_schema()
    with session_scope() as s:
        study = s.get(Study, study_id)
        if study is None:
            raise click.ClickException(f"study {study_id} not found")
        return report_of(s, study)


def _check_folder(out: Path) -> None:
    if not out.parent.is_dir():
        raise click.ClickException(f"no folder {out.parent} to write {out.name} in")


def _local_schema() -> None:
    """The embedded store is created on first use; a server's is migrated by its deploy."""
    from shared.db.migrate import ensure_schema
    from shared.settings import get_settings

    if get_settings().database_url is None:
        ensure_schema()
