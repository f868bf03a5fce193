"""The thought-collapse monitor: a fixed probe set of states, decoded greedily after each update,
its relevance and top-thought share, and the alarm when they fall from the run's best."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from services.controller import metrics as M
from services.controller import store
from services.controller.backends import Envs
from services.controller.evaluate import greedy_generate, protocol
from shared.schemas import RunConfig
from shared.seeds import probe_seed

if TYPE_CHECKING:
    from services.policy.protocol import RolloutPolicy


# "Thought guidance drowned": the thought-SFT term's share of the applied step
# (sft/grad_share, services/trainer/service.py) under GUIDANCE_SHARE for GUIDANCE_UPDATES updates in
# a row while its loss fell by less than GUIDANCE_FALL of its value at the window's start. Study
# v3's GTR: share ~0.05 under one clip at 1.0, losses/sft 0.288 -> 0.219 over 60 updates.
GUIDANCE_SHARE = 0.1
GUIDANCE_UPDATES = 5
GUIDANCE_FALL = 0.1
SHARE, SFT_LOSS = "sft/grad_share", "losses/sft"


def guidance_drowned(window: list[dict[str, Any]]) -> str | None:
    """The alarm's reason when the last GUIDANCE_UPDATES updates' metrics (oldest first) show
    the guidance drowned; None otherwise (too few updates, no SFT term, or it was learnt)."""
    last = window[-GUIDANCE_UPDATES:]
    if len(last) < GUIDANCE_UPDATES or any(SHARE not in m or SFT_LOSS not in m for m in last):
        return None
    shares = [float(m[SHARE]) for m in last]
    first, now = float(last[0][SFT_LOSS]), float(last[-1][SFT_LOSS])
    if max(shares) >= GUIDANCE_SHARE or now < first * (1 - GUIDANCE_FALL):
        return None
    return (
        f"thought guidance drowned: the SFT term's share of the step stayed under "
        f"{GUIDANCE_SHARE:.2f} (at most {max(shares):.3f}) for {GUIDANCE_UPDATES} updates while "
        f"losses/sft did not fall ({first:.3f} -> {now:.3f})"
    )


class CollapseMonitor:
    def __init__(self, run_id: int, envs: Envs, policy: RolloutPolicy, cfg: RunConfig) -> None:
        self.run_id, self.envs, self.policy, self.cfg = run_id, envs, policy, cfg
        self.ideal: list[str] = []  # the oracle's thought for each probe state
        self.images: list[str] = []  # each probe state's image sha
        self.start_relevance: float | None = None  # the policy before any update

    def states(self) -> list[Any]:
        """A fixed set of distinct states (by image and prompt), the same each update: the first
        observation of each seeded episode or, where that one is already in the set (every
        ALFWorld game of a kitchen opens on one view), a state a few expert steps later."""
        found: dict[tuple[str, str], Any] = {}
        for i in range(self.cfg.metrics.probe_states):
            self._walk(probe_seed(i), found)  # the same for every run of a task
        out = list(found.values())
        self.ideal = [self._ideal_thought(o.state) for o in out]
        self.images = [sha for sha, _ in found]
        return out

    def _walk(self, seed: int, found: dict[tuple[str, str], Any], steps: int = 3) -> None:
        """Add one new state of a seeded episode to ``found``: its first, else the first of up
        to ``steps`` expert steps that looks new, else one whose prompt is new (one reset per
        call: ALFWorld's cost seconds)."""
        from services.env.expert import expert_output, format_output

        images = {sha for sha, _ in found}
        fallback: tuple[tuple[str, str], Any] | None = None
        env = protocol(self.cfg).env  # the evaluation's rules; never recorded
        sid = self.envs.create(self.cfg.task, env, seed=seed)
        try:
            o = self.envs.reset(sid)
            for _ in range(steps + 1):
                key = (hashlib.sha1(o.image.tobytes()).hexdigest(), o.prompt)
                if key[0] not in images:
                    found[key] = o
                    return
                if fallback is None and key not in found:
                    fallback = (key, o)
                text = format_output(expert_output(self.cfg.task, o.state))
                o = self.envs.step_batch([(sid, text)])[0].observation
        finally:
            self.envs.close(sid)
        if fallback is not None:
            found[fallback[0]] = fallback[1]

    def _ideal_thought(self, state: dict) -> str:
        """The oracle's thought for a state, as the parser reads the agent's."""
        from services.env.expert import expert_output, format_output

        return str(self._parse(format_output(expert_output(self.cfg.task, state)), state).thought)

    def probe(self, probe: list[Any]) -> dict[str, float]:
        gens = greedy_generate(self.policy, probe, protocol(self.cfg).max_new_tokens)
        views = []
        for o, g in zip(probe, gens, strict=True):
            p = self._parse(g.text, o.state)
            views.append(
                M.StepView(p.thought, p.action_text, p.format_valid, p.action_valid, o.state)
            )
        return M.probe_metrics(views, self.relevant, self.ideal, self.images)

    def probe_start(self, probe: list[Any]) -> None:
        """The policy before any update: the level a collapse in the first update falls from."""
        self.start_relevance = self.probe(probe)["probe_relevance"]

    def figures(self, probe: list[Any], u: int) -> dict[str, Any]:
        """Update ``u``'s probe figures (none without a probe set)."""
        out: dict[str, Any] = self.probe(probe) if probe else {}
        if u == 0 and self.start_relevance is not None:
            out["probe_relevance_start"] = self.start_relevance
        return out

    def _parse(self, text: str, state: dict) -> Any:
        if self.cfg.task == "alfworld":
            # Admissible commands change with the state: parse against the probe state's own.
            from services.env.alfworld.env import parse_with_commands

            return parse_with_commands(text, list(state["admissible"]))
        from services.env import make_env

        if not hasattr(self, "_parser_env"):
            self._parser_env: Any = make_env(
                self.cfg.task, protocol(self.cfg).env, seed=0
            ).unwrapped
        return self._parser_env.parse(text)

    def relevant(self, thought: str, state: dict) -> bool:
        from services.env.expert import thought_matches_state

        return bool(thought_matches_state(self.cfg.task, thought, state))

    def alarm(self, s: Session, u: int, merged: dict[str, Any]) -> str | None:
        """Update ``u``'s alarm (None: none), set as ``alarm_reason`` in its ``merged`` metrics."""
        m = self.cfg.metrics
        limits = M.AlarmLimits(
            m.min_relevance, m.max_top_thought_share, m.relevance_drop, m.alarm_warmup_updates
        )
        reason = M.alarm_reason(merged, self._best_relevance(s, u, merged), u, limits)
        if reason is None and SHARE in merged:
            earlier = store.metrics_before(s, self.run_id, u)[-(GUIDANCE_UPDATES - 1) :]
            reason = guidance_drowned([*earlier, merged])
        merged.pop("alarm_reason", None)
        if reason is not None:
            merged["alarm_reason"] = reason
        return reason

    def _best_relevance(self, s: Session, u: int, current: dict[str, Any]) -> float | None:
        """The best probe relevance before update ``u``: of the earlier updates and of the
        policy before the first one (None when there is none)."""
        rows = store.metrics_before(s, self.run_id, u)
        keys = ("probe_relevance", "probe_relevance_start")
        seen = [float(m[k]) for m in rows for k in keys if k in m]
        if "probe_relevance_start" in current:  # update 0: the policy it started from
            seen.append(float(current["probe_relevance_start"]))
        return max(seen, default=None)
