"""Step search checked against the rows a real run wrote, on either store: every filter, every
page (after and before cursors), words of the run's own thoughts and corrections, and hostile
text. Shared by tests/services/api/test_search.py (PostgreSQL) and tests/e2e/test_embedded.py
(the embedded SQLite, through its FTS5 tables)."""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Any

from sqlalchemy import select

from services.api import search
from services.api.search import COUNT_CAP, StepFilter, search_steps
from shared.db.models import Correction, Run, Step
from shared.db.session import session_scope

# Text the FTS5 query syntax would choke on, SQL, markup and odd characters: never an error.
HOSTILE = [
    '"', '""', "*", "AND", "OR", "NOT", "NEAR(", "NEAR(a b, 2)", "col:word", "^start", "(((",
    "-minus", "+plus", "'", "'; DROP TABLE steps; --", "<script>alert(1)</script>",
    '<img src=x onerror="alert(1)">', "\\", "%", "_", "a\x00b", "ünïcödé", "\u200b", "🙂 🙂",
    '"unterminated', "x" * 200,
]  # fmt: skip
# Words PostgreSQL's 'english' configuration drops (FTS5 keeps them): not used as probes.
STOP = {"about", "after", "again", "against", "before", "being", "below", "between", "could",
        "doing", "during", "further", "having", "other", "should", "their", "there", "these",
        "those", "through", "under", "until", "where", "which", "while", "would"}  # fmt: skip


# A stored thought is JSON: its keys ("target number") are the task's format, which the search
# leaves out on both stores (services/api/search.py JSON_KEY, migration 0010); the words of its
# values are found.
JSON_KEY = re.compile(r'"(?:[^"\\]|\\.)*"\s*:')


def _raw_words(text: str | None) -> set[str]:
    """The words of the text as written, its keys left out: what PostgreSQL indexes (an escape
    such as \\n joins the letter n to the next word)."""
    return set(re.findall(r"[^\W_]+", JSON_KEY.sub(" ", text or "").lower()))


def _value_words(text: str | None) -> set[str]:
    """The words of the JSON's decoded leaf values: what SQLite's FTS5 indexes (migration 0010);
    a text that is not JSON, as written."""
    try:
        data = json.loads(text or "")
    except ValueError:
        return _raw_words(text)
    leaves: list[str] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        else:
            leaves.append(json.dumps(x) if x is None or isinstance(x, bool) else str(x))

    walk(data)
    return set(re.findall(r"[^\W_]+", " ".join(leaves).lower()))


def words(text: str | None) -> set[str]:
    """Words both stores index for the text (its values as written and as decoded agree)."""
    return _raw_words(text) & _value_words(text)


def any_words(text: str | None) -> set[str]:
    """Words either store may index for the text."""
    return _raw_words(text) | _value_words(text)


def key_words(text: str | None) -> set[str]:
    """Words of the JSON keys."""
    return set(re.findall(r"[^\W_]+", " ".join(JSON_KEY.findall(text or "")).lower()))


def check_search(url: str, run_id: int) -> None:
    """Twice: as configured, and with every text search leaving its first chunk of steps read
    in order for the text indexes (on a small run the first chunk may hold the whole run)."""
    sparse = search.SPARSE
    try:
        for search.SPARSE in (sparse, 0):
            _check(url, run_id)
    finally:
        search.SPARSE = sparse


def _check(url: str, run_id: int) -> None:
    with session_scope(url) as s:
        run = s.get(Run, run_id)
        assert run is not None
        steps = s.scalars(select(Step).where(Step.run_id == run_id).order_by(Step.id)).all()
        rows = s.scalars(select(Correction).where(Correction.run_id == run_id))
        corr = {c.step_id: c for c in rows}
        texts = {
            st.id: (words(st.thought), words(c.corrected_thought if (c := corr.get(st.id)) else ""))
            for st in steps
        }
        # what a found step may hold: an escape (\\n, \\u00e9) reads apart on the two stores
        loose_texts = {
            st.id: any_words(st.thought)
            | any_words(c.corrected_thought if (c := corr.get(st.id)) else "")
            for st in steps
        }

        def walk(limit: int = 3, **f: Any) -> list[int]:
            """Every page, by the next_after cursor; then back again by prev_before."""
            flt, ids, after = StepFilter(**f), [], None
            while True:
                hits = search_steps(s, run, flt, limit, after=after)
                ids += [h.id for h in hits.steps]
                if hits.next_after is None:
                    break
                after = hits.next_after
            back, before = [], ids[-1] + 1 if ids else None
            while before is not None:
                hits = search_steps(s, run, flt, limit, before=before)
                back = [h.id for h in hits.steps] + back
                before = hits.prev_before
            assert back == ids, f  # the same steps, in the same order, both ways
            return ids

        def verdict(c: Correction | None) -> str:
            if c is None:
                return "none"
            if c.status != "done":
                return c.status
            return "corrected" if c.verdict == "incorrect" else "correct"

        # Filters: exactly the steps whose rows say so, in step order, through pages of 3.
        by_verdict = Counter(verdict(corr.get(st.id)) for st in steps)
        assert by_verdict["corrected"]  # the run corrected some steps
        for v in ("corrected", "correct", "failed", "none"):
            assert walk(verdict=v) == [st.id for st in steps if verdict(corr.get(st.id)) == v]
        first = search_steps(s, run, StepFilter(verdict="corrected"), 3)
        assert first.total == min(by_verdict["corrected"], COUNT_CAP) and not first.capped
        assert walk(update=1, format_valid=True) == [
            st.id for st in steps if st.update_idx == 1 and st.format_valid
        ]
        action = Counter(st.parsed_action for st in steps if st.parsed_action).most_common(1)[0][0]
        assert walk(action=action, reward_min=0) == [
            st.id for st in steps if st.parsed_action == action and st.reward >= 0
        ]

        # Words: every step holding the word in its thought or corrected thought is found, and
        # nothing is found that holds no word of its stem (both stores stem: "moves" ~ "move").
        def loose(w: str, ids: list[int]) -> bool:
            return all(any(t.startswith(w[:4]) for t in loose_texts[i]) for i in ids)

        counts = Counter(w for th, co in texts.values() for w in th | co)
        probes = [w for w in counts if w.isalpha() and len(w) >= 5 and w not in STOP]
        only_corrected = [w for w in probes if not any(w in th for th, _ in texts.values())]
        rare, common = min(probes, key=lambda w: counts[w]), max(probes, key=lambda w: counts[w])
        for w in {rare, common, *only_corrected[:1]}:
            found = walk(limit=2, q=w.upper())
            assert found and loose(w, found) and found == sorted(found)
            assert {i for i, (th, co) in texts.items() if w in th or w in co} <= set(found), w
        # A word that only a step's correction holds finds the step (the corrections' index).
        own = [
            (i, w)
            for i, (th, co) in texts.items()
            for w in sorted(co - th)
            if w not in STOP and (w.isdigit() or len(w) > 2)
        ]
        assert own, "some correction says what its thought did not"
        for i, w in own[:3]:
            assert i in walk(limit=1, q=w), (i, w)
        # Two words: both must be there; a verdict narrows it to those steps.
        both = walk(q=f"{common} {rare}")
        assert set(both) <= set(walk(q=rare)) and loose(common, both) and loose(rare, both)
        corrected = set(walk(verdict="corrected"))
        assert set(walk(q=common, verdict="corrected")) == set(walk(q=common)) & corrected
        assert walk(q="zzyzxqwv") == []

        # The JSON's keys are the task's format, in every thought: a word only they hold finds
        # nothing (with its keys indexed, q=target found every NumberLine step).
        keys = set().union(
            *(key_words(st.thought) for st in steps),
            *(key_words(c.corrected_thought) for c in corr.values()),
        )
        held = set().union(*loose_texts.values())
        keys_only = sorted(k for k in keys if not any(v.startswith(k[:4]) for v in held))
        if run.task == "numberline":
            assert {"target", "thoughts"} <= set(keys_only), keys_only
        assert keys_only, "the run's thoughts have keys"
        for k in keys_only:
            assert walk(limit=50, q=k) == [], k
        # ... and with a word of the values beside it, neither does the value's word
        assert walk(limit=50, q=f"{rare} {keys_only[0]}") == []

        # Hostile text: never an error; no word, no match.
        for q in HOSTILE:
            found = walk(limit=50, q=q)
            assert loose(max(words(q), key=len), found) if words(q) else found == [], q
