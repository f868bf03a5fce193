"""Checks a run config can fail before any run row exists: extras, games, model, checkpoint,
the generation backend, a remote corrector this process may not call or cannot reach.

`gtr train` calls ``preflight`` right after reading the config, so a wrong path or a missing
extra is one line and a non-zero exit, not a failed run (and its traceback) in the store.
"""

from __future__ import annotations

from pathlib import Path

from shared.schemas import RunConfig


class PreflightError(ValueError):
    """The run cannot start; the message says why in one line."""


def preflight(cfg: RunConfig) -> None:
    """Raise PreflightError on the first problem a run would hit at start-up."""
    model = Path(cfg.model.path) if cfg.model.path is not None else None
    if model is not None and not model.is_dir():
        raise PreflightError(f"model.path: no model folder at {model}")
    if model is not None and not (model / "config.json").is_file():
        raise PreflightError(f"model.path: {model} holds no config.json (a Hugging Face model)")
    if cfg.init.kind == "checkpoint":
        ck = Path(str(cfg.init.checkpoint))
        if not ck.is_dir():
            raise PreflightError(f"init.checkpoint: no checkpoint folder at {ck}")
        if not (ck / "policy.json").is_file() and not (ck / "config.json").is_file():
            raise PreflightError(
                f"init.checkpoint: {ck} is neither a policy checkpoint (policy.json) nor a "
                "model folder (config.json)"
            )
    if cfg.model.backend == "vllm":
        _check_vllm()
    _check_corrector(cfg)
    if cfg.task == "alfworld":
        _check_alfworld(cfg)
        return
    from services.env.registry import make_env
    from services.env.stalling import refuse_stalling

    try:
        make_env(cfg.task, cfg.env, seed=0).close()
        refuse_stalling(cfg.task, cfg.env, "env")  # never answering must not beat a wrong answer
    except (ValueError, ImportError, OSError) as e:
        raise PreflightError(str(e) if "stalling" in str(e) else f"env: {e}") from None


def _check_vllm() -> None:
    """An in-process policy samples with vLLM only where vllm and a CUDA device are; a policy
    service (GTR_POLICY_SERVICE_URL) has its own ``--backend``."""
    from shared.settings import get_settings

    if get_settings().policy_service_url:
        return
    from importlib.util import find_spec

    if find_spec("vllm") is not None:  # torch is imported only then
        from services.policy.vllm_backend import vllm_available

        if vllm_available():
            return
    raise PreflightError(
        "model.backend: 'vllm' needs vllm and a CUDA device in this process "
        "(pip install vllm on a GPU machine); use backend = 'hf' here"
    )


def _check_alfworld(cfg: RunConfig) -> None:
    """The extra is installed, the options are valid and the games folder holds games.

    Finding games reads only the file system; parsing them (seconds) is left to the run."""
    from services.env.alfworld import MISSING_EXTRA, GamesError
    from services.env.alfworld.games import find_games

    try:
        from services.env.alfworld.env import AlfWorldOptions
    except ModuleNotFoundError as e:
        raise PreflightError(f"{MISSING_EXTRA} ({e})") from None
    try:
        options = AlfWorldOptions.model_validate(cfg.env.options)
        find_games(options.games)
    except GamesError as e:
        raise PreflightError(f"env.options.games: {e}") from None
    except ValueError as e:
        raise PreflightError(f"env.options: {e}".replace("\n", " ")) from None


# Long enough for a hosted API's TLS handshake; a local server answers at once.
REACH_TIMEOUT_S = 10.0


def _check_corrector(cfg: RunConfig) -> None:
    """A remote corrector that every call would fail to reach (refused by the egress policy,
    a name that does not resolve, nothing listening) would fail every step's correction: the
    run is refused instead. Any HTTP answer, even 401 or 404, counts as reachable."""
    c = cfg.corrector
    if not cfg.uses_corrector or c.backend == "self_teacher":
        return
    url = c.base_url if c.kind is not None else _registered_url(c.name)
    if not url:
        return  # built in, or not registered: the launch check names that (create_run)
    import httpx

    from services.corrector.base import CorrectorError
    from services.corrector.egress import check_destination

    where = f"corrector {c.name!r} at {url}"
    try:
        check_destination(url)
        with httpx.Client(timeout=REACH_TIMEOUT_S, follow_redirects=False) as client:
            client.get(url.rstrip("/") + ("/models" if c.kind != "http" else "/healthz"))
    except CorrectorError as e:
        raise PreflightError(f"{where}: {e.reason}") from None
    except httpx.TimeoutException:
        raise PreflightError(
            f"{where}: no answer within {REACH_TIMEOUT_S:g} s; is the server up?"
        ) from None
    except httpx.HTTPError as e:
        raise PreflightError(
            f"{where} cannot be reached ({type(e).__name__}: {str(e)[:200]}); start the server "
            "or fix base_url"
        ) from None


def _registered_url(name: str) -> str | None:
    """The base URL of a registered corrector (None: built in, or no such name)."""
    from sqlalchemy import select

    from services.corrector.service import ORACLE
    from shared.db.migrate import ensure_schema
    from shared.db.models import Corrector
    from shared.db.session import session_scope
    from shared.schemas import SELF_TEACHER
    from shared.settings import get_settings

    if name in (ORACLE, SELF_TEACHER):
        return None
    if get_settings().database_url is None:
        ensure_schema()  # the embedded registry, as `gtr train` makes it next
    with session_scope() as s:
        row = s.scalar(select(Corrector).where(Corrector.name == name))
        return row.base_url if row is not None and row.kind != "oracle" else None
