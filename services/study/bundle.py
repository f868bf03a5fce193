"""A study as one file: `gtr study export ID --out FILE` and `gtr study import FILE`.

A bundle carries what the study's report reads, and nothing else: the study file, and for each
finished run its record (with the hash of the weights it started from: the report's check that
a seed's arms started alike), its update metrics, its per-deal evaluation outcomes and the deals
its training episodes started from (the report's leak check). It leaves out steps, corrections,
images and checkpoints, so a 63-run study fits in a few MB of gzip'd JSON that git can carry.
That is how a study too long for one machine session moves on: export where it ran, import into
the next session's store (SQLite or PostgreSQL), rerun the same study file, and only the cells
with no finished run train. An imported run's page shows its curves but not its steps. A run
stopped before its end (cancelled) is not carried: its cell trains again where the bundle goes.

It also carries the cached warm start of each seed that still has cells to train (a few MB
each, services/trainer/warmcache.py: pack_entry): a warm start rebuilt on another machine is
not the same bit for bit, and a seed whose arms start from different weights is no longer a
like-for-like comparison. The import files each one in this machine's cache, where the seed's
next runs reuse it, once this machine would have built it from the same inputs.

Importing into a store that has a study of the same name and team adds the runs of cells it has
no run for and skips the rest, so importing one bundle twice changes nothing. Functions over a
Session that never commit: the command commits once, so a refused bundle writes nothing.
"""

from __future__ import annotations

import gzip
import json
import math
import tempfile
import zlib
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy import insert, select
from sqlalchemy.exc import StatementError
from sqlalchemy.orm import Session

from services.study import service, tuning
from services.study.report import training_deals
from services.study.schemas import Cell, StudyConfig
from services.study.tuning_carry import CarriedArm, CarryError, check_stage, export_stage
from shared.db.models import Checkpoint, EvalOutcome, Run, Study, Update, utcnow
from shared.schemas import RunConfig

FORMAT = "gtr-study-bundle"
VERSION = 1
# A run in flight has no final figures yet, and neither has one stopped before its end
# (`cancelled`: Ctrl-C, a `--stop-by` deadline, `gtr study cancel`): its curve stops part-way
# and the checkpoints it would resume from are not carried, so its cell trains again after an
# import instead.
FINISHED = ("completed", "failed")
# The run record's columns a bundle keeps (ids, heartbeats and live phase are the store's own).
RUN_FIELDS = (
    "name",
    "task",
    "algorithm",
    "status",
    "config",
    "error",
    "env_steps",
    "total_env_steps",
    "num_updates",
    "updates_done",
    "alarm",
    "study_task",
    "study_arm",
    "study_seed",
    "study_variant",
    "study_attempt",
)
TIMES = ("created_at", "started_at", "finished_at")
OUTCOME = ("update_idx", "deal", "seed", "success", "episode_return", "episode_length")


# What a bundle may hold (a 63-run study is 12 MB of JSON and 1 M values): the cap on its
# inflated size is checked while it inflates, so a small file that inflates to gigabytes is
# refused after reading MAX_BYTES; the others before a value is built.
MAX_BYTES = 128 * 2**20  # inflated; gtr study import --max-mib raises it
MAX_VALUES = 4_000_000  # JSON values (commas and containers counted before parsing)
MAX_DEPTH = 32  # nesting of objects and lists
MAX_NUMBER = 1e15  # |x| of any fraction: a score beyond it is a forgery, not a measurement
OPERATOR_TEAM = "default"  # the operator's team (gtr train's): an import's team unless named


class BundleError(ValueError):
    """A bundle that cannot be read or imported; the message says why in one line."""


@dataclass
class Imported:
    study_id: int
    created: bool  # a new study, or runs added to one of the same name and team
    added: list[int] = field(default_factory=list)  # the new run ids
    skipped: int = 0  # bundle runs whose cell already has a run here
    stopped: int = 0  # bundle runs stopped before their end (an older export's): not imported
    waiting: int = 0  # the study's cells with no finished run: what a rerun would train
    spec: StudyConfig | None = None  # the bundle's study file, checked
    tuning: list[CarriedArm] = field(default_factory=list)  # its tuning stage, checked


def export_study(session: Session, study_id: int, warm_starts: bool = True) -> dict[str, Any]:
    """The bundle of a study: its file, every finished run and (``warm_starts``) the cached
    warm starts its unfinished cells would reuse. Raises StudyNotFound."""
    study = session.get(Study, study_id)
    if study is None:
        raise service.StudyNotFound(f"study {study_id}")
    runs = _finished(session, study)
    carried = _warm_starts(session, study) if warm_starts else []
    return {
        "format": FORMAT,
        "version": VERSION,
        "exported_at": utcnow().isoformat(),
        "study": {
            "name": study.name,
            "team": study.team,
            "spec": study.spec,
            "created_at": study.created_at.isoformat(),
        },
        "runs": [_run_entry(session, run) for run in runs],
        "warm_starts": carried,
        "tuning": export_stage(session, service.config_of(study), study.id),
    }


def unfinished_groups(session: Session, study: Study) -> dict[str, Cell]:
    """One cell per warm start that the study's cells still to train would use: its group
    (service.warm_group) -> the first such cell."""
    cfg = service.config_of(study)
    p = service.plan(session, study)
    cells = [
        *p.pending,
        *p.retry,
        *(c for c, _ in p.rerun),
        *(service.cell_of(r) for r in (*p.active, *p.cancelled)),
    ]
    # The tuning stage's runs too, while an arm has no choice: its trials on one seed compare
    # like for like only from the same weights.
    unfinished = tuning.unfinished_arms(cfg, study.id)
    if unfinished:
        cells += tuning.tuning_cells(cfg, unfinished)
    out: dict[str, Cell] = {}
    for cell in cells:
        group = service.warm_group(cfg.run_config(cell))
        if group is not None:
            out.setdefault(group, cell)
    return out


def _warm_starts(session: Session, study: Study) -> list[dict[str, Any]]:
    groups = unfinished_groups(session, study)
    if not groups:
        return []
    from services.trainer.warmcache import pack_entry

    cfg = service.config_of(study)
    recorded: dict[str, list[str]] = {}  # group -> the keys its runs recorded, latest first
    for run in sorted(service.study_runs(session, study.id), key=lambda r: -r.id):
        key = ((run.info or {}).get("warm_start") or {}).get("key")
        if key and run.status != service.SUPERSEDED:  # a superseded run's start is not wanted
            group = service.warm_group(cfg.run_config(service.cell_of(run)))
            recorded.setdefault(str(group), []).append(str(key))
    for run in sorted(tuning.trial_runs(session, study.id), key=lambda r: -r.id):
        key = ((run.info or {}).get("warm_start") or {}).get("key")
        if key:
            group = service.warm_group(RunConfig.model_validate(run.config))
            recorded.setdefault(str(group), []).append(str(key))
    out = []
    for group, cell in groups.items():
        packed = pack_entry(cfg.run_config(cell), recorded.get(group, []))
        out.append({"cell": asdict(cell), "entry": packed})  # None: this cache has none
    return out


def _run_entry(session: Session, run: Run) -> dict[str, Any]:
    updates = session.execute(
        select(Update.idx, Update.metrics, Update.alarm)
        .where(Update.run_id == run.id)
        .order_by(Update.idx)
    ).all()
    outcomes = session.execute(
        select(*(getattr(EvalOutcome, c) for c in OUTCOME))
        .where(EvalOutcome.run_id == run.id)
        .order_by(EvalOutcome.update_idx, EvalOutcome.deal)
    ).all()
    info = dict(run.info or {})
    info.pop("training_deals", None)  # carried on its own below
    if not info.get("init_weights_sha256"):  # a run recorded before runs kept it
        info["init_weights_sha256"] = _start_weights(session, run.id)
    return {
        **{f: getattr(run, f) for f in RUN_FIELDS},
        **{t: _iso(getattr(run, t)) for t in TIMES},
        "info": info,
        "id": run.id,
        "updates": [{"idx": i, "metrics": m, "alarm": a} for i, m, a in updates],
        "eval_outcomes": [list(o) for o in outcomes],
        "training_deals": sorted(training_deals(session, run)),
    }


def _start_weights(session: Session, run_id: int) -> str | None:
    """The hash of the weights a run started from, read from its init checkpoint's folder."""
    from shared.storage import CheckpointStore, checkpoint_store

    rel = session.scalar(
        select(Checkpoint.path).where(Checkpoint.run_id == run_id, Checkpoint.update_idx == -1)
    )
    if rel is None:
        return None
    folder = checkpoint_store().resolve(rel)
    if not folder.is_dir():
        return None
    return CheckpointStore.weights_digest(folder, folder.parent / "base")


def write_bundle(bundle: dict[str, Any], path: Path) -> None:
    """Gzip'd JSON (any other suffix than .gz: plain JSON), written whole or not at all."""
    # Key order kept: a study file's order of tasks and arms is the order its report shows.
    text = json.dumps(bundle, separators=(",", ":")).encode()
    data = gzip.compress(text, mtime=0) if path.suffix == ".gz" else text
    tmp = path.with_name(path.name + ".part")
    tmp.write_bytes(data)
    tmp.replace(path)


def read_bundle(path: Path, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """A bundle file, gzip'd or not, inflated in a stream up to ``max_bytes``; BundleError
    names what is wrong with it in one line."""
    raw = bytearray()
    try:
        with path.open("rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            with gzip.GzipFile(fileobj=f) if gz else f as stream:
                while len(raw) <= max_bytes and (chunk := stream.read(2**20)):
                    raw += chunk
    except FileNotFoundError:
        raise BundleError(f"bundle not found: {path}") from None
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise BundleError(f"{path} is not a study bundle (gzip'd JSON): {e}") from None
    except OSError as e:
        raise BundleError(f"cannot read {path}: {e.strerror or type(e).__name__}") from None
    if len(raw) > max_bytes:
        raise BundleError(
            f"{path} holds more than {max_bytes // 2**20} MiB of JSON: refused "
            "(gtr study import --max-mib raises the cap)"
        )
    if raw.count(b",") + raw.count(b"{") + raw.count(b"[") > MAX_VALUES:
        raise BundleError(f"{path} holds more than {MAX_VALUES:,} JSON values: refused")
    try:
        bundle = json.loads(raw, parse_float=_number, parse_int=_number, parse_constant=_constant)
    except RecursionError:
        raise BundleError(f"{path} nests deeper than {MAX_DEPTH} levels: refused") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise BundleError(f"{path} is not a study bundle (gzip'd JSON): {e}") from None
    problem = _unstorable(bundle)
    if problem:
        raise BundleError(f"{path}: {problem}: refused")
    if not isinstance(bundle, dict) or bundle.get("format") != FORMAT:
        raise BundleError(f"{path} is not a study bundle: no format {FORMAT!r}")
    if bundle.get("version") != VERSION:
        raise BundleError(
            f"{path} is a version {bundle.get('version')!r} bundle; this gtr reads version "
            f"{VERSION}"
        )
    return bundle


def _number(text: str) -> float | int:
    if not any(c in text for c in ".eE"):
        if len(text) > 20 or not -(2**63) <= int(text) < 2**63:  # a column's integer (seeds)
            raise ValueError(f"the integer {text[:30]} is out of range (64 bits)")
        return int(text)
    value = float(text)
    if not math.isfinite(value) or abs(value) > MAX_NUMBER:
        raise ValueError(f"the number {text[:30]} is out of range (|x| <= {MAX_NUMBER:g})")
    return value


def _constant(text: str) -> float:
    raise ValueError(f"{text} is not a number a bundle may hold")


def _unstorable(value: Any) -> str | None:
    """Nesting deeper than MAX_DEPTH or a NUL in a string or key (no store holds one)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= MAX_DEPTH:
                return f"it nests deeper than {MAX_DEPTH} levels"
            if isinstance(item, dict):
                if any("\x00" in k for k in item):
                    return "a key holds a NUL character"
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
        elif isinstance(item, str) and "\x00" in item:
            return "a text holds a NUL character"
    return None


def import_study(session: Session, bundle: dict[str, Any], team: str | None = None) -> Imported:
    """Write a bundle's study and runs into this store (see the module docstring), owned by
    ``team`` (the operator's choice; default the operator's team, never the bundle's). The
    study file and every run config pass the checks of a direct launch as that team."""
    try:
        head = bundle["study"]
        cfg = StudyConfig.model_validate(head["spec"])
        runs = list(bundle["runs"])
        created_at = _time(head.get("created_at"))
    except (KeyError, TypeError, ValidationError, ValueError) as e:
        raise BundleError(f"the bundle's study is not valid: {_first_line(e)}") from None
    team = team or OPERATOR_TEAM
    if len(team) > 100 or _control(team) or not team.strip():
        raise BundleError("the team must be 1 to 100 characters, none a control one")
    _check_launch(session, cfg, runs, team)
    _check_warm_starts(cfg, bundle.get("warm_starts") or [])
    try:
        stage = check_stage(cfg, bundle.get("tuning"))
    except CarryError as e:
        raise BundleError(f"the bundle's {e}") from None
    study = service.find_study(session, cfg.name, team)
    created = study is None
    if study is None:
        study = service.create_study(session, cfg, team)
        study.created_at = created_at or study.created_at
    elif study.status in service.ACTIVE:
        raise BundleError(
            f"study {study.id} ({study.name!r}) is {study.status} here: stop it before importing "
            "runs into it"
        )
    elif service.config_of(study).primary != cfg.primary:
        raise BundleError(
            f"study {study.id} ({study.name!r}) here is judged by "
            f"{service.config_of(study).primary.label()}, the bundle's by {cfg.primary.label()}"
        )
    taken = {
        (r.study_task, r.study_arm, r.study_seed, r.study_variant, r.study_attempt)
        for r in service.study_runs(session, study.id)
    }
    out = Imported(study.id, created, spec=cfg, tuning=stage)
    for entry in runs:
        try:
            if entry["status"] == "cancelled":  # an older export carried it: its cell trains
                out.stopped += 1
                continue
            key = tuple(entry[k] for k in RUN_FIELDS[-5:])
            if key in taken:
                out.skipped += 1
                continue
            out.added.append(_add_run(session, study, entry))
            taken.add(key)
        except (KeyError, TypeError, ValueError, OverflowError, StatementError) as e:
            where = entry.get("id", "?") if isinstance(entry, dict) else "?"
            raise BundleError(f"run {where} of the bundle: {_first_line(e)}") from None
    p = service.plan(session, study)
    out.waiting = len(p.pending) + len(p.retry) + len(p.rerun) + len(p.cancelled)
    # Nothing drives an imported study until someone resumes it: a study left queued would start
    # its missing cells on the full stack's controllers at once.
    study.status = "cancelled" if out.waiting else ("done" if p.done else "failed")
    study.updated_at = utcnow()
    return out


def _check_launch(session: Session, cfg: StudyConfig, runs: list[Any], team: str) -> None:
    """The study's cells and the bundle's run configs pass what a direct launch by ``team``
    passes (its corrector and key variable, model, checkpoint, games): a bundle cannot carry
    another team's checkpoint or corrector in, nor a path outside the allowed roots."""
    from services.controller.launch import Invalid
    from services.controller.launch_checks import check_launch
    from shared.schemas import RunConfig

    seen: set[str] = set()
    configs = [(c.describe(), cfg.run_config(c)) for c in cfg.cells()]
    for entry in runs:
        where = f"run {entry.get('id', '?')}" if isinstance(entry, dict) else "a run"
        try:
            configs.append((where, RunConfig.model_validate(entry["config"])))
        except (KeyError, TypeError, ValidationError) as e:
            raise BundleError(f"{where} of the bundle: config: {_first_line(e)}") from None
    for where, run_cfg in configs:
        key = run_cfg.model_dump_json(exclude={"name", "seed"})
        if key in seen:
            continue
        seen.add(key)
        try:
            check_launch(session, run_cfg, team)
        except Invalid as e:
            raise BundleError(f"{where}: {'.'.join(e.loc)}: {e.msg}") from None


def _carried(cfg: StudyConfig, warm: list[Any]) -> list[tuple[Cell, dict[str, Any] | None]]:
    """The bundle's warm starts as (cell, packed entry or None); BundleError for a malformed one."""
    cells = {*cfg.cells(), *tuning.tuning_cells(cfg)}
    out = []
    for i, item in enumerate(warm if isinstance(warm, list) else [warm]):
        try:
            cell = Cell(**item["cell"])
        except (KeyError, TypeError) as e:
            raise BundleError(f"warm start {i + 1} of the bundle: {_first_line(e)}") from None
        if cell not in cells:
            raise BundleError(f"warm start {i + 1} of the bundle is for no cell of the study")
        packed = item.get("entry")
        if packed is not None and not isinstance(packed, dict):
            raise BundleError(f"warm start {i + 1} of the bundle is not an entry")
        out.append((cell, packed))
    return out


def _check_warm_starts(cfg: StudyConfig, warm: list[Any]) -> None:
    """Refuse a bundle whose warm starts could not be filed whatever this machine is: a file
    outside its folder, bytes that are not base64, weights that do not match their hash."""
    carried = [(c, p) for c, p in _carried(cfg, warm) if p is not None]
    if not carried:
        return
    from services.trainer.warmcache import CarryRefused, unpack_files

    for cell, packed in carried:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                unpack_files(packed, Path(tmp))
            except CarryRefused as e:
                raise BundleError(
                    f"the warm start of {_seed_text(cell)} in the bundle: {e}"
                ) from None
            except (OSError, ValueError) as e:  # a name both a file and a folder, too long...
                raise BundleError(
                    f"the warm start of {_seed_text(cell)} in the bundle has a file it cannot "
                    f"hold ({type(e).__name__}: {e.strerror if isinstance(e, OSError) else e})"
                ) from None


def install_warm_starts(session: Session, bundle: dict[str, Any], study_id: int) -> list[str]:
    """File the bundle's warm starts that the study's unfinished cells here would use in this
    machine's cache (after import_study committed); one line per warm start saying what became
    of it, "warning: " first where the seed's next runs will build their own."""
    study = session.get(Study, study_id)
    if study is None:
        raise service.StudyNotFound(f"study {study_id}")
    cfg = service.config_of(study)
    carried = _carried(cfg, bundle.get("warm_starts") or [])
    wanted = unfinished_groups(session, study)
    if not carried and not wanted:
        return []
    from services.trainer.warmcache import CarryRefused, install_entry

    started = {  # the seeds whose finished runs started from a warm start
        service.warm_group(cfg.run_config(service.cell_of(r)))
        for r in _finished(session, study)
        if (r.info or {}).get("warm_start")
    }
    lines, seen = [], set()
    for cell, packed in carried:
        group = service.warm_group(cfg.run_config(cell))
        if group is None or group not in wanted:
            continue  # its cells have all finished here
        seen.add(group)
        what = f"the warm start of {_seed_text(cell)}"
        if packed is None:
            if group in started:  # else no run of the seed has started from a warm start yet
                lines.append(
                    f"warning: {what} was not in the exporting machine's cache: {_REBUILT}"
                )
            continue
        try:
            key = install_entry(cfg.run_config(cell), packed)
        except (CarryRefused, OSError) as e:
            lines.append(f"warning: {what} was not installed, {e}: {_REBUILT}")
            continue
        lines.append(f"{what} is in this cache ({key[:12]}): its seed's next runs reuse it")
    for group, cell in wanted.items():
        if group not in seen and group in started:
            lines.append(
                f"warning: the bundle carries no warm start of {_seed_text(cell)}: {_REBUILT}"
            )
    return lines


def _finished(session: Session, study: Study) -> list[Run]:
    return [r for r in service.study_runs(session, study.id) if r.status in FINISHED]


def stopped_runs(session: Session, study_id: int) -> list[int]:
    """The study's runs stopped before their end (cancelled), which a bundle does not carry."""
    return [r.id for r in service.study_runs(session, study_id) if r.status == "cancelled"]


_REBUILT = (
    "its seed's next runs build it again, and if that build differs (another machine), the "
    "seed's finished runs no longer compare like for like (`gtr study run` names them)"
)


def _seed_text(cell: Cell) -> str:
    return f"{cell.task} seed {cell.seed}"  # a tuning seed's: its task and (tuning) seed


def _add_run(session: Session, study: Study, entry: dict[str, Any]) -> int:
    if entry["status"] not in FINISHED:
        raise ValueError(f"status {entry['status']!r} is not a finished run's")
    for f, least, most in (("name", 1, 200), ("study_task", 1, 100), ("study_arm", 1, 100)):
        text = entry[f]
        if not isinstance(text, str) or not least <= len(text) <= most or _control(text):
            raise ValueError(f"{f} must be {least} to {most} characters, none a control one")
    variant = entry["study_variant"]
    if variant is not None and (
        not isinstance(variant, str) or len(variant) > 100 or _control(variant)
    ):
        raise ValueError("study_variant must be up to 100 characters, none a control one")
    info = dict(entry.get("info") or {})
    info["imported"] = {"from_run": entry["id"]}
    info["training_deals"] = [str(d) for d in entry.get("training_deals") or []]
    run = Run(
        **{f: entry[f] for f in RUN_FIELDS},
        **{t: _time(entry.get(t)) for t in TIMES},
        team=study.team,
        info=info,
        study_id=study.id,
    )
    session.add(run)
    session.flush()
    # Bulk inserts, not ORM objects: a 60-update run holds ~4,000 evaluation outcomes, and
    # building an object for each was most of the ~40 s that importing study v4's bundle took.
    updates = [
        {
            "run_id": run.id,
            "idx": int(u["idx"]),
            "metrics": dict(u["metrics"]),
            "alarm": bool(u["alarm"]),
        }
        for u in entry["updates"]
    ]
    outcomes = [
        {"run_id": run.id, **dict(zip(OUTCOME, row, strict=True))} for row in entry["eval_outcomes"]
    ]
    for model, rows in ((Update, updates), (EvalOutcome, outcomes)):
        if rows:  # an empty list would insert one row of defaults
            session.execute(insert(model), rows)
    return run.id


def _control(text: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def _iso(t: datetime | None) -> str | None:
    return None if t is None else t.isoformat()


def _time(text: Any) -> datetime | None:
    if text is None:
        return None
    try:
        return datetime.fromisoformat(str(text)[:64])
    except ValueError:
        raise ValueError(f"{str(text)[:40]!r} is not an ISO 8601 time") from None


def _first_line(e: Exception) -> str:
    if isinstance(e, KeyError):
        return f"no field {e.args[0]!r}"
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        return f"{'.'.join(str(p) for p in err['loc']) or 'study'}: {err['msg']}"
    if isinstance(e, StatementError):  # a value the column cannot hold: the driver's reason
        e = e.orig if isinstance(e.orig, Exception) else e
    return str(e).splitlines()[0] if str(e) else type(e).__name__
