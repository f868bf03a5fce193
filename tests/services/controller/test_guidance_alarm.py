"""The "thought guidance drowned" alarm: the SFT term's share of the applied step under
GUIDANCE_SHARE for GUIDANCE_UPDATES updates while its loss does not fall (monitor.py)."""

from __future__ import annotations

from typing import Any

from services.controller.monitor import (
    GUIDANCE_SHARE,
    GUIDANCE_UPDATES,
    CollapseMonitor,
    guidance_drowned,
)


def _updates(shares: list[float], losses: list[float]) -> list[dict[str, Any]]:
    return [
        {"sft/grad_share": s, "losses/sft": loss} for s, loss in zip(shares, losses, strict=True)
    ]


def test_a_small_share_and_a_flat_loss_for_n_updates_is_the_alarm() -> None:
    n = GUIDANCE_UPDATES
    drowned = _updates([0.05] * n, [0.288, 0.285, 0.28, 0.279, 0.27][:n])
    reason = guidance_drowned(drowned)
    assert reason is not None and reason.startswith("thought guidance drowned")
    assert "0.288 -> 0.270" in reason


def test_no_alarm_where_the_guidance_is_heard_or_learnt_or_too_young() -> None:
    n = GUIDANCE_UPDATES
    assert guidance_drowned(_updates([0.05] * (n - 1), [0.3] * (n - 1))) is None  # too few
    heard = _updates([0.05] * (n - 1) + [GUIDANCE_SHARE], [0.3] * n)
    assert guidance_drowned(heard) is None  # one update in the window had its share
    learnt = _updates([0.05] * n, [0.3, 0.25, 0.2, 0.15, 0.1][:n])
    assert guidance_drowned(learnt) is None  # the SFT loss falls: it is being learnt
    assert guidance_drowned([{"losses/ppo": 1.0}] * n) is None  # an arm with no SFT term


def test_the_monitor_raises_it_from_the_stored_updates(pg_url: str) -> None:
    from services.controller import store
    from services.controller.launch import create_run
    from services.env.service import EnvPool
    from shared.db.session import session_scope
    from shared.schemas import RunConfig

    with session_scope() as s:
        run_id = create_run(s, RunConfig.model_validate({"task": "numberline"}), team="t").id
        cfg = store.run_config(s, run_id)
        for u, m in enumerate(_updates([0.04] * 4, [0.3, 0.3, 0.29, 0.29])):
            store.add_update(s, run_id, u, m)
    monitor = CollapseMonitor(run_id, EnvPool(), None, cfg)  # type: ignore[arg-type]
    merged = {"sft/grad_share": 0.03, "losses/sft": 0.29, "probe_relevance": 1.0}
    with session_scope() as s:
        reason = monitor.alarm(s, 4, merged)
    assert reason is not None and "thought guidance drowned" in reason
    assert merged["alarm_reason"] == reason
    with session_scope() as s:  # an update where the term had its share: no alarm
        assert monitor.alarm(s, 4, merged | {"sft/grad_share": 0.5}) is None
