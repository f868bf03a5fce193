"""Dataset export: a run's steps as SFT-ready records (``gtr export``, the REST export).

A record is one step: its frame (PNG bytes), the prompt, the agent's output, its thought and
action, the corrector's verdict and corrected thought, the reward, and ``target``: the corrected
output with the agent's own action (what GTR's thought SFT clones), or None. Steps are read in
pages by id, so an export of millions of steps holds one page in memory.

Formats: ``jsonl`` (the frame as base64 PNG), ``parquet`` (the frame as Hugging Face's image
struct, with the ``datasets`` features in the schema metadata, so ``load_dataset("parquet")``
decodes it), ``hf`` (``Dataset.save_to_disk``; ``load_from_disk`` gives ``Image`` features).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.db.models import Correction, Run, Step
from shared.db.session import session_scope
from shared.storage import BlobNotFound, blob_store

Format = Literal["jsonl", "parquet", "hf"]
FORMATS: tuple[str, ...] = ("jsonl", "parquet", "hf")
PAGE = 200

# Column -> HF datasets feature type (the image separately: it is an Image feature).
COLUMNS: dict[str, str] = {
    "step_id": "int64",
    "run_id": "int64",
    "episode_id": "int64",
    "update_idx": "int32",
    "step_idx": "int32",
    "task": "string",
    "prompt": "string",
    "output": "string",
    "thought": "string",
    "action": "string",
    "parsed_action": "string",
    "format_valid": "bool",
    "action_valid": "bool",
    "reward": "float32",
    "done": "bool",
    "corrector": "string",
    "verdict": "string",
    "corrected_thought": "string",
    "target": "string",
}


@dataclass
class ExportFilter:
    """Which steps: like the step search (all fields optional)."""

    corrected: bool | None = None  # True: the corrector disagreed; False: it agreed or none ran
    verdict: str | None = None  # correct | incorrect
    update_from: int | None = None
    update_to: int | None = None
    format_valid: bool | None = None
    limit: int | None = None


def records(run_id: int, f: ExportFilter, images: bool = True) -> Iterator[dict[str, Any]]:
    """Every matching step of the run, in step order, one page of rows at a time."""
    with session_scope() as s:
        run = s.get(Run, run_id)
        if run is None:
            raise LookupError(f"run {run_id} does not exist")
        task = run.task
    blobs, after, sent = blob_store(), 0, 0
    while f.limit is None or sent < f.limit:
        with session_scope() as s:
            page = _page(s, run_id, f, after)
            rows = [(_record(task, step, corr), step.image_sha) for step, corr in page]
        if not rows:
            return
        for r, sha in rows:
            if images:
                r["image"] = _frame(blobs, sha)
            yield r
            sent += 1
            if f.limit is not None and sent >= f.limit:
                return
        after = rows[-1][0]["step_id"]


def _page(s: Session, run_id: int, f: ExportFilter, after: int) -> list[tuple[Step, Any]]:
    """A page of steps with the correction each is exported with (plain SQL: SQLite too)."""
    done = select(Correction.id).where(Correction.step_id == Step.id, Correction.status == "done")
    q = select(Step).where(Step.run_id == run_id, Step.id > after).order_by(Step.id).limit(PAGE)
    if f.update_from is not None:
        q = q.where(Step.update_idx >= f.update_from)
    if f.update_to is not None:
        q = q.where(Step.update_idx <= f.update_to)
    if f.format_valid is not None:
        q = q.where(Step.format_valid.is_(f.format_valid))
    disagreed = done.where(Correction.verdict == "incorrect").exists()
    if f.corrected is True:
        q = q.where(disagreed)
    elif f.corrected is False:
        q = q.where(~disagreed)
    if f.verdict is not None:
        q = q.where(done.where(Correction.verdict == f.verdict).exists())
    steps = s.scalars(q).all()
    by_step: dict[int, Correction] = {}
    ids = [st.id for st in steps]
    rows = (
        s.scalars(
            select(Correction)
            .where(Correction.step_id.in_(ids), Correction.status == "done")
            .order_by(Correction.id)
        ).all()
        if ids
        else []
    )
    for c in rows:  # a disagreement (it has a corrected thought) wins, then the latest
        kept = by_step.get(c.step_id)
        if kept is None or c.verdict == "incorrect" or kept.verdict != "incorrect":
            by_step[c.step_id] = c
    return [(st, by_step.get(st.id)) for st in steps]


def _record(task: str, step: Step, c: Correction | None) -> dict[str, Any]:
    verdict = c.verdict if c is not None else None
    corrected = c.corrected_thought if c is not None else None
    return {
        "step_id": step.id,
        "run_id": step.run_id,
        "episode_id": step.episode_id,
        "update_idx": step.update_idx,
        "step_idx": step.idx,
        "task": task,
        "prompt": step.prompt,
        "output": step.output,
        "thought": step.thought,
        "action": step.action_text,
        "parsed_action": step.parsed_action,
        "format_valid": step.format_valid,
        "action_valid": step.action_valid,
        "reward": step.reward,
        "done": step.done,
        "corrector": c.corrector if c is not None else None,
        "verdict": verdict,
        "corrected_thought": corrected,
        "target": _target(corrected, step.action_text) if verdict == "incorrect" else None,
    }


def _target(corrected: str | None, action: str | None) -> str | None:
    """The SFT target GTR trains on: corrected fields + the agent's action (None if unusable)."""
    from services.trainer.buffer import build_target

    try:
        return build_target(corrected or "", action or "")[0]
    except (ValueError, TypeError):
        return None


def _frame(blobs: Any, sha: str | None) -> bytes | None:
    if not sha:
        return None
    try:
        return bytes(blobs.get(sha))
    except BlobNotFound:
        return None


# ---- writers ------------------------------------------------------------------------------


def jsonl_lines(recs: Iterator[dict[str, Any]]) -> Iterator[bytes]:
    """One JSON object a line; the frame as ``image_png_b64``."""
    for r in recs:
        img = r.pop("image", None)
        r["image_png_b64"] = base64.b64encode(img).decode() if img else None
        yield (json.dumps(r, ensure_ascii=False) + "\n").encode()


def hf_features() -> Any:
    from datasets import Features, Image, Value

    return Features({**{k: Value(t) for k, t in COLUMNS.items()}, "image": Image()})


def _hf_row(r: dict[str, Any]) -> dict[str, Any]:
    img = r.get("image")
    return {**r, "image": {"bytes": img, "path": None} if img else None}


def write_parquet(recs: Iterator[dict[str, Any]], out: Path, batch: int = 256) -> int:
    """Row groups of ``batch`` steps; HF features in the schema so ``datasets`` decodes images."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    features = hf_features()
    schema = features.arrow_schema
    n, rows = 0, []
    with pq.ParquetWriter(str(out), schema) as writer:
        for r in recs:
            rows.append(_hf_row(r))
            if len(rows) >= batch:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                n, rows = n + len(rows), []
        if rows or n == 0:
            writer.write_table(pa.Table.from_pylist(rows, schema=schema))
            n += len(rows)
    return n


def write_hf(recs: Iterator[dict[str, Any]], out: Path) -> int:
    """Parquet first (streamed, bounded memory), then ``save_to_disk``; the build cache lives
    in a temporary folder, not ~/.cache."""
    import tempfile

    from datasets import Dataset

    with tempfile.TemporaryDirectory(prefix="gtr-export-") as tmp:
        part = Path(tmp) / "steps.parquet"
        write_parquet(recs, part)
        ds = Dataset.from_parquet(str(part), features=hf_features(), cache_dir=tmp)
        assert isinstance(ds, Dataset)
        ds.save_to_disk(str(out))
        return len(ds)


def export(run_id: int, fmt: Format, out: Path, f: ExportFilter) -> int:
    """Write the run's matching steps to ``out``; returns how many."""
    recs = records(run_id, f)
    if fmt == "jsonl":
        n = 0
        with open(out, "wb") as fh:
            for line in jsonl_lines(recs):
                fh.write(line)
                n += 1
        return n
    if fmt == "parquet":
        return write_parquet(recs, out)
    return write_hf(recs, out)
