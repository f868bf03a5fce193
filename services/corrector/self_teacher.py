"""The self-teacher corrector (GTR-Turbo, SFT mode): the run's merged checkpoints write the thought.

``corrector.backend = "self_teacher"`` (recorded as corrector ``self_teacher``). For each step the
teacher (``services.trainer.teacher``: the warm start plus the TIES merge of the run's last k
checkpoints, re-merged every m updates) decodes greedily from the agent's own image and prompt.
Its output is judged like any corrector's answer: it must be a JSON object with the task's
thought keys (else the correction fails as ``malformed`` and never becomes a target); a thought
equal to the agent's is "correct", any other is "incorrect" with the teacher's thought as the
correction. ``extras`` record the teacher's checkpoint ids and update indices (the trace browser
shows them). It runs locally: no API call, no tokens billed, nothing charged to the run's budget.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from typing import Any

from services.corrector.base import CallTrace, CorrectorError, parse_agent_output, thought_of
from shared.schemas import SELF_TEACHER, Correction, CorrectionRequest, RunConfig

__all__ = ["SELF_TEACHER", "SelfTeacherCorrector", "judge"]


def judge(task: str, agent_output: str, teacher_output: str) -> tuple[str, dict[str, Any]]:
    """(verdict, the teacher's thought) — raises CorrectorError("malformed") on a bad answer."""
    from services.env.prompts import OUTPUT_KEYS

    teacher = parse_agent_output(teacher_output)
    if teacher is None:
        raise CorrectorError(
            "malformed", "the teacher's output is not a JSON object", teacher_output
        )
    keys = [k for k in OUTPUT_KEYS.get(task, ("thoughts", "action")) if k != "action"]
    missing = [k for k in keys if k not in teacher]
    if missing:
        raise CorrectorError(
            "malformed", f"the teacher's output lacks {', '.join(missing)}", teacher_output
        )
    thought = thought_of(teacher)
    agent = parse_agent_output(agent_output) or {}
    return ("correct" if thought_of(agent) == thought else "incorrect"), thought


class SelfTeacherCorrector:
    """One run's self-teacher; the merge is rebuilt when the run has new checkpoints."""

    def __init__(self, run_id: int, cfg: RunConfig) -> None:
        from services.trainer.teacher import TeacherCache

        self.run_id, self.task = run_id, cfg.task
        self.max_new_tokens = cfg.teacher.max_new_tokens or cfg.generation.max_new_tokens
        self.cache = TeacherCache(cfg.teacher)
        self._lock = threading.Lock()

    def teacher(self) -> tuple[Any, list[int], list[int]]:
        """The current teacher policy, its checkpoint ids and their update indices."""
        from services.trainer.teacher import run_checkpoints
        from shared.db.session import session_scope

        with self._lock:
            with session_scope() as s:
                refs = run_checkpoints(s, self.run_id)
            try:
                policy = self.cache.get(refs)
            except LookupError as e:
                raise CorrectorError("config", str(e)) from e
            return policy, list(self.cache.ids), list(self.cache.updates or [])

    def correct(self, req: CorrectionRequest, trace: CallTrace | None = None) -> Correction:
        from PIL import Image

        start = time.perf_counter()
        if not req.image_png_b64:
            raise CorrectorError("input", "the step has no observation image")
        image = Image.open(io.BytesIO(base64.b64decode(req.image_png_b64))).convert("RGB")
        policy, ids, updates = self.teacher()
        gen = policy.generate(
            [image], [req.prompt], greedy=True, max_new_tokens=self.max_new_tokens
        )
        text = gen[0].text
        if trace is not None:
            trace.raw = text  # kept for audits; attempts stay 0: nothing was called
        verdict, thought = judge(self.task, req.output, text)
        return Correction(
            verdict=verdict,  # type: ignore[arg-type]
            corrected_thought=json.dumps(thought, ensure_ascii=False)
            if verdict == "incorrect"
            else None,
            extras={
                "teacher_checkpoint_ids": ids,
                "teacher_updates": updates,
                "teacher_action": parse_agent_output(text).get("action"),  # type: ignore[union-attr]
            },
            reasoning=(
                f"{SELF_TEACHER}: TIES merge of the run's checkpoints of updates {updates}"
                if updates
                else f"{SELF_TEACHER}: the warm start (no trained checkpoint yet)"
            ),
            tokens=0,
            latency_ms=(time.perf_counter() - start) * 1000,
        )
