"""Tokenizer text for a tiny ALFWorld model: agent prompts and oracle outputs of made-up states.

The tiny models' default tokenizer is trained on the card games' text, where ALFWorld's words
("countertop", "stoveburner") never occur: it spends about one token a character, so a prompt
is ~900 tokens and an oracle output 85-190. Made-up states from ALFRED's object and receptacle
types (no games needed) teach the byte-level BPE those words; prompts and outputs get ~2x shorter.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

from services.env.alfworld.games import SUBTASKS
from services.env.alfworld.oracle import oracle_output
from services.env.alfworld.prompts import agent_prompt
from services.env.expert import format_output

_FLAGS = ("hot", "cold", "clean", "on")


def _vocabulary() -> tuple[list[str], list[str], dict[str, list[str]]]:
    """ALFRED's object and receptacle types (lower case, as the games write them) and the task
    sentences of the six ALFWorld task types."""
    from alfworld.gen import constants
    from alfworld.gen.goal_library import gdict

    recep = sorted({r.lower() for r in constants.RECEPTACLES})
    objects = sorted({o.lower() for o in constants.OBJECTS} - set(recep))
    return objects, recep, {t: list(gdict[t]["templates"]) for t in SUBTASKS}


def made_up_state(
    rng: random.Random, objects: list[str], recep: list[str], tasks: dict[str, list[str]]
) -> dict[str, Any]:
    """A plausible state: a room of numbered receptacles, what is in front, held and admissible."""
    room = [f"{r} {i}" for r in rng.sample(recep, 8) for i in range(1, rng.randint(1, 4) + 1)]
    things = [f"{o} {rng.randint(1, 3)}" for o in rng.sample(objects, 6)]
    task_type = rng.choice(list(tasks))
    target, goal_recep = rng.choice(things).rsplit(" ", 1)[0], room[0].rsplit(" ", 1)[0]
    toggle = rng.choice(("desklamp", "floorlamp"))
    front = rng.choice([None, *room])
    held = rng.choice([None, *things])
    visible = sorted(rng.sample(things, rng.randint(0, 4))) if front else []
    admissible = [f"go to {r}" for r in room if r != front] + ["help", "inventory", "look"]
    if front:
        admissible += [f"examine {front}", f"open {front}", f"close {front}"]
        admissible += [f"take {o} from {front}" for o in visible]
        if held:
            verb = rng.choice(["move", "heat", "cool", "clean", "use"])
            admissible.append(f"{verb} {held} {'to' if verb == 'move' else 'with'} {front}")
    history = [rng.choice(admissible) for _ in range(rng.randint(0, 12))]
    return {
        "task": rng.choice(tasks[task_type]).format(obj=target, recep=goal_recep, toggle=toggle),
        "subtask": SUBTASKS[task_type],
        "targets": {"object": target, "receptacle": goal_recep, "toggle": toggle},
        "front": front,
        "front_open": rng.choice([None, True, False]) if front else None,
        "visible": visible,
        "holding": held,
        "object_states": {held: [rng.choice(_FLAGS)]} if held and rng.random() < 0.3 else {},
        "admissible": sorted(admissible),
        "expert_plan": [rng.choice(admissible)],
        "goal_progress": [rng.randint(0, 1), 2],
        "history": history,
    }


def corpus(n: int = 600, seed: int = 0) -> Iterator[str]:
    """The agent prompt (GTR setting: image, task, history) and oracle output of n states."""
    rng = random.Random(seed)
    objects, recep, tasks = _vocabulary()
    for _ in range(n):
        state = made_up_state(rng, objects, recep, tasks)
        yield agent_prompt(state, state["history"], "image", "")
        yield format_output(oracle_output(state))
