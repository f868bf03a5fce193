"""The self-teacher corrector (GTR-Turbo, SFT mode): the run's merged checkpoints write the thought.

``corrector.backend = "self_teacher"`` (recorded as corrector ``self_teacher``). For each step the
teacher (``services.policy.teacher``: the warm start plus the TIES merge of the run's last k
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
        from services.policy.teacher import TeacherCache

        self.run_id, self.task = run_id, cfg.task
        self.max_new_tokens = cfg.teacher.max_new_tokens or cfg.generation.max_new_tokens
        self.cache = TeacherCache(cfg.teacher)
        self._lock = threading.Lock()

    def teacher(self) -> tuple[Any, list[int], list[int]]:
        """The current teacher policy, its checkpoint ids and their update indices."""
        from services.policy.teacher import run_checkpoints
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
        result = self.correct_many([req], [trace])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def correct_many(
        self, reqs: list[CorrectionRequest], traces: list[CallTrace | None]
    ) -> list[Correction | CorrectorError]:
        """Every request's correction, or why it failed, from one batched greedy decode.

        A rollout step sends one request per env: decoding them together costs about what one
        decode costs on a small model (``docs/benchmarks.md``, policy batching). Each
        correction's ``latency_ms`` is its share of the batch's time (the compute it took)."""
        from PIL import Image

        start = time.perf_counter()
        results: list[Correction | CorrectorError] = [
            CorrectorError("input", "the step has no observation image") for _ in reqs
        ]
        todo = [i for i, r in enumerate(reqs) if r.image_png_b64]
        if not todo:
            return results
        images = [
            Image.open(io.BytesIO(base64.b64decode(reqs[i].image_png_b64 or ""))).convert("RGB")
            for i in todo
        ]
        policy, ids, updates = self.teacher()
        gens = policy.generate(
            images,
            [reqs[i].prompt for i in todo],
            greedy=True,
            max_new_tokens=self.max_new_tokens,
        )
        share_ms = (time.perf_counter() - start) * 1000 / len(todo)
        reasoning = (
            f"{SELF_TEACHER}: TIES merge of the run's checkpoints of updates {updates}"
            if updates
            else f"{SELF_TEACHER}: the warm start (no trained checkpoint yet)"
        )
        for i, gen in zip(todo, gens, strict=True):
            trace = traces[i]
            if trace is not None:
                trace.raw = gen.text  # kept for audits; attempts stay 0: nothing was called
            try:
                verdict, thought = judge(self.task, reqs[i].output, gen.text)
            except CorrectorError as e:
                results[i] = e
                continue
            results[i] = Correction(
                verdict=verdict,  # type: ignore[arg-type]
                corrected_thought=json.dumps(thought, ensure_ascii=False)
                if verdict == "incorrect"
                else None,
                extras={
                    "teacher_checkpoint_ids": ids,
                    "teacher_updates": updates,
                    "teacher_action": parse_agent_output(gen.text).get("action"),  # type: ignore[union-attr]
                },
                reasoning=reasoning,
                tokens=0,
                latency_ms=share_ms,
            )
        return results
