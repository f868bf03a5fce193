"""The rollout collector: ``num_steps`` batched steps over the run's env sessions. Every step is
written to the store at once, on the recorder thread, and each well-formed one queued for
correction at once, so corrections run while the rollout goes on; in ``corrector.wait = "step"``
the step's verdicts are waited for and, with ``corrector.feedback``, acted on (GTR's loop)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from services.controller import metrics as M
from services.controller import store
from services.controller.backends import Envs
from services.controller.correction_book import CorrectionBook
from services.controller.episodes import Episodes
from services.controller.outages import Cancelled
from services.controller.timing import StageClock
from services.controller.writer import FrameShas, StepRecord, WritePipeline, record_step_batch
from services.policy.rollout import RolloutStep, rollout_step
from services.policy.schemas import MAX_SAMPLES
from shared.db.session import session_scope
from shared.rollout import Rollout
from shared.schemas import RunConfig
from shared.storage import BlobStore

if TYPE_CHECKING:
    from services.policy.protocol import RolloutPolicy

log = logging.getLogger("gtr.controller")


@contextmanager
def _closed_after(stream: Iterator[Any] | None) -> Iterator[None]:
    """Ends a streamed rollout however the loop over it ends: read to its end when every step
    was taken (the connection is kept), else closed (the service stops stepping)."""
    try:
        yield
        if stream is not None:
            next(stream, None)
    finally:
        close = getattr(stream, "close", None)
        if close is not None:
            close()


@dataclass
class Collected:
    """What ``collect`` accumulates for one update, in step order t*E+e."""

    step_ids: list[int] = field(default_factory=list)
    prompts: list[str] = field(default_factory=list)
    shas: list[str] = field(default_factory=list)
    gens: list[Any] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    dones: list[bool] = field(default_factory=list)
    format_valid: list[bool] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    views: list[M.StepView] = field(default_factory=list)

    def to_rollout(self, cfg: RunConfig, last_values: np.ndarray) -> Rollout:
        """The trainer's batch: responses padded to the longest."""
        ids, lengths = Rollout.pad_responses([g.token_ids for g in self.gens])
        L = ids.shape[1]

        def padded(key: str, dtype: Any) -> np.ndarray:
            out = np.zeros((len(self.gens), L), dtype=dtype)
            for i, g in enumerate(self.gens):
                vals = getattr(g, key)
                out[i, : len(vals)] = vals
            return out

        return Rollout(
            num_envs=cfg.train.num_envs,
            num_steps=len(self.rewards) // cfg.train.num_envs,  # fewer: grpo by episodes
            step_ids=np.asarray(self.step_ids, dtype=np.int64),
            prompts=np.asarray(self.prompts),
            image_shas=np.asarray(self.shas),
            response_ids=ids,
            response_lengths=lengths,
            old_logprobs=padded("logprobs", np.float32),
            thought_mask=padded("thought_mask", bool),
            action_mask=padded("action_mask", bool),
            values=np.asarray([g.value for g in self.gens], dtype=np.float32),
            rewards=np.asarray(self.rewards, dtype=np.float32),
            dones=np.asarray(self.dones, dtype=bool),
            format_valid=np.asarray(self.format_valid, dtype=bool),
            actions=np.asarray(self.actions),
            last_values=last_values,
        )


def last_values(policy: RolloutPolicy, observations: list[Any]) -> np.ndarray:
    """V(o_T) for bootstrapping: the value head reads the prompt, one token is enough."""
    gens = policy.generate(
        [o.image for o in observations],
        [o.prompt for o in observations],
        max_new_tokens=1,
        greedy=True,
    )
    return np.asarray([g.value for g in gens], dtype=np.float32)


class RolloutCollector:
    def __init__(
        self,
        run_id: int,
        cfg: RunConfig,
        envs: Envs,
        policy: RolloutPolicy,
        episodes: Episodes,
        book: CorrectionBook,
        blobs: BlobStore,
        policy_steps_envs: bool = True,
    ) -> None:
        """``policy_steps_envs``: a policy service that steps our env service may run the
        rollout loop itself (settings' ``policy_steps_envs``; false: two requests a step)."""
        self.run_id, self.cfg, self.envs, self.policy = run_id, cfg, envs, policy
        self.episodes, self.book = episodes, book
        self.policy_steps_envs = policy_steps_envs
        self.same_envs: bool | None = None  # the policy service steps our env service
        self.clock = StageClock()  # the current rollout's time per stage
        self.frames = FrameShas(blobs)
        self.cancel_seen = False  # the recorder thread saw the run's cancel flag

    def collect(self, u: int) -> Collected:
        """``num_steps`` batched env steps (grpo by episodes: until every env's episode ended).
        Each step's rows are written, and its well-formed steps queued for correction, on the
        recorder thread while the next step generates."""
        ro, eps = Collected(), self.episodes
        eps.for_update(u)
        gen = self.cfg.generation
        params = {
            "temperature": gen.temperature,
            "top_p": gen.top_p,
            "max_new_tokens": gen.max_new_tokens,
            "repetition_penalty": gen.repetition_penalty,
            "repetition_scope": gen.repetition_scope,
        }
        clock = self.clock = StageClock()
        stream = self._policy_rollout(params)
        with WritePipeline() as writer, _closed_after(stream):
            ended = np.zeros(self.cfg.train.num_envs, dtype=bool)  # grpo by episodes
            for t in range(eps.rollout_steps):
                if self.cancel_seen:  # read by the recorder thread with each step it writes
                    raise Cancelled()
                images, prompts = [o.image for o in eps.obs], [o.prompt for o in eps.obs]
                if stream is not None:
                    with clock("stream_wait"):  # generate + env in the policy service
                        step = next(stream)
                else:
                    step = rollout_step(
                        self.policy, self.envs, eps.sessions, images, prompts, params
                    )
                clock.add("generate", step.generate_s)
                clock.add("env", step.env_s)
                gens, results = step.generations, step.results
                with clock("record"):
                    records = self.step_records(ro, u, t, prompts, gens, results)
                    writer.submit(self.write_step, u, t, records)
                eps.obs = [r.observation for r in results]
                if self.cfg.corrector.wait == "step" and self.book.correcting:
                    with clock("record_wait"):
                        ids = writer.results()[-1][0]
                    self.book.settle([i for i, r in zip(ids, records, strict=True) if r.correct])
                    if self.cfg.corrector.feedback:  # the verdicts are in: act on them
                        self.feedback(ro, u, len(ro.rewards) - len(ids), ids)
                ended |= np.asarray(ro.dones[-len(ended) :], dtype=bool)
                if eps.whole_episodes and ended.all():
                    break  # every env's episode is whole: the rollout ends here
            with clock("record_wait"):  # what the recorder thread had not written yet
                for ids, shas in writer.results():
                    ro.step_ids += ids
                    ro.shas += shas
        return ro

    def _policy_rollout(self, params: dict[str, Any]) -> Iterator[RolloutStep] | None:
        """The policy service's own rollout loop (``POST /rollout``: one round trip a rollout
        step instead of two) where it steps the env service ours are in, nothing has to happen
        between two steps and the run's envs fit one request; None: this process calls
        ``rollout_step`` each step."""
        remote = getattr(self.policy, "rollout", None)
        env_url = getattr(self.envs, "base_url", None)
        if not (self.policy_steps_envs and remote and env_url) or self.cfg.corrector.wait == "step":
            return None
        if self.episodes.whole_episodes:  # its length is known only as it goes
            return None
        sessions, obs = self.episodes.sessions, self.episodes.obs
        if len(sessions) > MAX_SAMPLES:  # one stream's limit; generate splits its requests
            return None
        if self.same_envs is None:  # asked again after an interruption (the service restarted)
            self.same_envs = self.policy.steps_envs_of(self.envs)  # type: ignore[attr-defined]
            if not self.same_envs:
                log.info(
                    "run %s: the policy service steps another env service than %s; "
                    "a generate and an env step request per rollout step",
                    self.run_id,
                    env_url,
                )
        if not self.same_envs:
            return None
        images, prompts = [o.image for o in obs], [o.prompt for o in obs]
        return remote(sessions, images, prompts, self.cfg.train.num_steps, params)

    def step_records(
        self,
        ro: Collected,
        u: int,
        t: int,
        prompts: list[str],
        gens: list[Any],
        results: list[Any],
    ) -> list[StepRecord]:
        """The rows of one rollout step (one per env); the rollout's columns are filled here."""
        E = self.cfg.train.num_envs
        records = []
        for e, (g, r) in enumerate(zip(gens, results, strict=True)):
            obs = self.episodes.obs[e]
            thought_ent = [h for h, m in zip(g.entropy, g.thought_mask, strict=False) if m]
            entropy = float(np.mean(thought_ent)) if thought_ent else None
            valid, action_valid = bool(r.parsed.format_valid), bool(r.parsed.action_valid)
            columns = {
                "update_idx": u,
                "rollout_pos": t * E + e,
                "prompt": obs.prompt,
                "output": g.text,
                "thought": r.parsed.thought,
                "action_text": r.parsed.action_text,
                "parsed_action": r.action,
                "format_valid": valid,
                "action_valid": action_valid,
                "reward": float(r.reward),
                "done": bool(r.done),
                "value": float(g.value),
                "logprob": float(sum(g.logprobs)),
                "thought_entropy": entropy,
                "state": obs.state,
            }
            records.append(
                StepRecord(
                    e,
                    obs.image,
                    columns,
                    bool(r.done),
                    r.success,
                    r.final_state,
                    correct=valid and self.book.correcting,
                    display_png=getattr(obs, "display_png", None),
                )
            )
            ro.prompts.append(prompts[e])
            ro.gens.append(g)
            ro.rewards.append(float(r.reward))
            ro.dones.append(bool(r.done))
            ro.format_valid.append(valid)
            ro.actions.append(r.action or "")
            ro.views.append(
                M.StepView(r.parsed.thought, r.action, valid, action_valid, obs.state, entropy)
            )
        return records

    def write_step(self, u: int, t: int, records: list[StepRecord]) -> tuple[list[int], list[str]]:
        """On the recorder thread: one transaction for the step, then its corrections queued
        (after the commit, so the workers see the rows)."""
        with session_scope() as s:
            ids, shas, cancel = record_step_batch(
                s,
                self.run_id,
                u,
                records,
                self.episodes.cursors,
                self.frames,
                self.episodes.ended,
                run_values={"phase_step": t + 1},  # the run page's "rollout step k of n"
            )
        self.cancel_seen = self.cancel_seen or cancel
        self.book.submit([i for i, r in zip(ids, records, strict=True) if r.correct])
        return ids, shas

    def feedback(self, ro: Collected, u: int, first: int, ids: list[int]) -> None:
        """GTR's loop (``corrector.feedback``): the corrections of the batch just stepped end
        their episodes ("no solution", or the formula left the target) or set their target.
        ``ids``: the batch's step ids; ``first``: its position in the rollout's columns."""
        from services.controller.feedback import TRUNCATION_REWARD, decide

        eps = self.episodes
        with session_scope() as s:
            extras = store.done_correction_extras(s, ids)
            for e, sid in enumerate(ids):
                pos = first + e
                if sid not in extras or ro.dones[pos]:
                    continue  # no verdict, or the episode ended by itself
                obs = eps.obs[e]
                fb = decide(extras[sid], obs.state.get("formula_text"))
                if fb.target_formula is not None:
                    self.envs.set_target_formula(eps.sessions[e], fb.target_formula)
                    obs.state = {**obs.state, "target_formula": fb.target_formula}
                if not fb.truncate:
                    continue
                cur = eps.cursors[e]
                cur.total_return += TRUNCATION_REWARD - store.end_step(s, sid, TRUNCATION_REWARD)
                ro.rewards[pos], ro.dones[pos] = TRUNCATION_REWARD, True
                eps.cut(s, e, u)
                log.debug("run %s step %s truncated: %s", self.run_id, sid, fb.reason)
