"""The self-teacher of GTR-Turbo: the run's own latest checkpoints, TIES-merged, as a policy.

The teacher is the warm start (the run's checkpoint −1) plus the TIES merge of the deltas of
every trained checkpoint so far (``teacher.merge = "running"``, as GTR-Turbo's authors keep a
running merge), or of only the last ``teacher.keep_last`` (``"last_k"``: a teacher that sits close
to the agent). The newest ``teacher.lag`` checkpoints (the acting policy first) are left out,
so the current policy is not part of its own teacher (``lag = 0``: GTR-Turbo's code, where it
is). It is re-merged once the newest checkpoint is ``teacher.merge_every`` updates past the
newest one merged. Before the first trained checkpoint
it is the warm start itself. Full fine-tuning merges the state dicts (``merging.ties_merge``);
LoRA merges the adapters with peft's own ``add_weighted_adapter`` (``teacher.lora_merge``:
``ties`` on the A/B factors as GTR-Turbo's code does, or ``ties_svd`` on the deltas B·A).
The teacher is a policy checkpoint, so it is loaded here beside the policy's checkpoints: the
trainer (KL mode) and the corrector worker (SFT mode) both hold one in a ``TeacherCache``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from sqlalchemy import select
from sqlalchemy.orm import Session

from shared.schemas import TeacherConfig

if TYPE_CHECKING:
    from services.policy.service import Policy

log = logging.getLogger(__name__)
TEACHER_ADAPTER = "self_teacher"


class CheckpointRef(NamedTuple):
    id: int  # checkpoints.id (shown with each correction)
    update_idx: int  # −1 = the warm start
    path: Path


def pick_checkpoints(
    available: Sequence[int],
    current: Sequence[int] | None,
    keep_last: int | None,
    merge_every: int,
) -> list[int]:
    """Update indices to merge: the newest ``keep_last`` trained ones (update ≥ 0; None = all),
    kept as they are until the newest available is ``merge_every`` updates past the newest
    merged."""
    trained = sorted(u for u in set(available) if u >= 0)
    if not trained:
        return []
    if current and trained[-1] - max(current) < merge_every:
        return list(current)
    return trained if keep_last is None else trained[-keep_last:]


def run_checkpoints(
    session: Session, run_id: int, before: int | None = None
) -> list[CheckpointRef]:
    """The run's checkpoints (update_idx < ``before`` when given), oldest first."""
    from shared.db.models import Checkpoint
    from shared.storage import checkpoint_store

    query = select(Checkpoint).where(Checkpoint.run_id == run_id)
    if before is not None:
        query = query.where(Checkpoint.update_idx < before)
    rows = session.scalars(query.order_by(Checkpoint.update_idx)).all()
    store = checkpoint_store()
    return [CheckpointRef(r.id, r.update_idx, store.resolve(r.path)) for r in rows]


class TeacherCache:
    """One merged teacher, rebuilt only when the checkpoints to merge change."""

    def __init__(self, cfg: TeacherConfig) -> None:
        self.cfg = cfg
        self.policy: Policy | None = None
        self.updates: list[int] | None = None  # update indices merged into self.policy
        self.ids: list[int] = []  # their checkpoint ids

    def get(self, refs: Sequence[CheckpointRef]) -> Policy:
        """The teacher for these checkpoints of a run (the warm start, −1, must be among them)."""
        by_update = {r.update_idx: r for r in refs}
        if -1 not in by_update:
            raise LookupError("the run has no warm-start checkpoint (-1) yet")
        newest = max(by_update)
        if self.cfg.lag and newest >= 0:  # the acting policy (and lag - 1 before it) left out
            by_update = {u: r for u, r in by_update.items() if u < 0 or u <= newest - self.cfg.lag}
        keep = None if self.cfg.merge == "running" else self.cfg.keep_last
        want = pick_checkpoints(list(by_update), self.updates, keep, self.cfg.merge_every)
        if self.policy is None or want != self.updates:
            log.info("self-teacher: merging checkpoints of updates %s", want)
            self.policy = build_teacher(
                by_update[-1].path, [by_update[u].path for u in want], self.cfg, self.policy
            )
            self.updates, self.ids = want, [by_update[u].id for u in want]
        return self.policy


def build_teacher(
    base_dir: Path,
    checkpoint_dirs: Sequence[Path],
    cfg: TeacherConfig,
    current: Policy | None = None,
) -> Policy:
    """The warm start (``base_dir``) plus the TIES merge of the checkpoints' deltas, frozen.

    ``current``: a teacher built before on the same base, reused instead of loading it again."""
    from services.policy.service import policy_for_checkpoint

    if current is not None and current.lora is not None:
        _drop_teacher_adapter(current)
    policy = policy_for_checkpoint(current, base_dir)  # back to the warm start's weights
    if checkpoint_dirs:
        if policy.lora is not None:
            _merge_lora(policy, checkpoint_dirs, cfg)
        else:
            _merge_full(policy, base_dir, checkpoint_dirs, cfg)
    for p in policy.model.parameters():
        p.requires_grad_(False)
    policy.model.eval()
    return policy


def _merge_full(policy: Policy, base_dir: Path, dirs: Sequence[Path], cfg: TeacherConfig) -> None:
    from safetensors.torch import load_file

    from services.policy.checkpoint import FULL
    from services.policy.merging import ties_merge

    base = load_file(str(base_dir / FULL))
    merged = ties_merge(base, [load_file(str(d / FULL)) for d in dirs], cfg.density, cfg.sign_rule)
    result = policy.model.load_state_dict(merged, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"merged weights do not fit the model: {result.unexpected_keys[:3]}")


def _merge_lora(policy: Policy, dirs: Sequence[Path], cfg: TeacherConfig) -> None:
    model = policy.model
    names = []
    for i, d in enumerate(dirs):
        names.append(f"{TEACHER_ADAPTER}_ck{i}")
        model.load_adapter(str(d), adapter_name=names[-1])
    # Weight 1 each: TIES's disjoint mean of the agreeing deltas (peft multiplies the trimmed
    # deltas by their weights before the mean). One adapter is copied as is (peft: "linear").
    model.add_weighted_adapter(
        names,
        [1.0] * len(names),
        TEACHER_ADAPTER,
        combination_type=cfg.lora_merge,
        density=cfg.density,
        majority_sign_method=cfg.sign_rule,
    )
    model.set_adapter(TEACHER_ADAPTER)
    for name in names:
        model.delete_adapter(name)


def _drop_teacher_adapter(policy: Policy) -> None:
    model = policy.model
    if TEACHER_ADAPTER in model.peft_config:
        model.set_adapter("default")
        model.delete_adapter(TEACHER_ADAPTER)
