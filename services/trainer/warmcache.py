"""Warm-start cache: a run whose warm start was already paid reuses its result in seconds.

A warm start (vision warm-up + oracle SFT) is a pure function of the base model, the task and
its env settings (less the training loop's early-truncation rule: ``warm_env``), the ``[init]``
recipe, the seed and the code of the recipe: the cache keys an entry by the sha256 of exactly
those (``warm_start_key``). An entry is a folder
``<cache>/warmstart/<key>/`` holding ``model/`` (a policy checkpoint under full fine-tuning or
a LoRA warm start, the fine-tuned HF model folder under LoRA otherwise) and ``meta.json`` (the
key's inputs, the stage metrics, the seconds the warm start took). Entries are written to a
temporary folder and renamed, so two runs warming up at once never see half of one.
"""

from __future__ import annotations

import base64
import hashlib
import inspect
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

from shared.schemas import RunConfig
from shared.settings import get_settings
from shared.storage import CheckpointStore
from shared.warmenv import warm_env

if TYPE_CHECKING:
    from services.policy.service import Policy

log = logging.getLogger(__name__)

# Bump when something the recipe depends on outside warmstart.py changes its result (the env
# renderers, the expert's outputs, the tiny model builder).
RECIPE_VERSION = 1
META = "meta.json"
# Base-model files up to this size are hashed whole (a tiny model's weights among them, so its
# entries outlive a rebuild of it); larger ones by size and mtime, read once per run start.
SMALL_FILE = 256 << 20


@dataclass
class WarmStartInfo:
    """What the run record shows: whether the warm start came from the cache, and its key."""

    reused: bool
    key: str
    seconds: float
    built_seconds: float  # what the warm start cost when it was built

    def as_dict(self) -> dict[str, Any]:
        return {
            "reused": self.reused,
            "key": self.key,
            "seconds": round(self.seconds, 3),
            "built_seconds": round(self.built_seconds, 3),
        }


def cache_root() -> Path:
    return get_settings().cache_path / "warmstart"


def recipe_code_version() -> str:
    """sha256 of the warm-start module's source and RECIPE_VERSION: editing the recipe's code
    invalidates every entry built by the old one."""
    from services.trainer import warmstart

    src = inspect.getsource(warmstart)
    return hashlib.sha256(f"{RECIPE_VERSION}\n{src}".encode()).hexdigest()


def model_fingerprint(base: Path) -> str:
    """The base model folder: files up to SMALL_FILE by content, larger ones by name, size and
    mtime (hashing a 15 GB checkpoint at every run start would cost more than it saves)."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(base).rglob("*") if p.is_file()):
        st = f.stat()
        h.update(str(f.relative_to(base)).encode())
        if st.st_size <= SMALL_FILE:
            h.update(f.read_bytes())
        else:
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def key_inputs(cfg: RunConfig, base: Path) -> dict[str, Any]:
    """Everything that determines a warm start's weights."""
    import torch
    import transformers

    recipe = cfg.init.model_dump(mode="json", exclude={"kind", "checkpoint", "cache"})
    return {
        "model": cfg.model.model_dump(mode="json"),
        "base_model": model_fingerprint(base),
        "task": cfg.task,
        "env": warm_env(cfg.env).model_dump(mode="json"),
        "recipe": recipe,
        "seed": cfg.seed,
        "code": recipe_code_version(),
        "libs": {"torch": torch.__version__, "transformers": transformers.__version__},
    }


def warm_start_key(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _entry(cfg: RunConfig) -> tuple[str, dict[str, Any], Path]:
    from services.trainer.warmstart import base_model_path

    inputs = key_inputs(cfg, base_model_path(cfg.model, cfg.task))
    key = warm_start_key(inputs)
    return key, inputs, cache_root() / key


def _policy_entry(cfg: RunConfig) -> bool:
    """The entry is a policy checkpoint on the untouched base (full fine-tuning, or a LoRA warm
    start: ``init.finetune = "lora"``), else the fine-tuned HF model the run's LoRA sits on."""
    return cfg.model.finetune == "full" or cfg.init.finetune == "lora"


def _enabled(cfg: RunConfig) -> bool:
    return cfg.init.kind == "warm_start" and cfg.init.cache and get_settings().warmstart_cache


def reuse_checkpoint(cfg: RunConfig, dest: Path) -> WarmStartInfo | None:
    """A policy-checkpoint entry (``_policy_entry``): a cached warm start becomes the run's init
    checkpoint ``dest`` as hard links (copies across file systems), with no model built; None
    when there is none to reuse."""
    if not _policy_entry(cfg) or not _enabled(cfg):
        return None
    started = time.monotonic()
    key, _, entry = _entry(cfg)
    if not (entry / META).is_file():
        return None
    meta = json.loads((entry / META).read_text())
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    try:
        _copy_tree(entry / "model", tmp)
        if dest.exists():
            shutil.rmtree(dest)
        tmp.rename(dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        log.exception("warm-start cache entry %s could not be linked: warming up", key[:12])
        return None
    seconds = time.monotonic() - started
    log.info("warm start reused from the cache (%s, %.1f s)", key[:12], seconds)
    return WarmStartInfo(True, key, seconds, float(meta.get("seconds", 0.0)))


def cached_init_policy(
    cfg: RunConfig, base_dir: Path, eval_episodes: int = 0
) -> tuple[Any, dict[str, float], WarmStartInfo | None]:
    """``init_policy`` through the cache; the info is None when no warm start was asked for or
    the cache is off (``init.cache = false``, ``GTR_WARMSTART_CACHE=0``)."""
    from services.trainer.warmstart import base_model_path, init_policy

    if not _enabled(cfg):
        policy, summary = init_policy(cfg, base_dir, eval_episodes)
        return policy, summary, None
    base = base_model_path(cfg.model, cfg.task)
    started = time.monotonic()
    key, inputs, entry = _entry(cfg)
    if (entry / META).is_file():
        try:
            policy, meta = _load(cfg, entry, base, base_dir)
        except Exception:  # a damaged entry is rebuilt, never trusted
            log.exception("warm-start cache entry %s is unusable: rebuilding it", key[:12])
        else:
            seconds = time.monotonic() - started
            log.info("warm start reused from the cache (%s, %.1f s)", key[:12], seconds)
            info = WarmStartInfo(True, key, seconds, float(meta.get("seconds", 0.0)))
            return policy, dict(meta.get("summary", {})), info
    policy, summary = init_policy(cfg, base_dir, eval_episodes)
    seconds = time.monotonic() - started
    try:
        _store(cfg, policy, base_dir, entry, inputs, summary, seconds)
    except OSError:  # a full disk costs the next run its reuse, not this run
        log.exception("could not write warm-start cache entry %s", key[:12])
    return policy, summary, WarmStartInfo(False, key, seconds, seconds)


def _load(cfg: RunConfig, entry: Path, base: Path, base_dir: Path) -> tuple[Any, dict]:
    from services.policy.service import Policy

    meta = json.loads((entry / META).read_text())
    model = entry / "model"
    if _policy_entry(cfg):
        policy = Policy.from_config(cfg.model, base, seed=cfg.seed)
        policy.load_weights(model)
        return policy, meta
    # LoRA: the warm-started HF model is the run's own base; a copy in the run's folder keeps
    # the run's checkpoints valid after `gtr cache rm`.
    _copy_tree(model, base_dir)
    return Policy.from_config(cfg.model, base_dir, seed=cfg.seed), meta


def _store(
    cfg: RunConfig,
    policy: Policy,
    base_dir: Path,
    entry: Path,
    inputs: dict[str, Any],
    summary: dict[str, float],
    seconds: float,
) -> None:
    def fill(model: Path) -> None:
        if _policy_entry(cfg):
            policy.save(model)
        else:
            _copy_tree(base_dir, model)

    _write_entry(cfg, entry, fill, {"inputs": inputs, "summary": summary, "seconds": seconds})


def _write_entry(
    cfg: RunConfig, entry: Path, fill: Callable[[Path], None], meta: dict[str, Any]
) -> None:
    """Write an entry whole: ``fill`` writes its model folder, then meta.json, in a temporary
    folder renamed into place; a concurrent run that stored the same key first wins."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name[:12]}-"))
    try:
        fill(tmp / "model")
        meta = {**meta, "task": cfg.task, "name": cfg.name, "created_at": time.time()}
        (tmp / META).write_text(json.dumps(meta, indent=2, sort_keys=True))
        os.rename(tmp, entry)  # atomic; fails when a concurrent run stored the same key first
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (isinstance(e, OSError) and (entry / META).is_file()):
            raise


def _copy_tree(src: Path, dst: Path) -> None:
    """Hard links where the file system allows (instant, no extra space), else copies."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).rglob("*"):
        target = dst / f.relative_to(src)
        if f.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            target.unlink()
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)


# ---- gtr cache ls | rm --------------------------------------------------------------------


@dataclass
class Entry:
    key: str
    task: str
    name: str
    size_bytes: int
    created_at: float
    seconds: float


def list_entries() -> list[Entry]:
    root = cache_root()
    out = []
    for d in sorted(root.iterdir()) if root.is_dir() else []:
        if d.name.startswith(".") or not (d / META).is_file():
            continue
        try:
            meta = json.loads((d / META).read_text())
        except (OSError, ValueError):
            meta = {}
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        out.append(
            Entry(
                d.name,
                str(meta.get("task", "?")),
                str(meta.get("name", "?")),
                size,
                float(meta.get("created_at", 0.0)),
                float(meta.get("seconds", 0.0)),
            )
        )
    return out


def remove_entries(prefix: str | None) -> list[str]:
    """Remove the entries whose key starts with ``prefix`` (all when None)."""
    gone = []
    for e in list_entries():
        if prefix is None or e.key.startswith(prefix):
            shutil.rmtree(cache_root() / e.key, ignore_errors=True)
            gone.append(e.key)
    return gone


# ---- carrying an entry to another machine (a study bundle) ---------------------------------
# A study that spans sessions must start a seed's later runs from the weights its earlier runs
# started from. Rebuilding a warm start elsewhere does not give them back bit for bit (another
# CPU sums in another order), so a study bundle carries the entries its unfinished cells need.
# The key stays this machine's own (it fingerprints large base-model files by mtime): a packed
# entry carries its key's inputs and the base model by content, and is filed under the key the
# importing machine computes, once every input agrees.


class CarryRefused(ValueError):
    """A carried entry that this machine cannot use; the message says why in one line."""


def pack_entry(cfg: RunConfig, keys: Sequence[str] = ()) -> dict[str, Any] | None:
    """A cache entry for ``cfg`` as JSON-ready data (files in base64): the first of ``keys``
    (those runs recorded) this cache holds that was built from ``cfg``'s inputs (its key may
    predate a change of the base model's mtime or of how the key reads it), else the entry
    under the key ``cfg`` has now; None when this cache holds none."""
    from services.trainer.warmstart import base_model_path

    if not _enabled(cfg):
        return None
    base = base_model_path(cfg.model, cfg.task)
    key, inputs, entry = _entry(cfg)
    ours = {k: v for k, v in inputs.items() if k != "base_model"}
    for recorded in keys:
        there = cache_root() / recorded
        try:
            built = json.loads((there / META).read_text())["inputs"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if {k: v for k, v in built.items() if k != "base_model"} == ours:
            entry = there
            break
    if not (entry / META).is_file():
        return None
    meta = json.loads((entry / META).read_text())
    model = entry / "model"
    return {
        "inputs": ours,
        "base_model_sha256": CheckpointStore.digest(base)[1],
        "weights_sha256": CheckpointStore.weights_digest(model),
        "seconds": float(meta.get("seconds", 0.0)),
        "summary": meta.get("summary", {}),
        "files": {
            str(f.relative_to(model)): base64.b64encode(f.read_bytes()).decode()
            for f in sorted(model.rglob("*"))
            if f.is_file()
        },
    }


def unpack_files(packed: dict[str, Any], dest: Path) -> None:
    """Write a packed entry's files under ``dest`` and check them against the weights' hash.
    Raises CarryRefused for a path outside ``dest``, bytes that are not base64 or weights that
    are not the ones packed."""
    files = packed.get("files")
    if not isinstance(files, dict) or not files:
        raise CarryRefused("it holds no files")
    for name, data in files.items():
        rel = PurePosixPath(str(name))
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise CarryRefused(f"it names a file outside its folder: {str(name)[:80]!r}")
        try:
            raw = base64.b64decode(str(data), validate=True)
        except ValueError:
            raise CarryRefused(f"its file {str(name)[:80]!r} is not base64") from None
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(raw)
    if CheckpointStore.weights_digest(dest) != packed.get("weights_sha256"):
        raise CarryRefused("its weights are not the ones it was packed with (damaged)")


def install_entry(cfg: RunConfig, packed: dict[str, Any]) -> str:
    """File a packed entry in this cache under the key ``cfg`` has here; returns the key.

    Raises CarryRefused when this machine would build another warm start for ``cfg`` (other
    recipe code, libraries, settings or base model), or when the cache already holds another
    one for it: an entry is never overwritten."""
    from services.trainer.warmstart import base_model_path

    if not _enabled(cfg):
        raise CarryRefused("this run config or machine does not cache warm starts")
    base = base_model_path(cfg.model, cfg.task)
    key, inputs, entry = _entry(cfg)
    ours = {k: v for k, v in inputs.items() if k != "base_model"}
    theirs = packed.get("inputs")
    if not isinstance(theirs, dict):
        raise CarryRefused("it does not say what it was built from")
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if differ:
        raise CarryRefused(
            f"it was built with other {', '.join(_INPUT_NAMES.get(k, k) for k in differ)}"
        )
    if CheckpointStore.digest(base)[1] != packed.get("base_model_sha256"):
        raise CarryRefused(f"it was built from another base model than {base}")
    if (entry / META).is_file():
        if CheckpointStore.weights_digest(entry / "model") == packed.get("weights_sha256"):
            return key  # already here, e.g. a bundle imported twice
        raise CarryRefused(
            f"this cache holds another warm start for it ({key[:12]}); `gtr cache rm "
            f"{key[:12]}` first to take the carried one"
        )

    def fill(model: Path) -> None:
        unpack_files(packed, model)
        _rebase(model, base)

    meta = {
        "inputs": inputs,
        "summary": packed.get("summary", {}),
        "seconds": float(packed.get("seconds", 0.0)),
        "carried": True,
    }
    _write_entry(cfg, entry, fill, meta)
    return key


_INPUT_NAMES = {"code": "warm-start code", "libs": "library versions", "env": "env settings"}


def _rebase(model: Path, base: Path) -> None:
    """A full fine-tuning checkpoint names its base model's folder (policy.json): name this
    machine's, as an entry built here would."""
    meta_file = model / "policy.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        if "base_model" in meta:
            meta["base_model"] = str(base)
            meta_file.write_text(json.dumps(meta, indent=2))
