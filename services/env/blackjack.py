"""Blackjack-v0: gymnasium's rules (natural=False, sab=False), infinite deck, pixel frames."""

from __future__ import annotations

from typing import Any

import numpy as np

from services.env import render
from services.env.base import GymCardsEnv
from services.env.points import rank_of
from services.env.prompts import blackjack_prompt

DECK = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 10, 10]  # 10 has weight 4/13
SUITS = ["C", "D", "H", "S"]


def hand_total(values: list[int]) -> tuple[int, bool]:
    """(total, usable ace): an ace counts 11 when that does not bust."""
    total = sum(values)
    usable = 1 in values and total + 10 <= 21
    return (total + 10 if usable else total), usable


def _cmp(a: int, b: int) -> float:
    return float(a > b) - float(a < b)


class BlackjackEnv(GymCardsEnv):
    """Stand (0) plays out the dealer to 17 and scores; hit (1) draws, a bust ends with -1."""

    task = "blackjack"
    action_names = ["stand", "hit"]
    stall_penalty = -1.0  # hitting to the time limit: under the reference's 300 steps, a bust

    def _draw_card(self) -> str:
        if self._stacked:
            return self._stacked.pop(0)
        rng = self.np_random
        value = int(rng.choice(DECK))
        suit = SUITS[int(rng.integers(4))]
        # A 10 shows a random face, never a ten (the reference).
        rank = {1: "A", 10: ["J", "Q", "K"][int(rng.integers(3))]}.get(value, str(value))
        return suit + rank

    def _new_episode(self, options: dict[str, Any]) -> None:
        """Options: ``dealer`` and ``player`` hands and the next ``draws``, e.g. ["HK", "S9"]."""
        for card in [
            *options.get("dealer", []),
            *options.get("player", []),
            *options.get("draws", []),
        ]:
            rank_of(card)
        self._stacked: list[str] = list(options.get("draws", []))
        self.dealer = list(options.get("dealer", [])) or [self._draw_card(), self._draw_card()]
        self.player = list(options.get("player", [])) or [self._draw_card(), self._draw_card()]
        self.outcome: str | None = None

    @staticmethod
    def value(card: str) -> int:
        """Blackjack value of a card name such as 'HK' (10) or 'SA' (1)."""
        rank = card[1:]
        return 1 if rank == "A" else 10 if rank in ("J", "Q", "K", "T") else int(rank)

    def _total(self, hand: list[str]) -> tuple[int, bool]:
        return hand_total([self.value(c) for c in hand])

    def _apply(self, action: int) -> tuple[float, bool, bool]:
        if action == 1:
            self.player.append(self._draw_card())
            if self._total(self.player)[0] > 21:
                self.outcome = "bust"
                return -1.0, True, False
            return 0.0, False, False
        while self._total(self.dealer)[0] < 17:
            self.dealer.append(self._draw_card())
        player, dealer = self._total(self.player)[0], self._total(self.dealer)[0]
        reward = _cmp(player, 0 if dealer > 21 else dealer)
        self.outcome = {1.0: "win", 0.0: "draw", -1.0: "lose"}[reward]
        return reward, True, False

    def prompt(self) -> str:
        return blackjack_prompt()

    def state(self) -> dict[str, Any]:
        player_total, usable = self._total(self.player)
        return {
            "task": self.task,
            "player_cards": list(self.player),
            "dealer_cards": list(self.dealer),
            "player_total": player_total,
            "usable_ace": usable,
            "dealer_showing": self.value(self.dealer[0]),
            "dealer_total": self._total(self.dealer)[0],
            "outcome": self.outcome,
            "steps": self.elapsed,
        }

    def _draw(self) -> np.ndarray:
        return _draw_table(self.size, self.dealer, self.player)

    @classmethod
    def draw_state(cls, state: dict[str, Any], size: int) -> np.ndarray:
        return _draw_table(size, list(state["dealer_cards"]), list(state["player_cards"]))


def _draw_table(s: int, dealer: list[str], player: list[str]) -> np.ndarray:
    """The dealer's up card and hole card, the player's hand in rows of five."""
    img, draw = render.canvas(s)
    label = render.font(int(s * 0.08), bold=True)
    w, h = int(s * 0.2), int(s * 0.28)
    draw.text((s * 0.02, s * 0.01), "Dealer", fill=render.WHITE, font=label)
    img.paste(render.card_image(dealer[0], w, h), (int(s * 0.02), int(s * 0.11)))
    img.paste(render.card_back(w, h), (int(s * 0.04) + w, int(s * 0.11)))
    draw.text((s * 0.02, s * 0.42), "Player", fill=render.WHITE, font=label)
    rows = (len(player) + 4) // 5  # five a row; more rows shrink the cards to fit
    ph = min(h, int(s * 0.46 / rows - s * 0.01))
    pw = min(w, int(ph * 5 / 7))
    for i, card in enumerate(player):
        x = s * 0.02 + (i % 5) * (pw + s * 0.01)
        y = s * 0.52 + (i // 5) * (ph + s * 0.01)
        img.paste(render.card_image(card, pw, ph), (int(x), int(y)))
    return render.to_array(img)
