"""Thought/action token spans from character offsets of the `"action":` key (any tokenizer)."""

from __future__ import annotations

import re
from typing import Any

ACTION_KEY = re.compile(r'"action"\s*:')


def _decoded_len(tokenizer: Any, ids: list[int]) -> int:
    return len(tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))


def first_token_past(tokenizer: Any, ids: list[int], char: int) -> int:
    """Index of the first token whose text ends after character `char` of the decoded text.

    Decoded prefixes (not tokens one by one, which breaks SentencePiece's leading spaces) grow
    with their length, so a binary search needs O(log T) decodes.
    """
    lo, hi = 0, len(ids)  # answer in [lo, hi]; prefix ids[:k] is too short for every k <= lo
    while lo < hi:
        mid = (lo + hi) // 2
        if _decoded_len(tokenizer, ids[: mid + 1]) > char:
            hi = mid
        else:
            lo = mid + 1
    return lo


def token_spans(
    tokenizer: Any, ids: list[int], eos_id: int | None
) -> tuple[list[bool], list[bool], bool]:
    """(thought_mask, action_mask, has_action) for response tokens `ids`.

    The split is at the LAST ``"action":`` (as the reference's last trigram match): a thought
    that quotes the key, or an output that repeats it, keeps everything before the final one as
    thought. thought = tokens that end at or before the key's first character; action = the
    rest, EOS excluded (so a token straddling the key counts as action).

    Without the key (the reference would score its last ~4 tokens as the action, a heuristic
    that depends on the tokenizer), every non-EOS token is thought and none is action:
    ``has_action=False``, so such an output moves only by λ·thought log-prob.
    """
    text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    matches = list(ACTION_KEY.finditer(text))
    match = matches[-1] if matches else None
    not_eos = [t != eos_id for t in ids]
    if match is None:
        return not_eos, [False] * len(ids), False
    first = first_token_past(tokenizer, ids, match.start())
    thought = [i < first and ok for i, ok in enumerate(not_eos)]
    action = [i >= first and ok for i, ok in enumerate(not_eos)]
    return thought, action, True
