"""A fallible oracle: the exact judge with GPT-4o-like errors, each kind at a configured rate.

GTR's corrector is GPT-4o, which is far from perfect on the card games (as an agent it solves
2.5 % of Points24 deals, 13.5 % with its solver tool). ``corrector.errors`` sets how often this
corrector errs, by kind (at most one error a correction, drawn per request, or per state under
``corrector.errors.draw = "per_state"``, so that it repeats on every visit):

- ``misread`` (perception): one card or number is read wrong; the corrector then judges and
  corrects exactly, but for the state it misread.
- ``arithmetic``: the corrector takes something false for true: a formula that reaches another
  value than the target (points games), the opposite comparison (NumberLine), a miscounted hand
  (Blackjack); it judges against the action that wrong belief calls for and writes it.
- ``choice``: it reads and computes right, but names a wrong next action among the legal ones.

ALFWorld has no numbers to misread or sums to get wrong: any error heads for another admissible
action. How often each setting's verdicts and corrections agree with the exact judge is measured
by ``bench/corrector_accuracy.py`` (docs/training.md), and every run records it per update.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from services.corrector.base import CallTrace, CorrectorError, dump_thought, parse_agent_output
from services.corrector.oracle import (
    _wrong_step,
    exact_correct,
    good_actions,
    ideal_output,
    reads_state,
    task_extras,
)
from shared.schemas import Correction, CorrectionRequest, CorrectorErrors

KINDS = ("misread", "arithmetic", "choice")


@dataclass
class Belief:
    """What the corrector takes for true on one request."""

    state: dict[str, Any]  # the state as it reads it
    good: set[str] | None  # the actions it takes for right (None: agree with `output`, ALFWorld)
    output: dict[str, Any]  # the output it would write (its correction)
    target_formula: str | None = None  # points games: the formula it aims at, when it has one


def pick_kind(errors: CorrectorErrors, rng: random.Random) -> str | None:
    """One error kind at its configured rate, or None (the exact judge) for the rest."""
    u = rng.random()
    for kind in KINDS:
        rate = float(getattr(errors, kind))
        if u < rate:
            return kind
        u -= rate
    return None


def belief(
    kind: str | None, task: str, state: dict[str, Any], rng: random.Random
) -> tuple[Belief, str | None]:
    """The corrector's belief on ``state`` after an error of ``kind`` (None: the truth), and the
    kind of error it holds. An error of ``kind`` that this state cannot take is made as the next
    kind that it can (misread, arithmetic, choice, in turn); only where none can is the belief
    the truth, and the kind None: never a drawn error silently turned into the right answer
    under its own name."""
    truth = Belief(state, good_actions(task, state), ideal_output(task, state))
    if kind is None:
        return truth, None
    if task == "alfworld":
        return Belief(state, None, _wrong_step(state, truth.output, rng)), kind
    start = KINDS.index(kind)
    for made_kind in KINDS[start:] + KINDS[:start]:
        made = {"misread": _misread, "arithmetic": _arithmetic, "choice": _choice}[made_kind]
        held = made(task, state, truth, rng)
        if held is not None:
            return held, made_kind
    return truth, None


# State keys that count steps, not the situation: a per-state error ignores them.
_CLOCK_KEYS = ("steps", "step", "elapsed")


def state_seed(seed: int, task: str, state: dict[str, Any]) -> int:
    """The per-state error model's seed: the same situation (whatever step it is met at)
    draws the same error, or the same absence of one, on every visit."""
    import hashlib
    import json

    seen = {k: v for k, v in state.items() if k not in _CLOCK_KEYS}
    text = json.dumps([seed, task, seen], sort_keys=True, default=str)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _misread(task: str, state: dict[str, Any], truth: Belief, rng: random.Random) -> Belief | None:
    """One number of the state read as a near one (cards 1..10, NumberLine 0..5)."""
    if task == "numberline":
        fields, lo, hi = ["current", "target"], 0, 5
    elif task == "blackjack":
        fields, lo, hi = ["player_total", "dealer_showing"], 1, 21
    else:
        fields, lo, hi = [str(i) for i in range(len(state["numbers"]))], 1, 10
    for _ in range(20):
        field = rng.choice(fields)
        seen = copy.deepcopy(state)
        old = seen["numbers"][int(field)] if field.isdigit() else seen[field]
        value = int(old) + rng.choice([-2, -1, 1, 2])
        if not lo <= value <= hi:
            continue
        if task == "numberline" and value == seen["target" if field == "current" else "current"]:
            continue  # the two numbers never coincide in an episode
        if task == "blackjack" and field == "dealer_showing" and value > 10:
            continue
        if field.isdigit():
            seen["numbers"][int(field)] = value
        else:
            seen[field] = value
        try:
            return Belief(seen, good_actions(task, seen), ideal_output(task, seen))
        except (ValueError, KeyError, IndexError):  # an impossible reading: try another
            continue
    return None


def _arithmetic(
    task: str, state: dict[str, Any], truth: Belief, rng: random.Random
) -> Belief | None:
    if task == "numberline":
        c, g = state["current"], state["target"]
        action = "-" if c < g else "+"  # the comparison the wrong way round
        thought = f"{c} {'>' if c < g else '<'} {g}, I choose '{action}'"
        return Belief(state, {action}, {**truth.output, "thoughts": thought, "action": action})
    if task == "blackjack":  # the hand added up wrong: judged and corrected for that total
        total = state["player_total"] + rng.choice([-4, -3, 3, 4])
        if not 4 <= total <= 21:
            total = state["player_total"] + (3 if state["player_total"] < 12 else -3)
        seen = {**state, "player_total": total}
        return Belief(seen, good_actions(task, seen), ideal_output(task, seen))
    # Where no completion comes near the target ('4 * 3' typed), the false sum shows only as a
    # wrong next action.
    return _wrong_formula(task, state, rng) or _choice(task, state, truth, rng)


def _wrong_formula(task: str, state: dict[str, Any], rng: random.Random) -> Belief | None:
    """A completion of the typed formula that reaches a value near the target, taken for it."""
    from services.env import solver
    from services.env.points import EZPointsEnv, Points24Env

    env = EZPointsEnv if task == "ezpoints" else Points24Env
    typed = [t for t in state["formula"] if str(t).strip()]
    target = int(state["target"])
    offsets = [d for d in range(-6, 7) if d]
    rng.shuffle(offsets)
    for d in offsets:
        if target + d < 0:
            continue
        rest = solver.complete(typed, state["numbers"], target + d, env.ops, env.parens)
        if rest is None:
            continue
        full = [*typed, *rest]
        action = rest[0] if rest else "="
        thought = f"{' '.join(full)} = {target}, next I append '{action}'"
        out = {**ideal_output(task, state), "thoughts": thought, "action": action}
        return Belief(state, {action}, out, "".join(full))
    return None


def _choice(task: str, state: dict[str, Any], truth: Belief, rng: random.Random) -> Belief | None:
    """The right reading and sums, but a next action that loses the win."""
    bad = [a for a in _NAMES[task] if truth.good is None or a not in truth.good]
    if not bad:
        return None
    action = rng.choice(bad)
    right = str(truth.output["action"])
    thoughts = str(truth.output.get("thoughts", ""))
    cut = thoughts.rfind(right)
    if cut >= 0:  # the expert's own words, naming the other action
        thoughts = thoughts[:cut] + action + thoughts[cut + len(right) :]
    return Belief(state, {action}, {**truth.output, "thoughts": thoughts, "action": action})


_NAMES: dict[str, list[str]] = {  # the card games' actions (services/env: action_names)
    "numberline": ["-", "+"],
    "blackjack": ["stand", "hit"],
    "ezpoints": [*(str(n) for n in range(1, 11)), "+", "*", "="],
    "points24": [*(str(n) for n in range(1, 11)), "+", "-", "*", "/", "(", ")", "="],
}


class FallibleCorrector:
    """The oracle with errors (``corrector.errors``); thread-safe. ``errors.draw``: per_call,
    one seeded stream (each call's error independent of the last); per_state, seeded by the
    state, so a state's error repeats whenever it is met (a real corrector's repeatable
    mistakes)."""

    def __init__(self, errors: CorrectorErrors | dict[str, Any], seed: int = 0) -> None:
        self.errors = CorrectorErrors.model_validate(errors)
        self.seed = seed
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def correct(self, req: CorrectionRequest, trace: CallTrace | None = None) -> Correction:
        start = time.perf_counter()
        if req.state is None:
            raise CorrectorError("input", "the fallible oracle needs the privileged state")
        if self.errors.draw == "per_state":  # a state's error repeats on every visit
            rng = random.Random(state_seed(self.seed, req.task, req.state))
            drawn = pick_kind(self.errors, rng)
        else:
            with self._lock:
                drawn = pick_kind(self.errors, self._rng)
                rng = random.Random(self._rng.getrandbits(32))
        seen, kind = belief(drawn, req.task, req.state, rng)
        output = parse_agent_output(req.output)
        if seen.good is None:  # ALFWorld: the expert's step, or the one it wrongly heads for
            right = output is not None and (
                exact_correct(req.task, output, req.state)
                if kind is None
                else str(output.get("action")) == str(seen.output.get("action"))
            )
        else:
            action = str((output or {}).get("action", "")).strip().lower()
            right = output is not None and action in seen.good
            right = right and reads_state(req.task, output or {}, seen.state)
            if kind == "arithmetic" and seen.target_formula is not None:
                # GTR's P24 question: does the thought's formula match the target formula?
                # Here the target is its own false sum, which a right thought never names.
                said = str((output or {}).get("thoughts", "")).replace(" ", "")
                right = right and seen.target_formula in said
        extras = task_extras(req.task, seen.state)
        if seen.target_formula is not None:
            extras["target_formula"] = seen.target_formula
        extras["error"] = kind  # the kind made (None: none), for audits of the trace
        if drawn != kind:  # drawn, but this state could not take it: made as another, or none
            extras["error_drawn"] = drawn
        if right:
            result = Correction(verdict="correct", reasoning=_why(kind, "agrees"))
        elif extras.get("possible_solution") is False:  # no solution: nothing to teach (GTR)
            result = Correction(verdict="incorrect", reasoning=_why(kind, "finds no solution"))
        else:
            extras["action"] = seen.output.get("action")
            result = Correction(
                verdict="incorrect",
                corrected_thought=dump_thought(seen.output),
                reasoning=_why(kind, "corrects"),
            )
        return result.model_copy(
            update={"extras": extras, "latency_ms": (time.perf_counter() - start) * 1000}
        )


def _why(kind: str | None, what: str) -> str:
    return f"fallible oracle {what} ({'no error' if kind is None else kind + ' error'})"


def describe(errors: CorrectorErrors) -> str:
    """``misread 0.1, choice 0.05`` for logs and tables."""
    parts = [f"{k} {getattr(errors, k):g}" for k in KINDS if getattr(errors, k)]
    if parts and errors.draw == "per_state":
        parts.append("per state")
    return ", ".join(parts) or "exact"
