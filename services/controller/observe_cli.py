"""``gtr export`` (a run's steps as a dataset) and ``gtr cache ls|rm`` (warm-start cache)."""

from __future__ import annotations

import time
from pathlib import Path

import click


@click.command()
@click.argument("run_id", type=click.IntRange(1, 2**31 - 1))
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "parquet", "hf"]),
    default="jsonl",
    show_default=True,
    help="jsonl (frames as base64 PNG), parquet, or hf (save_to_disk).",
)
@click.option(
    "--corrected/--not-corrected",
    default=None,
    help="Only steps the corrector disagreed with (or only the others).",
)
@click.option("--verdict", type=click.Choice(["correct", "incorrect"]))
@click.option("--update-from", type=click.IntRange(0), help="First update to include.")
@click.option("--update-to", type=click.IntRange(0), help="Last update to include.")
@click.option("--format-valid/--format-invalid", default=None, help="By the output's format.")
@click.option("--limit", type=click.IntRange(1), help="At most this many steps.")
def export(
    run_id: int,
    out: Path,
    fmt: str,
    corrected: bool | None,
    verdict: str | None,
    update_from: int | None,
    update_to: int | None,
    format_valid: bool | None,
    limit: int | None,
) -> None:
    """Write RUN_ID's steps (frame, prompt, output, corrected thought, verdict, reward) to OUT."""
    from services.controller.export import ExportFilter
    from services.controller.export import export as run_export
    from shared.db.migrate import ensure_schema
    from shared.settings import get_settings

    if out.exists() and (out.is_file() or any(out.iterdir())):
        raise click.ClickException(f"{out} already exists; give a new path")
    if get_settings().database_url is None:
        ensure_schema()
    out.parent.mkdir(parents=True, exist_ok=True)
    f = ExportFilter(corrected, verdict, update_from, update_to, format_valid, limit)
    started = time.monotonic()
    try:
        n = run_export(run_id, fmt, out, f)  # type: ignore[arg-type]
    except LookupError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"{n} steps of run {run_id} -> {out} ({fmt}, {time.monotonic() - started:.1f} s)")


@click.group()
def cache() -> None:
    """The warm-start cache: a run whose warm start was paid before reuses it."""


@cache.command("ls")
def cache_ls() -> None:
    """List cached warm starts: key, task, the run config's name, size, build time."""
    from services.trainer.warmcache import cache_root, list_entries

    entries = list_entries()
    if not entries:
        click.echo(f"no cached warm start in {cache_root()}")
        return
    for e in entries:
        made = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.created_at))
        click.echo(
            f"{e.key[:16]}  {e.task:<10}  {e.size_bytes / 1e6:7.1f} MB  built in "
            f"{e.seconds:5.0f} s  {made}  {e.name}"
        )


@cache.command("rm")
@click.argument("key", required=False)
@click.option("--all", "everything", is_flag=True, help="Remove every entry.")
def cache_rm(key: str | None, everything: bool) -> None:
    """Remove the entry whose key starts with KEY (or --all)."""
    from services.trainer.warmcache import remove_entries

    if not key and not everything:
        raise click.ClickException("give a KEY prefix (see 'gtr cache ls') or --all")
    if key and (len(key) < 4 or any(c not in "0123456789abcdef" for c in key)):
        raise click.ClickException("a KEY is at least 4 lowercase hex digits (see 'gtr cache ls')")
    gone = remove_entries(None if everything else key)
    if not gone:
        raise click.ClickException(f"no cached warm start matches {key!r}")
    for k in gone:
        click.echo(f"removed {k[:16]}")
