"""The oracle corrector and the exact judge: the ideal thought from the privileged state.

The exact judge (``exact_correct``) calls an output right when it reads the state right (the
task's keys, the numbers in its thought, any "formula = n" it claims) and its action keeps a win
reachable (``good_actions``: any of several paths in EZPoints and Points24, not only the
expert's). The oracle answers with it and corrects toward the expert's thought; it is the offline
default and the upper bound. ``accurate`` measures any corrector's answer against the judge.
With `noise = p` it writes, at rate p, a thought that is deliberately wrong (the expert's thought
for a misread state); `services/corrector/fallible.py` makes GPT-4o-like errors per kind.
"""

from __future__ import annotations

import copy
import json
import random
import re
import threading
import time
from typing import Any

from services.corrector.base import (
    CallTrace,
    CorrectorError,
    dump_thought,
    parse_agent_output,
    thought_of,
)
from shared.schemas import Correction, CorrectionRequest

FREE_TEXT = ("thoughts", "action")


def ideal_output(task: str, state: dict[str, Any]) -> dict[str, Any]:
    """The expert's output (task keys, thoughts, action) for a privileged state."""
    if task == "alfworld":
        from services.env.alfworld import oracle_output

        return oracle_output(state)
    from services.env.expert import expert_output

    return expert_output(task, state)


def _norm(value: Any) -> Any:
    """Compare parsed values, not strings: '4' == 4, spaces in formulas and case do not count."""
    if isinstance(value, list):
        return sorted((_norm(v) for v in value), key=repr)  # card order does not matter
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        return float(value)
    text = str(value).strip().lower().replace(" ", "")
    try:
        return float(text)
    except ValueError:
        return text


def agrees(task: str, output: dict[str, Any], ideal: dict[str, Any], state: dict[str, Any]) -> bool:
    """Whether an output reads the state as the expert does and takes the expert's action."""
    for key, value in ideal.items():
        if key not in FREE_TEXT and (key not in output or _norm(output[key]) != _norm(value)):
            return False
    if _norm(output.get("action")) != _norm(ideal.get("action")):
        return False
    thoughts = output.get("thoughts")
    if not isinstance(thoughts, str):
        return False
    if _norm(thoughts) == _norm(ideal.get("thoughts")):
        return True  # the expert's own words, even where its relevance check is strict
    if task == "alfworld":  # every claim (where, seen, held, sub-goal) against the state
        from services.env.alfworld.judge import thought_correct

        return thought_correct(thoughts, state)
    from services.env.expert import thought_matches_state

    return thought_matches_state(task, json.dumps(output), state)


_CLAIM = re.compile(r"([\d(][\d+\-*/() ]*?)\s*=\s*(\d+)")  # "10 * 3 - 2 - 4 = 24"
_POINTS = ("ezpoints", "points24")


def good_actions(task: str, state: dict[str, Any]) -> set[str] | None:
    """Actions that keep a win reachable from ``state``; None where only the expert's counts
    (ALFWorld). Points games: every token after which the formula can still be finished, '='
    once it wins, and '=' alone once it can no longer win (end the hopeless episode)."""
    if task == "numberline":
        return {"+" if state["current"] < state["target"] else "-"}
    if task == "blackjack":
        from services.env.expert import blackjack_action

        return {
            blackjack_action(state["player_total"], state["usable_ace"], state["dealer_showing"])
        }
    if task not in _POINTS:
        return None
    from services.env import solver
    from services.env.points import EZPointsEnv, Points24Env

    env = EZPointsEnv if task == "ezpoints" else Points24Env
    typed = [t for t in state["formula"] if str(t).strip()]
    args = (state["numbers"], state["target"], env.ops, env.parens)
    rest = solver.complete(typed, *args)
    if rest is None:
        return {"="}
    good = {"="} if not rest else set()
    for token in env.action_names:
        if token != "=" and solver.can_complete([*typed, token], *args):
            good.add(token)
    return good


def arithmetic_right(task: str, thoughts: str) -> bool:
    """Points games: every "formula = n" the thought claims holds (exact arithmetic)."""
    if task not in _POINTS:
        return True
    from services.env.solver import evaluate

    for expr, value in _CLAIM.findall(thoughts):
        got = evaluate(expr.replace(" ", ""))
        if got is not None and got != int(value):
            return False
    return True


def reads_state(task: str, output: dict[str, Any], state: dict[str, Any]) -> bool:
    """The output's reading of the state: its keys, the numbers of its thought, its sums."""
    ideal = ideal_output(task, state)
    for key, value in ideal.items():
        if key not in FREE_TEXT and (key not in output or _norm(output[key]) != _norm(value)):
            return False
    thoughts = output.get("thoughts")
    if not isinstance(thoughts, str) or not arithmetic_right(task, thoughts):
        return False
    if _norm(thoughts) == _norm(ideal.get("thoughts")):
        return True
    from services.env.expert import thought_matches_state

    return thought_matches_state(task, json.dumps(output), state)


def exact_correct(task: str, output: dict[str, Any] | None, state: dict[str, Any]) -> bool:
    """The exact judge: reads the state right and acts so that a win stays reachable."""
    if output is None:
        return False
    good = good_actions(task, state)
    if good is None:
        return agrees(task, output, ideal_output(task, state), state)
    action = str(output.get("action", "")).strip().lower()
    return action in good and reads_state(task, output, state)


def accurate(req: CorrectionRequest, result: Correction) -> bool | None:
    """Whether a corrector's answer agrees with the exact judge: the same verdict on the agent's
    output and, when it corrects, a correction the judge calls right (with the corrector's own
    action when it names one, else its reading of the state). None without a state to judge."""
    if req.state is None:
        return None
    truth = exact_correct(req.task, parse_agent_output(req.output), req.state)
    if (result.verdict == "correct") != truth:
        return False
    if result.verdict == "correct" or not result.corrected_thought:
        return True
    fixed = parse_agent_output(result.corrected_thought)
    if fixed is None:
        return False
    action = result.extras.get("action")
    if action is None:
        return reads_state(req.task, fixed, req.state) if req.task != "alfworld" else True
    return exact_correct(req.task, {**fixed, "action": action}, req.state)


def task_extras(task: str, state: dict[str, Any]) -> dict[str, Any]:
    """GTR's extras for the points games: the target formula, and whether the deal is solvable."""
    if task not in ("ezpoints", "points24"):
        return {}
    from services.env.expert import target_tokens

    tokens = target_tokens(task, state)
    extras: dict[str, Any] = {"possible_solution": bool(state.get("solvable", tokens is not None))}
    if tokens is not None:
        extras["target_formula"] = "".join(tokens)
    return extras


class OracleCorrector:
    """Corrects from the privileged state; thread-safe (one seeded noise stream)."""

    def __init__(self, noise: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= noise <= 1.0:
            raise ValueError("noise must be in [0, 1]")
        self.noise = noise
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def correct(self, req: CorrectionRequest, trace: CallTrace | None = None) -> Correction:
        start = time.perf_counter()
        if req.state is None:
            raise CorrectorError("input", "the oracle needs the privileged state")
        ideal = ideal_output(req.task, req.state)
        with self._lock:
            noisy = self.noise > 0 and self._rng.random() < self.noise
            seed = self._rng.getrandbits(32)
        output = parse_agent_output(req.output)
        extras = task_extras(req.task, req.state)  # the solver once a call
        wrong: dict[str, Any] = {}
        if noisy:
            wrong = misread_output(req.task, req.state, ideal, random.Random(seed))
            result = Correction(
                verdict="incorrect",
                corrected_thought=dump_thought(wrong),
                reasoning="noise: a deliberately wrong correction",
            )
        elif exact_correct(req.task, output, req.state):
            result = Correction(
                verdict="correct",
                reasoning="the thought reads the state right and a win stays reachable",
            )
        elif extras.get("possible_solution") is False:
            # GTR: a deal with no solution has nothing to teach (the reference labels nothing
            # and, with corrector.feedback, ends the episode), as a remote corrector's answer.
            result = Correction(verdict="incorrect", reasoning="the cards cannot make the target")
        else:
            result = Correction(
                verdict="incorrect",
                corrected_thought=dump_thought(ideal),
                reasoning="the expert's thought for this state",
            )
        if result.verdict == "incorrect":
            # The corrector's own action, for the thought+action cloning ablation.
            extras["action"] = (wrong if noisy else ideal).get("action")
        return result.model_copy(
            update={"extras": extras, "latency_ms": (time.perf_counter() - start) * 1000}
        )


def _int_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths to every integer leaf of a JSON-like value."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [path]
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    return [p for k, v in items for p in _int_paths(v, (*path, k))]


def _set(value: Any, path: tuple[Any, ...], new: int) -> None:
    for key in path[:-1]:
        value = value[key]
    value[path[-1]] = new


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


def misread_output(
    task: str, state: dict[str, Any], ideal: dict[str, Any], rng: random.Random
) -> dict[str, Any]:
    """The expert's output for the state with one number misread: wrong, but well-formed."""
    if task == "alfworld":
        return _wrong_step(state, ideal, rng)
    paths = _int_paths(state)
    for _ in range(50):
        if not paths:
            break
        wrong_state = copy.deepcopy(state)
        path = rng.choice(paths)
        old = _get(state, path)
        _set(wrong_state, path, old + rng.choice([-2, -1, 1, 2]))
        try:
            wrong = ideal_output(task, wrong_state)
        except Exception:  # noqa: BLE001 - a misread may be an impossible state: try another
            continue
        if not agrees(task, wrong, ideal, state):
            return wrong
    return _garbled(ideal, rng)


def _garbled(ideal: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """Fallback: the ideal thought with its digits changed (a wrong number for sure)."""
    thought = thought_of(ideal)
    text = str(thought.get("thoughts", ""))
    digits = [i for i, ch in enumerate(text) if ch.isdigit()]
    if digits:
        i = rng.choice(digits)
        text = text[:i] + str((int(text[i]) + rng.randint(1, 8)) % 10) + text[i + 1 :]
    else:
        text = "I am not sure what the state is, so I repeat my last action."
    return {**thought, "thoughts": text, "action": ideal.get("action")}


def _wrong_step(state: dict[str, Any], ideal: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """ALFWorld: the expert's thought, but heading for another admissible action."""
    action = str(ideal.get("action", ""))
    others = [a for a in state.get("admissible", []) if a != action] or ["look around again"]
    other = rng.choice(others)
    thoughts = str(ideal.get("thoughts", ""))
    wrong = thoughts.replace(f"so I {action}.", f"so I {other}.")
    if wrong == thoughts:
        wrong = f"{thoughts} Instead, I {other}."
    return {"thoughts": wrong, "action": other}
