"""EZPoints-v0 (two cards, make 12 with + and *) and Points24-v0 (four cards, make 24).

A formula is typed one token per step and '=' submits it. Rules as the reference, in order:
a formula already longer than the limit truncates with -1 (whatever the action); a number used
more often than it is dealt appends " " with -1; '=' scores +10 if the formula equals the target
and every card was used, else -1, and ends the episode; anything else is appended with 0.
``env.early_truncation``: "reference" (GTR's loop) also ends the episode on any -1 and on a
formula that leaves the corrector's target formula; "solver" (ours, privileged) ends it with -1
once no completion of the formula reaches the target. A time limit (``env.max_episode_steps``)
that ends an episode before '=' adds the over-length -1 (``stall_penalty``), as the reference's
formula limit does under its TimeLimit of 300: stalling never scores above a wrong answer.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, ClassVar

import numpy as np
from PIL import Image, ImageDraw

from services.env import render, solver
from services.env.base import GymCardsEnv
from services.env.prompts import points_prompt

NOT_DETERMINED = "NOT DETERMINED"  # GTR's corrector memory, reset every episode
SUITS = ["H", "S", "D", "C"]
RANKS = {1: "A", 10: "T", 11: "J", 12: "Q", 13: "K"}
NUMBERS = [str(n) for n in range(1, 11)]


def card_name(suit: str, rank: int) -> str:
    """'H' + 13 -> 'HK'; ten is 'T'."""
    return suit + RANKS.get(rank, str(rank))


def rank_of(card: str) -> int:
    """'HK' -> 13, 'SA' -> 1, 'DT' -> 10; ValueError on anything else."""
    suit, rank = card[:1].upper(), card[1:].upper()
    ranks = {v: k for k, v in RANKS.items()} | {str(n): n for n in range(2, 11)}
    if suit not in SUITS or rank not in ranks:
        raise ValueError(
            f"bad card {card!r}: a suit of {''.join(SUITS)} then a rank A,2..10,T,J,Q,K"
        )
    return ranks[rank]


class PointsEnv(GymCardsEnv):
    """Shared rules of the two formula games."""

    points = True
    stall_penalty = -1.0  # the reference's over-length -1 (its formula limit, under TimeLimit 300)
    target: ClassVar[int]
    n_cards: ClassVar[int]
    max_formula: ClassVar[int]
    ops: ClassVar[str]  # arithmetic operators among the actions
    parens: ClassVar[bool]

    def _new_episode(self, options: dict[str, Any]) -> None:
        """Options: ``cards``, e.g. ["H4", "S3"], fixes the deal."""
        self.cards, self.numbers = self._deal()
        if "cards" in options:
            self.cards = list(options["cards"])
            if len(self.cards) != self.n_cards:
                raise ValueError(f"{self.task} deals {self.n_cards} cards, not {len(self.cards)}")
            self.numbers = [min(rank_of(c), 10) for c in self.cards]
        self.formula: list[str] = []
        self.used: list[int] = []
        self.target_formula = NOT_DETERMINED
        self.solvable = bool(self.solutions())

    def _deal(self) -> tuple[list[str], list[int]]:
        raise NotImplementedError

    def solutions(self) -> list[str]:
        """Every formula that wins this deal (the solver; none for many Points24 deals)."""
        found = solver.solve(self.numbers, self.target, self.ops)
        return found if self.parens else [f for f in found if "(" not in f]

    def completable(self) -> bool:
        """Whether the formula typed so far can still be finished into a winning one."""
        return solver.can_complete(self.formula, self.numbers, self.target, self.ops, self.parens)

    def set_target_formula(self, formula: str) -> None:
        """Remember the corrector's target formula for this episode (shown in ``state``)."""
        self.target_formula = formula

    def _apply(self, action: int) -> tuple[float, bool, bool]:
        token = self.action_names[action]
        if len(self.formula) > self.max_formula:
            return -1.0, False, True
        if token in NUMBERS:
            if self.used.count(int(token)) + 1 > self.numbers.count(int(token)):
                self.formula.append(" ")  # so the formula still grows (reference)
                return -1.0, False, False
            self.used.append(int(token))
        if token == "=":
            value = solver.evaluate("".join(self.formula))
            won = value is not None and value == self.target and len(self.used) == self.n_cards
            return (10.0 if won else -1.0), True, False
        self.formula.append(token)
        rule = self.config.early_truncation
        if rule == "solver" and not self.completable():
            return -1.0, False, True
        if rule == "reference" and not self.on_target():
            return -1.0, False, True
        return 0.0, False, False

    def on_target(self) -> bool:
        """Whether the formula is still a prefix of the corrector's target formula (GTR's P24
        rule); True while no target is determined (the corrector sets it, corrector.feedback)."""
        if self.target_formula == NOT_DETERMINED:
            return True
        return self.target_formula.replace(" ", "").startswith(self.formula_text().replace(" ", ""))

    def formula_text(self) -> str:
        """The formula as the prompt shows it (tokens joined, as the reference)."""
        return "".join(self.formula)

    def prompt(self) -> str:
        return points_prompt(self.n_cards, self.formula_text(), self.action_names, self.target)

    def state(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "cards": list(self.cards),
            "numbers": list(self.numbers),
            "formula": list(self.formula),
            "formula_text": self.formula_text(),
            "used": list(self.used),
            "target": self.target,
            "target_formula": self.target_formula,
            "solvable": self.solvable,
            "completable": self.completable(),
            "steps": self.elapsed,
        }

    def _draw(self) -> np.ndarray:
        return _draw_points(self.size, self.cards, self.formula)

    @classmethod
    def draw_state(cls, state: dict[str, Any], size: int) -> np.ndarray:
        return _draw_points(size, [str(c) for c in state["cards"]], list(state["formula"]))


def _draw_points(s: int, cards: list[str], formula: list[str]) -> np.ndarray:
    img = _table(s, tuple(cards)).copy()  # the cards stay for the episode: draw once
    formula_top = 0.69 if len(cards) == 2 else 0.55
    render.draw_formula(img, ImageDraw.Draw(img), formula, s * formula_top)
    return render.to_array(img)


@lru_cache(maxsize=64)
def _table(size: int, cards: tuple[str, ...]) -> Image.Image:
    """The felt with the dealt cards on it."""
    img, _ = render.canvas(size)
    render.draw_card_row(img, list(cards), size * (0.04 if len(cards) == 2 else 0.1))
    return img


class EZPointsEnv(PointsEnv):
    """Two cards whose values make 12 by + or *; actions 1..10, '+', '*', '='."""

    task = "ezpoints"
    action_names = [*NUMBERS, "+", "*", "="]
    target = 12
    n_cards = 2
    max_formula = 5
    ops = "+*"
    parens = False

    def _deal(self) -> tuple[list[str], list[int]]:
        rng = self.np_random
        rank = int(rng.integers(2, 14))
        first = min(rank, 10)
        if first in (1, 2, 3, 4, 6) and rng.random() <= 0.5:
            second = 12 // first  # a product solution half of the time
        else:
            second = 12 - first
        cards = [card_name(SUITS[rng.integers(4)], rank), card_name(SUITS[rng.integers(4)], second)]
        numbers = [first, second]
        if rng.random() <= 0.5:
            cards, numbers = cards[::-1], numbers[::-1]
        return cards, numbers


class Points24Env(PointsEnv):
    """Four cards (J, Q, K count as 10); actions 1..10, + - * / ( ) =."""

    task = "points24"
    action_names = [*NUMBERS, "+", "-", "*", "/", "(", ")", "="]
    target = 24
    n_cards = 4
    max_formula = 20
    ops = "+-*/"
    parens = True

    def _deal(self) -> tuple[list[str], list[int]]:
        rng = self.np_random
        ranks = [int(r) for r in rng.integers(1, 14, size=4)]
        suits = [SUITS[int(i)] for i in rng.integers(4, size=4)]
        return [card_name(s, r) for s, r in zip(suits, ranks, strict=True)], [
            min(r, 10) for r in ranks
        ]
