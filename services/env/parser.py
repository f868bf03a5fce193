"""The agent's output: a JSON object with the task's keys, ``thoughts`` and ``action``.

Format validity (the whole text is a JSON object with every required key) and action validity
(one legal action can be read) are reported separately. When the JSON does not parse, the
action is read the reference way (``rl_utils.text_projection``): lower-case, keep the text from
``"action":`` on (or only the last character when that key is missing), take '10' first on the
points games, and accept the action only if exactly one action name occurs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedOutput:
    """What was read from one agent output."""

    thought: str | None  # the output JSON minus "action", as a string; None when not a JSON object
    action_text: (
        str | None
    )  # the raw action as written (the JSON value, or the text after "action":)
    action: int | None  # index into action_names; None when no single legal action was found
    format_valid: bool  # a JSON object with every required key
    action_valid: bool  # action is not None
    fields: dict[str, Any] = field(default_factory=dict)  # the parsed JSON object, or {}


def _load_object(text: str) -> dict[str, Any] | None:
    try:
        obj = json.loads(text.strip())
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def project(text: str, action_names: list[str], points: bool) -> int | None:
    """The reference keyword projection: the single action name found in ``text``, else None."""
    s = text.lower()
    s = s[s.find('"action":') :]  # find() == -1 keeps only the last character, as the reference
    found: set[str] = set()
    if points and "10" in s:
        found.add("10")
        s = s.replace("10", "")
    found.update(a for a in action_names if a in s)
    return action_names.index(found.pop()) if len(found) == 1 else None


def _match_value(value: str, action_names: list[str], points: bool) -> int | None:
    exact = {a.lower(): i for i, a in enumerate(action_names)}
    key = value.strip().lower()
    if key in exact:
        return exact[key]
    return project('"action":' + key, action_names, points)


def parse_output(
    text: str, action_names: list[str], required_keys: tuple[str, ...], points: bool = False
) -> ParsedOutput:
    """Read an agent output; never raises."""
    if not isinstance(text, str):
        return ParsedOutput(None, None, None, False, False)
    obj = _load_object(text)
    if obj is None:
        at = text.lower().find('"action":')
        raw = text[at + len('"action":') :].strip() if at >= 0 else text[-1:]
        action = project(text, action_names, points)
        return ParsedOutput(None, raw or None, action, False, action is not None)
    # Characters as written (no \uXXXX escapes), as corrected thoughts are stored: PostgreSQL's
    # text search reads the stored text as it is, so an escaped "café" would not match "café".
    thought = json.dumps({k: v for k, v in obj.items() if k != "action"}, ensure_ascii=False)
    value = obj.get("action")
    has_action = isinstance(value, str | int | float) and not isinstance(value, bool)
    action = _match_value(str(value), action_names, points) if has_action else None
    format_valid = has_action and all(k in obj for k in required_keys)
    return ParsedOutput(
        thought=thought,
        action_text=str(value) if has_action else None,
        action=action,
        format_valid=format_valid,
        action_valid=action is not None,
        fields=obj,
    )
