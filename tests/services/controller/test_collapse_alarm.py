"""The collapse alarm on real probe sets and on the probe curves of real runs.

The probe states come from the driver's own ``CollapseMonitor.states`` on the real env pool. The
curves are the greedy probes of the tiny EZPoints runs in ../shared/docs/tiny-ezpoints.md (PPO
collapses in 3/3 seeds, GTR in none) and the runs of issue 25 (a NumberLine GTR warm start that
never read the state; an ALFWorld sample run whose probe repeated one view).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import pytest

from services.controller import metrics as M

LIMITS = M.AlarmLimits(min_relevance=0.3, max_top_share=0.5, relevance_drop=0.5, warmup_updates=10)


@dataclass
class _Gen:
    text: str


class Scripted:
    """Writes, for each probe image and prompt, the output it was given for that state."""

    def __init__(self, outputs: dict[tuple[str, str], str]) -> None:
        self.outputs = outputs

    def generate(self, images: list[Any], prompts: list[str], **kw: Any) -> list[_Gen]:
        assert kw["greedy"] is True
        return [_Gen(self.outputs[_key(i, p)]) for i, p in zip(images, prompts, strict=True)]


def _key(image: Any, prompt: str) -> tuple[str, str]:
    return hashlib.sha1(image.tobytes()).hexdigest(), prompt


def _driver(task: str, probe_states: int, policy: Any = None) -> Any:
    from services.api.service import create_run
    from services.controller.service import RunDriver
    from services.env.service import EnvPool
    from shared.db.session import session_scope
    from shared.schemas import RunConfig

    cfg = RunConfig.model_validate(
        {"task": task, "env": {"image_size": 64}, "metrics": {"probe_states": probe_states}}
    )
    with session_scope() as s:
        run_id = create_run(s, cfg, team="default").id
    return RunDriver(run_id, EnvPool(), policy, None, None)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def ezpoints_probe(pg_url: str) -> tuple[Any, list[Any]]:
    d = _driver("ezpoints", 120)
    return d, d.monitor.states()


def test_probe_states_are_distinct_and_tracking_them_raises_no_alarm(
    ezpoints_probe: tuple[Any, list[Any]],
) -> None:
    from services.env.expert import expert_output, format_output

    d, probe = ezpoints_probe
    keys = [_key(o.image, o.prompt) for o in probe]
    assert len(probe) == 120 and len(set(keys)) == 120  # seeds repeat deals: walked past them
    outputs = [format_output(expert_output("ezpoints", o.state)) for o in probe]
    ideal = dict(zip(keys, outputs, strict=True))
    d.monitor.policy = Scripted(ideal)
    tracking = d.monitor.probe(probe)
    assert tracking["probe_relevance"] == 1.0
    # Perfect tracking shows exactly the share the states give, and no alarm.
    assert tracking["probe_top_thought_share"] == tracking["probe_expected_top_share"] < 0.2
    assert M.alarm_reason(tracking, 1.0, 20, LIMITS) is None
    # One thought everywhere (tiny-ezpoints seed 2, update 50: "8 + 4 = 12, next I append '+'").
    one = json.dumps({"cards": [4, 8], "formula": "4", "thoughts": "4 + 8 = 12", "action": "+"})
    d.monitor.policy = Scripted(dict.fromkeys(keys, one))
    collapsed = d.monitor.probe(probe)
    reason = M.alarm_reason(collapsed, tracking["probe_relevance"], 50, LIMITS)
    assert reason is not None and "under the run's best 1.00" in reason
    no_relevance = {k: v for k, v in collapsed.items() if k != "probe_relevance"}
    reason = M.alarm_reason(no_relevance, None, 50, LIMITS)
    assert reason is not None and "one thought carries 1.00 of the probe" in reason


def _alarms(relevance: list[float], top: list[float], s0: float, every: int = 1) -> list[bool]:
    """The alarm at each probe of a run, as the driver raises it (best of the earlier probes)."""
    out = []
    for i, (rel, share) in enumerate(zip(relevance, top, strict=True)):
        best = max(relevance[:i], default=None)
        m = {"probe_relevance": rel, "probe_top_thought_share": share}
        out.append(M.alarm_reason(m | {"probe_expected_top_share": s0}, best, i * every, LIMITS))
    return [r is not None for r in out]


# tiny-ezpoints.md, greedy probes every 10 updates (update 0 = the warm start), per seed.
PPO = {
    0: ([0.73, 0.46, 0.28, 0.13, 0.04, 0.00, 0.00], [0.11, 0.16, 0.39, 0.64, 0.70, 0.95, 0.82]),
    1: ([0.73, 0.55, 0.49, 0.20, 0.07, 0.07, 0.07], [0.11, 0.09, 0.10, 0.23, 0.18, 0.16, 0.23]),
    2: ([0.73, 0.16, 0.25, 0.17, 0.06, 0.14, 0.10], [0.11, 0.16, 0.26, 0.42, 0.61, 0.97, 0.43]),
}
GTR = {
    0: ([0.73, 0.84, 0.84, 0.84, 0.95, 0.91, 0.70], [0.11, 0.16, 0.09, 0.07, 0.07, 0.07, 0.23]),
    1: ([0.73, 0.78, 0.85, 0.90, 0.75, 0.99, 0.93], [0.11, 0.10, 0.10, 0.08, 0.10, 0.07, 0.07]),
    2: ([0.73, 0.45, 0.88, 0.90, 0.82, 0.88, 0.94], [0.11, 0.19, 0.10, 0.07, 0.11, 0.07, 0.07]),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ppo_collapse_is_alarmed_and_gtr_is_not(
    seed: int, ezpoints_probe: tuple[Any, list[Any]]
) -> None:
    d, _ = ezpoints_probe
    s0 = max(M.top_share(d.monitor.ideal), M.top_share(d.monitor.images))  # the real probe set
    ppo, gtr = _alarms(*PPO[seed], s0, every=10), _alarms(*GTR[seed], s0, every=10)
    assert not any(gtr), gtr
    assert not ppo[0] and all(ppo[3:]), ppo  # collapsed by update 30 in every seed


def test_no_alarm_on_a_warm_up_that_never_read_nor_on_a_repeated_view() -> None:
    # Issue 25: a 3-update NumberLine GTR run from a warm start at relevance 0.13.
    assert _alarms([0.13, 0.13, 0.14], [0.2, 0.2, 0.2], s0=0.05) == [False] * 3
    # ... which, still not reading after the warm-up updates, is alarmed on.
    assert _alarms([0.13] * 11, [0.2] * 11, s0=0.05)[-1]
    # Issue 25, ALFWorld sample: relevance 1.00, top share 0.62-0.75 where 6 of 8 probe states
    # show the room's start view (a thought that reads the picture repeats on them).
    s0 = M.top_share(["start"] * 6 + ["sinkbasin 1", "microwave 1"])
    assert _alarms([1.0, 1.0, 1.0], [0.62, 0.75, 0.75], s0) == [False] * 3


class Writer:
    """Writes the given output for the probe states it knows, and ``default`` elsewhere."""

    def __init__(self, outputs: dict[tuple[str, str], str], default: str) -> None:
        self.outputs, self.default = outputs, default

    def generate(self, images: list[Any], prompts: list[str], **kw: Any) -> list[Any]:
        from tests.services.controller.test_display_frames import _Gen as Full

        keys = [_key(i, p) for i, p in zip(images, prompts, strict=True)]
        return [Full(self.outputs.get(k, self.default)) for k in keys]


def test_a_collapse_in_the_first_update_falls_from_the_start_policy(pg_url: str) -> None:
    """The driver probes the policy it starts from: a first update that breaks every thought
    is alarmed on, with the numbers, in the update row it records."""
    from services.env.expert import expert_output, format_output
    from shared.db.models import Run, Update
    from shared.db.session import session_scope

    policy = Writer({}, "")
    d = _driver("numberline", 16, policy)
    d.cfg.train.num_envs, d.cfg.train.num_steps = 2, 2
    probe = d.monitor.states()
    policy.outputs = {
        _key(o.image, o.prompt): format_output(expert_output("numberline", o.state)) for o in probe
    }
    policy.default = '{"action": "+"}'  # reads every probe state right
    d.monitor.probe_start(probe)
    policy.outputs, policy.default = {}, "+ + + +"  # after the update: no thought at all
    d.episodes.open(0)
    d._rollout_and_store(0)
    d.episodes.close()
    d._finish_update(0, probe)
    with session_scope() as s:
        row = s.scalars(select_update(Update, d.run_id)).one()
        run = s.get(Run, d.run_id)
        assert run is not None and run.alarm and row.alarm
        assert row.metrics["probe_relevance_start"] == 1.0 and row.metrics["probe_relevance"] == 0.0
        assert "0.00 fell below 0.50, 50% under the run's best 1.00" in row.metrics["alarm_reason"]


def select_update(model: Any, run_id: int) -> Any:
    from sqlalchemy import select

    return select(model).where(model.run_id == run_id)
