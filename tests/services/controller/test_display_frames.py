"""Every recorded step has a display-resolution frame for people beside the model's input:
drawn from the step's stored state when first viewed (never on the rollout's path), stored as a
blob, and served by the route the step page reads."""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from services.env.registry import CARD_ENVS
from services.env.schemas import ObservationOut
from services.env.service import EnvPool


@dataclass
class _Gen:
    text: str
    token_ids: list[int] = field(default_factory=lambda: [1])
    logprobs: list[float] = field(default_factory=lambda: [0.0])
    entropy: list[float] = field(default_factory=lambda: [0.0])
    thought_mask: list[bool] = field(default_factory=lambda: [False])
    action_mask: list[bool] = field(default_factory=lambda: [True])
    value: float = 0.0


class AlwaysPlus:
    """A policy that always answers '+' (the frames, not the answers, are under test)."""

    def generate(self, images: list[Any], prompts: list[str], **kw: Any) -> list[_Gen]:
        return [_Gen('{"thoughts": "up", "action": "+"}') for _ in images]


def _png(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


@pytest.mark.parametrize("task", ["numberline", "ezpoints", "points24", "blackjack"])
def test_the_display_frame_is_the_same_picture_larger(task: str) -> None:
    pool = EnvPool()
    sid = pool.create(task, {"image_size": 64, "display_size": 384}, seed=3)
    obs = pool.reset(sid)
    assert obs.image.shape == (64, 64, 3) and obs.display_png is not None
    assert _png(obs.display_png).shape == (384, 384, 3)
    other = pool.reset(pool.create(task, {"image_size": 64, "display_size": 384}, seed=4))
    assert other.state != obs.state and other.display_png is not None

    def gap(display: bytes) -> float:  # to the model's input, once shrunk to its size
        small = Image.fromarray(_png(display)).resize((64, 64), Image.Resampling.BOX)
        return float(np.abs(np.asarray(small, dtype=int) - obs.image.astype(int)).mean())

    assert gap(obs.display_png) < gap(other.display_png)  # the same drawing, not another deal
    # The stored (JSON) state draws the same frame again, for the step page.
    redrawn = CARD_ENVS[task].draw_state(json.loads(json.dumps(obs.state)), 384)
    assert np.array_equal(redrawn, _png(obs.display_png))
    wire = ObservationOut.of(obs).to_observation()  # over the env service's REST
    assert wire.display_png == obs.display_png
    # Outside a run's recorded steps (None), or asked for none, or no larger: none is drawn.
    for size in (None, 0, 64):
        sid = pool.create(task, {"image_size": 64, "display_size": size}, seed=3)
        assert pool.reset(sid).display_png is None


def test_the_step_page_draws_the_display_frame_from_the_stored_state(pg_url: str) -> None:
    from services.api.app import create_app
    from services.api.auth import COOKIE_NAME, create_token
    from services.api.service import create_run
    from services.controller.service import RunDriver
    from shared.db.session import session_scope
    from shared.schemas import RunConfig
    from tests.conftest import live_server

    cfg = RunConfig.model_validate(
        {
            "task": "numberline",
            "env": {"image_size": 64},  # display_size unset: a run's steps get 320 px frames
            "train": {"num_envs": 2, "num_steps": 2},
        }
    )
    with session_scope() as s:
        run_id = create_run(s, cfg, team="frames").id
        token = create_token(s, "frames", "read", "frames")[1]
        other = create_token(s, "others", "read", "others")[1]
    driver = RunDriver(run_id, EnvPool(), AlwaysPlus(), None, None)  # type: ignore[arg-type]
    driver.episodes.open(0)
    step_ids = driver.collector.collect(0).step_ids
    driver.episodes.close()
    with live_server(create_app()) as url:
        auth = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=url, headers=auth, timeout=30) as api:
            for sid in step_ids:
                step = api.get(f"/api/steps/{sid}").json()
                assert step["display_sha"] is None  # nothing was drawn while recording
                first = api.get(step["display_url"])
                assert first.status_code == 200 and first.headers["content-type"] == "image/png"
                shown = _png(first.content)
                model_input = _png(api.get(f"/api/blobs/{step['image_sha']}").content)
                assert model_input.shape == (64, 64, 3) and shown.shape == (320, 320, 3)
                drawn = CARD_ENVS["numberline"].draw_state(step["state"], 320)
                assert np.array_equal(shown, drawn)  # the step's own state, not another
                # Stored once by content hash: the next view is the blob, or a 304.
                sha = api.get(f"/api/steps/{sid}").json()["display_sha"]
                assert sha == hashlib.sha256(first.content).hexdigest()
                assert api.get(f"/api/blobs/{sha}").content == first.content
                again = api.get(step["display_url"], headers={"If-None-Match": f'"{sha}"'})
                assert again.status_code == 304 and again.headers["etag"] == f'"{sha}"'
                assert api.get(step["display_url"]).content == first.content
            hidden = api.get(
                f"/api/steps/{step_ids[0]}/display", headers={"Authorization": f"Bearer {other}"}
            )
            assert hidden.status_code == 404  # another team's step is not there at all
            api.cookies.set(COOKIE_NAME, token)
            page = api.get(f"/runs/{run_id}/steps/{step_ids[0]}", headers={"Authorization": ""})
    assert page.status_code == 200, page.text[:500]
    assert f'src="/api/steps/{step_ids[0]}/display"' in page.text  # the page shows that frame
