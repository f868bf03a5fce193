"""A run's env sessions and their episodes: opened with the run's seeds, regrouped for GRPO,
closed; the open episode of each env (its cursor) and the success windows episodes end into."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.orm import Session

from services.controller import metrics as M
from services.controller import store
from services.controller.backends import Envs
from services.controller.recorder import (
    EpisodeCursor,
    abandon_episodes,
    close_episode,
    open_episode,
)
from services.env.display import record_time_size
from shared.db.session import session_scope
from shared.schemas import GROUP_ALGORITHMS, RunConfig
from shared.seeds import train_env_seed

log = logging.getLogger("gtr.controller")
MAX_EPISODE_STEPS = 1000  # the evaluation's bound too, where env.max_episode_steps is unset


class Episodes:
    """The run's ``num_envs`` env sessions, the observation each is at, and its open episode."""

    def __init__(self, run_id: int, envs: Envs, cfg: RunConfig) -> None:
        self.run_id, self.envs, self.cfg = run_id, envs, cfg
        self.sessions: list[str] = []
        self.obs: list[Any] = []
        self.cursors: list[EpisodeCursor] = []
        self.opened_for = -1  # the update whose seeds the open env sessions have
        self.success = M.SuccessWindow(cfg.metrics.success_window)
        self.subtasks: dict[str, M.SuccessWindow] = {}

    def open(self, u: int) -> None:
        # grpo: the G envs of a group share a seed, so their k-th episodes are the same deal.
        per = self.cfg.train.group_size if self.cfg.algorithm in GROUP_ALGORITHMS else 1
        self.opened_for = u
        # Frames for people are drawn from the stored state when viewed; only those no state can
        # redraw (THOR's camera) are drawn while recording.
        size = record_time_size(self.cfg.task, self.cfg.env.model_dump())
        # grpo by episodes keeps the env's own step cap: the other arms' and the evaluation's.
        env = self.cfg.env.model_copy(update={"display_size": size})
        with session_scope() as s:
            for e in range(self.cfg.train.num_envs):
                # A resumed run gets fresh seeds: its envs restart, so must not replay old deals.
                seed = train_env_seed(self.cfg.seed, u, e // per)  # shared/seeds.py
                sid = self.envs.create(self.cfg.task, env, seed=seed)
                self.sessions.append(sid)
                self.obs.append(self.envs.reset(sid))
                seq = store.next_episode_seq(s, self.run_id, e)
                self.cursors.append(open_episode(s, self.run_id, e, seq, u))

    @property
    def rollout_steps(self) -> int:
        """Most batched steps a rollout takes: ``num_steps``; grpo by episodes: until every
        env's episode ended, which the env's time limit bounds (``max_episode_steps``)."""
        if self.whole_episodes:
            return self.cfg.env.max_episode_steps or MAX_EPISODE_STEPS
        return self.cfg.train.num_steps

    @property
    def whole_episodes(self) -> bool:
        """grpo with ``train.grpo_rollout = "episodes"``: a rollout is each env's one episode."""
        return self.cfg.algorithm in GROUP_ALGORITHMS and self.cfg.train.grpo_rollout == "episodes"

    def for_update(self, u: int) -> None:
        """grpo: every rollout starts fresh groups (same deal within a group, new deals per
        update); the episodes still running are cut off (their steps train nothing)."""
        if self.cfg.algorithm not in GROUP_ALGORITHMS or self.opened_for == u:
            return
        with session_scope() as s:
            abandon_episodes(s, self.cursors)
        self.close()
        self.obs, self.cursors = [], []
        self.open(u)

    def close(self) -> None:
        for sid in self.sessions:
            try:
                self.envs.close(sid)
            except Exception:  # the env service may be the thing that failed
                log.debug("closing env session %s failed", sid)
        self.sessions.clear()

    def forget(self) -> None:
        """After an outage (the sessions closed): what ``open`` and ``restore`` fill again."""
        self.success = M.SuccessWindow(self.cfg.metrics.success_window)
        self.subtasks, self.obs, self.cursors = {}, [], []

    def restore(self, s: Session) -> None:
        """A resumed run: the success window refilled from the episodes it finished."""
        for r in store.last_finished_episodes(s, self.run_id, self.success.size):
            self.success.add(bool(r.success), float(r.total_return), int(r.length))

    def ended(self, cur: EpisodeCursor, success: bool, final: dict[str, Any]) -> None:
        """An episode ended (on the recorder thread): the success windows."""
        if "subtask" in final:  # ALFWorld: success per subtask (pick, look, clean, ...)
            cur.meta = {
                "subtask": final["subtask"],
                "synthetic": bool(final.get("synthetic")),
                "benchmark": bool(final.get("benchmark")),
            }
            window = self.subtasks.setdefault(final["subtask"], M.SuccessWindow(self.success.size))
            window.add(success, cur.total_return, cur.length)
        self.success.add(success, cur.total_return, cur.length)

    def cut(self, s: Session, e: int, u: int) -> None:
        """Env ``e``'s episode was ended from outside (a failure): a new one begins."""
        cur = self.cursors[e]
        close_episode(s, cur, False)
        self.success.add(False, cur.total_return, cur.length)
        self.cursors[e] = open_episode(s, self.run_id, e, cur.seq + 1, u)
        self.obs[e] = self.envs.reset(self.sessions[e])

    def success_metrics(self) -> dict[str, Any]:
        per_subtask = {
            f"success/{k}": w.summary()["success_rate"] for k, w in self.subtasks.items()
        }
        return {**self.success.summary(), **per_subtask}
