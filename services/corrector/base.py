"""The corrector protocol: one call per agent step, `correct(request) -> Correction`.

Every corrector (oracle, OpenAI-compatible, remote HTTP) implements `Corrector`. A failure is
raised as `CorrectorError` carrying its kind and the raw answer, so it can be recorded and never
becomes a training target.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from shared.schemas import Correction, CorrectionRequest

FAILURE_KINDS = (
    "malformed",
    "transport",
    "budget",
    "circuit_open",
    "config",
    "input",
    "timeout",  # no answer came within the run's wait (written by the controller)
    "skipped",  # never sent: e.g. `skipped: backlog` (written by the controller)
)


class CorrectorError(RuntimeError):
    """A correction that could not be made; `kind` is one of FAILURE_KINDS."""

    def __init__(self, kind: str, reason: str, raw: str | None = None) -> None:
        super().__init__(f"{kind}: {reason}")
        self.kind = kind
        self.reason = reason
        self.raw = raw


class Spend(Protocol):
    """A budget of calls and tokens; every call attempt reserves a call before it is sent."""

    def charge_call(self) -> None: ...

    def add_tokens(self, n: int) -> None: ...


@dataclass
class CallTrace:
    """What one correction cost, filled in by the corrector even when it fails."""

    attempts: int = 0  # HTTP requests made (tool rounds and retries included)
    tokens: int = 0
    raw: str | None = None  # the last raw answer, kept for audits
    budget: Spend | None = None  # the run's budget, charged by every attempt and its tokens
    # Asked once a slot at the endpoint is free, before anything is sent: False = the step is
    # settled meanwhile (a timeout recorded it), so it is not sent at all.
    wanted: Callable[[], bool] | None = None
    slot: int = 0  # the ticket of the endpoint slot this correction holds


class Corrector(Protocol):
    def correct(self, req: CorrectionRequest, trace: CallTrace | None = None) -> Correction: ...


@runtime_checkable
class BatchCorrector(Corrector, Protocol):
    """A corrector that answers many steps in one call (a local model decoding them together).
    Item i of the answer is request i's correction, or the error that failed it alone."""

    def correct_many(
        self, reqs: list[CorrectionRequest], traces: list[CallTrace | None]
    ) -> list[Correction | CorrectorError]: ...


def parse_agent_output(text: str) -> dict[str, Any] | None:
    """The agent's output as a JSON object, or None when it is not one."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end <= start:
        return None
    try:
        value = json.loads(text[start : end + 1])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def thought_of(output: dict[str, Any]) -> dict[str, Any]:
    """The thought is the output JSON minus the action."""
    return {k: v for k, v in output.items() if k != "action"}


def dump_thought(thought: dict[str, Any]) -> str:
    return json.dumps(thought_of(thought), ensure_ascii=False)
