"""Every recorded step keeps a display-resolution frame for people beside the model's input,
served by the API the step page reads."""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

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


@pytest.mark.parametrize("task", ["numberline", "points24", "blackjack"])
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
    wire = ObservationOut.of(obs).to_observation()  # over the env service's REST
    assert wire.display_png == obs.display_png
    # Outside a run's recorded steps (None), or asked for none, or no larger: none is drawn.
    for size in (None, 0, 64):
        sid = pool.create(task, {"image_size": 64, "display_size": size}, seed=3)
        assert pool.reset(sid).display_png is None


def test_steps_reference_a_display_blob_served_by_the_api(pg_url: str) -> None:
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
            "env": {"image_size": 64},  # display_size unset: a run records 320 px frames
            "train": {"num_envs": 2, "num_steps": 2},
        }
    )
    with session_scope() as s:
        run_id = create_run(s, cfg, team="frames").id
        token = create_token(s, "frames", "read", "frames")[1]
    driver = RunDriver(run_id, EnvPool(), AlwaysPlus(), None, None)  # type: ignore[arg-type]
    driver._open_envs(0)
    step_ids = driver.collect(0).step_ids
    driver._close_envs()
    with live_server(create_app()) as url:
        auth = {"Authorization": f"Bearer {token}"}
        with httpx.Client(base_url=url, headers=auth, timeout=30) as api:
            api_step_display = api.get(f"/api/steps/{step_ids[0]}").json()["display_sha"]
            for sid in step_ids:
                step = api.get(f"/api/steps/{sid}").json()
                assert step["display_sha"] and step["display_sha"] != step["image_sha"]
                model_input = _png(api.get(f"/api/blobs/{step['image_sha']}").content)
                shown = _png(api.get(f"/api/blobs/{step['display_sha']}").content)
                assert model_input.shape == (64, 64, 3) and shown.shape == (320, 320, 3)
            api.cookies.set(COOKIE_NAME, token)
            page = api.get(f"/runs/{run_id}/steps/{step_ids[0]}", headers={"Authorization": ""})
    assert page.status_code == 200, page.text[:500]
    first = api_step_display
    assert f'src="/api/blobs/{first}"' in page.text  # the step page shows the display frame
