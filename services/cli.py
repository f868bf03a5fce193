"""The ``gtr`` command line. Subcommands live beside the service they drive and load lazily,
so ``gtr --help`` is fast and a command never imports torch unless it needs it."""

from __future__ import annotations

import importlib
import os
import sys
import warnings

import click

# name -> "module:attribute" of a click command or group.
COMMANDS: dict[str, str] = {
    "serve": "services.api.cli:serve",
    "db": "services.api.cli:db",
    "token": "services.api.cli:token",
    "run": "services.controller.cli:run",
    "train": "services.controller.cli:train",
    "up": "services.controller.cli:up",
    "controller": "services.study.cli:controller",  # the controller loop, advancing studies
    "worker": "services.controller.cli:worker",
    "env": "services.env.cli:env",
    "alfworld": "services.env.alfworld.cli:alfworld",
    "model": "services.policy.cli:model",
    "policy": "services.policy.cli:policy",
    "corrector": "services.corrector.cli:corrector",
    "sft": "services.trainer.cli:sft",
    "export": "services.controller.observe_cli:export",
    "cache": "services.controller.observe_cli:cache",
    "study": "services.study.cli:study",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module_name, attr = target.split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # A command whose optional extra is not installed still shows in --help.
            return _missing(name, str(e))
        return getattr(module, attr, None) or _missing(name, f"{target} not found")

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except Exception as e:
            from pydantic import ValidationError  # on the error path only: `gtr --help` stays fast

            if isinstance(e, ValidationError) and e.title == "Settings":  # a GTR_ variable
                from shared.settings import settings_errors

                raise click.ClickException(f"bad settings: {settings_errors(e)}") from None
            from shared.db.migrate import SchemaAhead

            if isinstance(e, SchemaAhead):
                raise click.ClickException(str(e)) from None
            # A database that is down or misconfigured is a user-facing condition, not a bug.
            if (
                type(e).__module__.startswith("sqlalchemy")
                and type(e).__name__ == "OperationalError"
            ):
                orig = getattr(e, "orig", e)
                raise click.ClickException(f"cannot use the database: {orig}") from None
            raise


def _missing(name: str, why: str) -> click.Command:
    @click.command(
        name=name, help=f"(unavailable: {why})", context_settings={"ignore_unknown_options": True}
    )
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def cmd(args: tuple[str, ...]) -> None:
        raise click.ClickException(f"'gtr {name}' is unavailable here: {why}")

    return cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option("0.1.0", prog_name="gtr")
def main() -> None:
    """gtr-lab: train vision-language agents with Guided Thought Reinforcement."""
    quiet_ml_libraries()


def quiet_ml_libraries() -> None:
    """Models load from local folders only; keep the libraries' progress bars and advice quiet."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)


if __name__ == "__main__":
    sys.exit(main())
