"""The schematic observation: deterministic, and showing what the state says."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.services.alfworld.conftest import Walk


def _centre(box: tuple[int, ...], size: int = 300) -> tuple[int, int]:
    k = size / 300
    return round((box[1] + box[3]) / 2 * k), round((box[0] + box[2]) / 2 * k)


def _state(**over: Any) -> dict[str, Any]:
    base = {
        "front": "countertop 1",
        "front_open": None,
        "visible": ["apple 1", "knife 2"],
        "holding": None,
        "object_states": {},
        "receptacles": ["countertop 1", "fridge 1"],
    }
    return base | over


def test_rendering_is_deterministic_and_sized() -> None:
    from services.env.alfworld.render import render_state

    a, b = render_state(_state(), 300), render_state(_state(), 300)
    assert a.dtype == np.uint8 and a.shape == (300, 300, 3) and np.array_equal(a, b)
    assert render_state(_state(), 64).shape == (64, 64, 3)
    assert not np.array_equal(a, render_state(_state(visible=["apple 1"]), 300))


def test_held_object_is_drawn_in_its_colour_with_its_state_ring() -> None:
    from services.env.alfworld.render import HELD_TILE, STATE_RING, render_state, type_colour

    empty = render_state(_state(), 300)
    held = render_state(_state(holding="potato 1"), 300)
    hot = render_state(_state(holding="potato 1", object_states={"potato 1": ["hot"]}), 300)
    y, x = _centre(HELD_TILE)
    assert tuple(held[y, x]) == type_colour("potato") and tuple(empty[y, x]) != type_colour(
        "potato"
    )
    ring_y = round(HELD_TILE[1] + 2)  # inside the ring at the top of the disc
    assert (
        tuple(hot[ring_y, x]) == STATE_RING["hot"] and tuple(held[ring_y, x]) != STATE_RING["hot"]
    )


def test_closed_receptacle_hides_its_objects() -> None:
    from services.env.alfworld.render import render_state, type_colour

    opened = render_state(_state(front="fridge 1", front_open=True, visible=["apple 1"]), 300)
    closed = render_state(_state(front="fridge 1", front_open=False, visible=[]), 300)
    apple = np.array(type_colour("apple"))
    assert (opened == apple).all(axis=2).sum() > 100  # the apple's disc
    assert (closed == apple).all(axis=2).sum() == 0


def test_env_images_follow_the_game(walk: Walk) -> None:
    from services.env.alfworld.render import HELD_TILE, RECEP_BOX, render_state, type_colour

    _, _, records = walk
    for state, _, image, _, _ in records:
        assert np.array_equal(image, render_state(state, 300))  # a pure function of the state
    y, x = _centre(HELD_TILE)
    assert tuple(records[1][2][y, x]) != type_colour("potato")  # not yet taken
    assert tuple(records[2][2][y, x]) == type_colour("potato")  # 'take potato 1'
    # The receptacle in front is drawn in its type's colour (inside the frame, off the labels).
    ry, rx = round(RECEP_BOX[3] - 6), round(RECEP_BOX[2] - 6)
    assert tuple(records[1][2][ry, rx]) == type_colour("countertop", light=True)
    assert tuple(records[3][2][ry, rx]) == type_colour("microwave", light=True)


def test_a_stored_state_redraws_the_display_frame(walk: Walk) -> None:
    """A step page draws ALFWorld's frame from the step's stored (JSON) state: the same
    picture the env draws at that size; THOR frames cannot be redrawn and are not."""
    import json

    from services.env.alfworld.render import render_state
    from services.env.display import draw_state, record_time_size

    text, thor = {"options": {"backend": "text"}}, {"options": {"backend": "thor"}}
    for state, _, _, _, _ in walk[2]:
        stored = json.loads(json.dumps(state))
        drawn = draw_state("alfworld", text, stored, 320)
        assert drawn is not None and np.array_equal(drawn, render_state(state, 320))
        assert draw_state("alfworld", thor, stored, 320) is None
    assert record_time_size("alfworld", text) == 0  # drawn on demand, not while recording
    assert record_time_size("alfworld", thor | {"image_size": 64}) == 320
