"""The tokenizer text of ALFWorld's tiny model: well-formed lines, and a real game's text
tokenized about twice as short as by the card games' tokenizer."""

from __future__ import annotations

import json
from typing import Any

from services.env.alfworld.corpus import corpus
from services.policy.tiny import train_tokenizer


def test_corpus_is_prompts_and_oracle_outputs(alfworld_installed: None) -> None:
    lines = list(corpus(50, seed=3))
    assert len(lines) == 100 and lines == list(corpus(50, seed=3))
    prompts, outputs = lines[::2], lines[1::2]
    assert all("Your admissible actions" in p for p in prompts)
    for text in outputs:
        out = json.loads(text)
        assert set(out) == {"thoughts", "action"} and "Next sub-goal" in out["thoughts"]


def test_alfworld_tokenizer_halves_a_real_games_text(walk: Any) -> None:
    from services.env.expert import corpus as card_corpus

    _, _, records = walk
    text = [r[1] for r in records]  # the real game's prompts
    ours = train_tokenizer(list(corpus(300)), "llava")
    cards = train_tokenizer(list(card_corpus(500)), "llava")
    n_ours = sum(len(ours(t)["input_ids"]) for t in text)
    n_cards = sum(len(cards(t)["input_ids"]) for t in text)
    assert n_ours * 2 < n_cards
