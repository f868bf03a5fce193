"""Measured accuracy of the oracle's fallible settings (corrector.errors) against the exact judge.

    .venv/bin/python bench/corrector_accuracy.py                  # 1,000 states per card task
    .venv/bin/python bench/corrector_accuracy.py --states 200 --tasks ezpoints,points24

States are real: each task's env played by its expert with 30 % random actions (partial and
broken formulas too). Each state gets one agent output, in turn the expert's, the expert's
thought with a uniformly random action, and a misread thought (``oracle.misread_output``), so
about half the outputs are right. Every setting answers every (state, output); the figure is the
share of answers ``oracle.accurate`` calls right: the exact judge's verdict and, when correcting,
a correction the judge accepts: the same figure a run records per update (``corrector/accuracy``).
Counts only, no timings: the figures do not depend on the host.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.corrector.fallible import FallibleCorrector, describe  # noqa: E402
from services.corrector.oracle import (  # noqa: E402
    OracleCorrector,
    accurate,
    exact_correct,
    ideal_output,
    misread_output,
)
from services.env import make_env  # noqa: E402
from shared.schemas import CorrectionRequest, CorrectorErrors, EnvConfig  # noqa: E402

CARD_TASKS = ("numberline", "ezpoints", "points24", "blackjack")
SETTINGS: list[dict[str, float]] = [
    {},
    {"misread": 0.1},
    {"arithmetic": 0.1},
    {"choice": 0.1},
    {"misread": 0.1, "arithmetic": 0.1, "choice": 0.1},
    {"misread": 0.3, "arithmetic": 0.2, "choice": 0.2},
]


def states(task: str, n: int, seed: int) -> list[dict[str, Any]]:
    """n states met by the expert acting at random 30 % of the time."""
    rng = random.Random(seed)
    env = make_env(task, EnvConfig(image_size=32), seed=seed)
    env.reset()
    game: Any = env.unwrapped
    out = []
    for _ in range(n):
        state = json.loads(json.dumps(game.state()))
        out.append(state)
        if rng.random() < 0.3:
            action = rng.randrange(len(game.action_names))
        else:
            action = game.action_names.index(ideal_output(task, state)["action"])
        _, _, terminated, truncated, _ = env.step(action)
        if terminated or truncated:
            env.reset()
    return out


def requests(task: str, n: int, seed: int) -> list[CorrectionRequest]:
    rng = random.Random(seed + 1)
    names = make_env(task, EnvConfig(image_size=32)).unwrapped.action_names  # type: ignore[attr-defined]
    out = []
    for i, state in enumerate(states(task, n, seed)):
        ideal = ideal_output(task, state)
        kind = i % 3
        if kind == 0:
            agent = ideal
        elif kind == 1:
            agent = {**ideal, "action": rng.choice(names)}
        else:
            agent = misread_output(task, state, ideal, rng)
        out.append(CorrectionRequest(task=task, prompt="p", output=json.dumps(agent), state=state))
    return out


def measure(task: str, n: int, seed: int) -> dict[str, Any]:
    reqs = requests(task, n, seed)
    right = sum(
        exact_correct(task, json.loads(r.output), r.state)  # type: ignore[arg-type]
        for r in reqs
    )
    row: dict[str, Any] = {"task": task, "states": len(reqs), "outputs_right": right / len(reqs)}
    for setting in SETTINGS:
        errors = CorrectorErrors.model_validate(setting)
        corrector = FallibleCorrector(errors, seed) if errors.any() else OracleCorrector()
        marks = [accurate(r, corrector.correct(r)) for r in reqs]
        row[describe(errors)] = sum(bool(m) for m in marks) / len(marks)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--states", type=int, default=1000, help="states per task")
    ap.add_argument("--tasks", default=",".join(CARD_TASKS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    # A seed of its own per task: each task's error draws are a sample of their own.
    tasks = args.tasks.split(",")
    rows = [measure(t, args.states, args.seed + 100 * i) for i, t in enumerate(tasks)]
    cols = [describe(CorrectorErrors.model_validate(s)) for s in SETTINGS]
    print("| task | states | outputs right | " + " | ".join(cols) + " |")
    print("|---" * (3 + len(cols)) + "|")
    for r in rows:
        cells = [f"{r[c]:.3f}" for c in cols]
        head = f"| {r['task']} | {r['states']} | {r['outputs_right']:.2f} | "
        print(head + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
