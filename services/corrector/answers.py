"""Validation of a language-model corrector's JSON answer into a `Correction`.

Anything that does not fit the schema raises `CorrectorError("malformed")`: the step is recorded
as a failed correction and never becomes a training target.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from services.corrector.base import CorrectorError, thought_of
from services.corrector.prompts import NOT_DETERMINED
from shared.schemas import Correction

_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)


def _yes_no(value: Any) -> str:
    text = str(value).strip().upper()
    if text in ("YES", "TRUE"):
        return "YES"
    if text in ("NO", "FALSE"):
        return "NO"
    raise ValueError(f"expected YES or NO, got {str(value)[:40]!r}")


class Answer(BaseModel):
    model_config = ConfigDict(extra="allow")

    evaluation: str
    correction: dict[str, Any] | str | None = None
    possible_solution: str | None = None
    target_formula: str | None = None

    @field_validator("evaluation", "possible_solution", mode="before")
    @classmethod
    def _yes_no(cls, v: Any) -> str | None:
        return None if v is None else _yes_no(v)


def load_json_object(content: str) -> dict[str, Any]:
    """The answer's JSON object; code fences around it, or prose before and after it (a server
    without structured output), are tolerated."""
    match = _FENCE.match(content)
    try:
        value = json.loads(match.group(1) if match else content)
    except ValueError as e:
        value = _embedded_object(content)
        if value is None:
            raise CorrectorError("malformed", f"answer is not JSON ({e})", raw=content) from e
    if not isinstance(value, dict):
        raise CorrectorError("malformed", "answer is not a JSON object", raw=content)
    return value


def _embedded_object(text: str) -> dict[str, Any] | None:
    """The first JSON object in free text that has an "evaluation" key, if any."""
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start >= 0:
        try:
            value, _ = decoder.raw_decode(text, start)
        except ValueError:
            value = None
        if isinstance(value, dict) and "evaluation" in value:
            return value
        start = text.find("{", start + 1)
    return None


def answer_schema(task: str, thought_keys: list[str]) -> dict[str, Any]:
    """The JSON schema of the answer the prompt asks for, sent as structured output: servers
    that constrain decoding (llama.cpp grammars, vLLM guided decoding) then always parse."""
    from services.corrector.prompts import QUESTIONS

    answers = [f"answer{i + 1}" for i in range(len(QUESTIONS.get(task, [])))]
    # Bounded strings: a small model under a grammar otherwise rambles into max_tokens.
    props: dict[str, Any] = {a: {"type": "string", "maxLength": 300} for a in answers}
    props["evaluation"] = {"type": "string", "enum": ["YES", "NO"]}
    value = {"anyOf": [{"type": "string", "maxLength": 100}, {"type": "number"}]}
    thought = {
        "type": "object",
        "properties": {
            k: {"type": "string", "maxLength": 300} if k == "thoughts" else value
            for k in thought_keys
        },
        "required": list(thought_keys),
    }
    props["correction"] = {"anyOf": [{"type": "null"}, thought]}
    required = [*answers, "evaluation", "correction"]
    if task == "points24":
        props["possible_solution"] = {"type": "string", "enum": ["YES", "NO"]}
        props["target_formula"] = {"type": "string"}
        required += ["possible_solution", "target_formula"]
    return {"type": "object", "properties": props, "required": required}


def _corrected(correction: dict[str, Any] | str | None, keys: list[str], raw: str) -> str:
    """The corrected thought, keys in the agent's order, as a JSON string (no action)."""
    if isinstance(correction, str) and correction.strip().lower() not in ("", "none", "null"):
        try:
            correction = json.loads(correction)
        except ValueError:
            pass
    if not isinstance(correction, dict):
        raise CorrectorError(
            "malformed", "evaluation is NO but 'correction' is no JSON object", raw
        )
    missing = [k for k in keys if k not in correction]
    if missing:
        raise CorrectorError("malformed", f"correction lacks the keys {missing}", raw)
    if not isinstance(correction.get("thoughts", ""), str):
        raise CorrectorError("malformed", "'thoughts' in the correction is not a string", raw)
    return json.dumps(thought_of({k: correction[k] for k in keys}), ensure_ascii=False)


def to_correction(task: str, content: str, thought_keys: list[str]) -> Correction:
    """Validates the model's answer; `thought_keys` are the keys the corrected thought needs."""
    data = load_json_object(content)
    try:
        answer = Answer.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CorrectorError("malformed", f"{where}: {first['msg']}", raw=content) from e
    reasoning = "\n".join(f"{k}: {v}" for k, v in data.items() if k.startswith("answer"))
    extras: dict[str, Any] = {}
    if answer.target_formula and answer.target_formula.strip() != NOT_DETERMINED:
        extras["target_formula"] = answer.target_formula.strip()
    if task == "points24" and answer.possible_solution is not None:
        extras["possible_solution"] = answer.possible_solution == "YES"
    if answer.evaluation == "YES":
        return Correction(verdict="correct", extras=extras, reasoning=reasoning)
    if extras.get("possible_solution") is False:
        # GTR: nothing to teach when the deal has no solution; with corrector.feedback on, the
        # controller ends the episode (RolloutCollector.feedback).
        return Correction(verdict="incorrect", extras=extras, reasoning=reasoning)
    thought = _corrected(answer.correction, thought_keys, content)
    if isinstance(answer.correction, dict) and answer.correction.get("action") is not None:
        extras["action"] = str(answer.correction["action"])  # for the thought+action ablation
    return Correction(
        verdict="incorrect", corrected_thought=thought, extras=extras, reasoning=reasoning
    )
