"""The step page's word diff of the agent's thought against the corrected thought."""

from __future__ import annotations

import difflib
import json
import re

TOKEN_RE = re.compile(r"\w+|[^\w\s]|\s+")


def readable(text: str) -> str:
    """A JSON thought shown as one 'key: value' line per key, so the diff reads like prose."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return text
    if not isinstance(data, dict):
        return text
    return "\n".join(f"{k}: {v if isinstance(v, str) else json.dumps(v)}" for k, v in data.items())


DIFF_MAX_TOKENS = 400  # SequenceMatcher is quadratic in the worst case: bound its input


def word_diff(before: str, after: str) -> list[tuple[str, str]]:
    """Word-level diff as (op, text) chunks with op in eq | del | ins.

    The common head and tail are cut off in linear time; a middle longer than
    ``DIFF_MAX_TOKENS`` tokens is diffed by lines instead, and if that is still too long it is
    shown as one deletion and one insertion. So any stored text renders in milliseconds."""
    a, b = TOKEN_RE.findall(readable(before)), TOKEN_RE.findall(readable(after))
    head = 0
    while head < min(len(a), len(b)) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < min(len(a), len(b)) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    out: list[tuple[str, str]] = [("eq", "".join(a[:head]))] if head else []
    mid_a, mid_b = a[head : len(a) - tail], b[head : len(b) - tail]
    if max(len(mid_a), len(mid_b)) > DIFF_MAX_TOKENS:
        mid_a, mid_b = _lines("".join(mid_a)), _lines("".join(mid_b))
    if max(len(mid_a), len(mid_b)) > DIFF_MAX_TOKENS:
        mid_a, mid_b = ["".join(mid_a)], ["".join(mid_b)]
    out += _opcodes(mid_a, mid_b)
    if tail:
        out.append(("eq", "".join(a[len(a) - tail :])))
    return [(op, text) for op, text in out if text]


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _opcodes(a: list[str], b: list[str]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            out.append(("eq", "".join(a[i1:i2])))
            continue
        if i2 > i1:
            out.append(("del", "".join(a[i1:i2])))
        if j2 > j1:
            out.append(("ins", "".join(b[j1:j2])))
    return out
