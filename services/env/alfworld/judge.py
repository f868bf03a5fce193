"""The oracle's verdict on an ALFWorld thought: every claim it makes, checked against the state.

A thought is judged on four claims, each against the privileged state (the oracle's thought
makes all four, see ``oracle.describe`` and ``oracle.next_subgoal``):

- where: the "I am at ..." sentence names the receptacle in front (or the middle of the room);
- seen: every object the "I see ..." sentence names is visible there, none twice, and "nothing"
  only when nothing is visible;
- held: the "I hold ..." sentence names the held object and nothing else ("nothing" when the
  hands are empty), with no state word (hot, cold, clean) the object does not have;
- sub-goal: the sub-goal names the task's object, and no object the next sub-goal does not
  involve ("find a potato" when the task is a tomato is wrong).

Only what is said is judged: a thought may leave out visible objects. A sentence said twice is
wrong too (a degenerate, repeating thought).
"""

from __future__ import annotations

import re
from typing import Any

from services.env.alfworld.oracle import next_subgoal
from services.env.alfworld.render import type_of

# ALFRED's object types (alfworld.gen.constants.OBJECTS, lower case), and the receptacle types
# that can be picked up too; kept here so that judging needs no alfworld install.
OBJECT_TYPES = frozenset(
    "alarmclock apple baseballbat basketball bathtub blinds book boots bread butterknife candle "
    "cd cellphone chair cloth creditcard curtains desklamp dishsponge egg floorlamp footstool fork "
    "glassbottle handtowel houseplant kettle keychain knife ladle laptop laundryhamperlid lettuce "
    "lightswitch mirror newspaper painting papertowel papertowelroll pen pencil peppershaker "
    "pillow plunger poster potato remotecontrol saltshaker scrubbrush showerdoor showerglass sink "
    "soapbar soapbottle spatula spoon spraybottle statue stoveknob teddybear television "
    "tennisracket tissuebox toiletpaper toiletpaperroll tomato towel vase watch wateringcan window "
    "winebottle bowl box cup mug pan plate pot".split()
)
_FLAGS = ("hot", "cold", "clean")
_ENTITY = re.compile(r"\b([a-z]+) (\d+)\b")
_SENTENCE = re.compile(r"(?<=[.!?;])\s+|\n+")
_SUBGOAL = re.compile(r"sub-?goal\s*(?:is|:)?\s*(.*?)(?:,\s*so\b|$)", re.DOTALL)


def _entities(text: str) -> list[str]:
    """'I see apple 1, potato 2' -> ['apple 1', 'potato 2']."""
    return [f"{a} {b}" for a, b in _ENTITY.findall(text)]


def _object_words(text: str) -> set[str]:
    """Object types named in the text, singular ('tomatoes' -> 'tomato')."""
    out = set()
    for word in re.findall(r"[a-z]+", text):
        for cand in (word, word[:-1], word[:-2]):
            if cand in OBJECT_TYPES:
                out.add(cand)
                break
    return out


_AT = re.compile(r"\b(?:i am|i'm) (?:at|in front of|in) (?:the )?([a-z]+ \d+|middle of the room)?")


def _where(sentences: list[str], state: dict[str, Any]) -> list[str]:
    claims = [m.group(1) or "" for s in sentences for m in _AT.finditer(s)]
    where = state["front"] or "middle of the room"
    if not claims:
        return ["says not where the agent is"]
    if wrong := [c or "somewhere unnamed" for c in claims if c != where]:
        return [f"claims to be at {', '.join(wrong)}, but is at {where}"]
    return []


def _seen(sentences: list[str], state: dict[str, Any]) -> list[str]:
    visible, front = set(state["visible"]), state["front"]
    problems = []
    for s in [s for s in sentences if re.search(r"\b(i )?see\b|\bthere (is|are)\b", s)]:
        named = [e for e in _entities(s) if e != front]
        if len(named) != len(set(named)):
            problems.append("names a seen object twice")
        if wrong := [e for e in named if e not in visible]:
            problems.append(f"claims to see {', '.join(wrong)}, not visible here")
        if not named and re.search(r"\bnothing\b|\bno objects?\b", s) and visible:
            problems.append("claims to see nothing, but objects are visible")
        seen_types = {type_of(v) for v in visible}
        bare = _object_words(_ENTITY.sub("", s)) - seen_types - {type_of(front or "")}
        if bare:
            problems.append(f"claims to see a {', '.join(sorted(bare))}, not visible here")
    return problems


def _held(sentences: list[str], state: dict[str, Any]) -> list[str]:
    held = state["holding"]
    claims = [s for s in sentences if re.search(r"\b(hold|holding|carry|carrying)\b|my hand", s)]
    if not claims:
        return ["says not what the agent holds"]
    problems = []
    for s in claims:
        named = _entities(s)
        if held is None:
            if named or not re.search(r"\bnothing\b|\bempty\b|\bnot holding\b", s):
                problems.append(f"claims to hold {', '.join(named) or 'something'}, holds nothing")
            continue
        if named != [held]:
            problems.append(f"claims to hold {', '.join(named) or 'nothing'}, holds {held}")
        flags = set(state["object_states"].get(held, []))
        if wrong := [f for f in _FLAGS if re.search(rf"\b{f}\b", s) and f not in flags]:
            problems.append(f"claims the {held} is {', '.join(wrong)}")
    return problems


def _subgoal(text: str, sentences: list[str], state: dict[str, Any]) -> list[str]:
    found = _SUBGOAL.search(text)
    clause = found.group(1) if found else ""
    if not found:  # no "sub-goal" marker: whatever is not a claim about the scene or the hands
        scene = re.compile(r"\bi am\b|\bi'm\b|\bsee\b|\bthere (is|are)\b|\bhold|\bcarry")
        clause = " ".join(s for s in sentences if not scene.search(s))
    said = _object_words(_ENTITY.sub(lambda m: m.group(1), clause))
    t = state["targets"]
    expected = _object_words(next_subgoal(state)) | {t["receptacle"], t["toggle"]}
    if wrong := sorted(said - expected):
        return [f"the sub-goal names {', '.join(wrong)}, which the task does not need now"]
    if t["object"] not in said:
        return [f"the sub-goal does not name the task's object ({t['object']})"]
    return []


def thought_problems(text: str, state: dict[str, Any]) -> list[str]:
    """Every claim of the thought that the state contradicts; [] when the thought is right."""
    low = text.lower().strip()
    sentences = [s.strip() for s in _SENTENCE.split(low) if s.strip()]
    problems: list[str] = []
    if len(sentences) != len(set(sentences)):
        problems.append("repeats a sentence")
    # The sub-goal sentence may carry ", so I take X from Y": keep the scene claims apart from it.
    scene = [s for s in sentences if not re.search(r"sub-?goal", s)]
    problems += _where(scene, state)
    problems += _seen(scene, state)
    problems += _held(scene, state)
    problems += _subgoal(low, sentences, state)
    return problems


def thought_correct(text: str, state: dict[str, Any]) -> bool:
    """Whether every claim of an ALFWorld thought holds in the privileged state."""
    return not thought_problems(text, state)
