"""The run driver: rollout -> corrections -> update -> publish checkpoint, until the budget ends.

``RunDriver`` is a plain object over four backends (envs, policy, corrections, trainer); the
embedded mode hands it in-process objects, the full stack hands it network clients. Each update:
1. ``collect``: ``num_steps`` batched steps over ``num_envs`` env sessions; every step is written
   to the store at once and each well-formed one is queued for correction at once, so corrections
   run while the rollout goes on.
2. optionally wait for this rollout's corrections (``corrector.wait = "update"``); in any mode,
   send again, once, the corrections of earlier steps that never came (``CorrectionSweep``).
3. the rollout goes to the blob store; its sha and the rollout metrics to the ``updates`` row.
4. the trainer trains on it and writes a checkpoint; the policy loads that checkpoint.
5. a fixed probe set is decoded greedily: the thought-collapse monitors and the alarm.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
from sqlalchemy.orm import Session

from services.controller import correction_stats as CS
from services.controller import metrics as M
from services.controller import store
from services.controller.backends import (
    BROKER_ERRORS,
    Corrections,
    CorrectionSweep,
    Envs,
    TrainerBackend,
    checkpoint_dir,
    settle_corrections,
)
from services.controller.evaluate import evaluate, greedy_generate
from services.controller.recorder import (
    EpisodeCursor,
    abandon_episodes,
    close_episode,
    discard_after,
    open_episode,
)
from services.controller.timing import StageClock
from services.controller.tracking import Trackers, final_summary, run_info_metrics
from services.controller.writer import FrameShas, StepRecord, WritePipeline, record_step_batch
from services.env.display import record_time_size
from services.policy.rollout import RolloutStep, rollout_step
from services.policy.schemas import MAX_SAMPLES
from shared.db.models import utcnow
from shared.db.session import session_scope
from shared.phase import RunCancelled, cancel_requested, set_phase
from shared.rollout import Rollout
from shared.schemas import GROUP_ALGORITHMS
from shared.storage import blob_store

if TYPE_CHECKING:
    from services.policy.protocol import RolloutPolicy

log = logging.getLogger("gtr.controller")

PROBE_SEED = 1_000_003  # probe states are the same for every run of a task
# A correction's finished_at is stamped before its row commits: look back this far for late ones.
LATE_MARGIN = timedelta(seconds=120)


class Cancelled(Exception):
    pass


class Outage(RuntimeError):
    """A service the run needs stayed away, or kept failing, past the driver's bounds."""


def is_interruption(e: BaseException) -> bool:
    """Whether an error is an outage that a restart of the service cures, not the run's own fault:
    the env or policy service gone (a transport error, a 5xx, env sessions it no longer knows),
    or Redis (a publish, or the result backend, whose errors come wrapped in a RuntimeError)."""
    from services.env.service import SessionNotFound

    seen: BaseException | None = e
    for _ in range(5):  # the chain of causes, a few links deep
        if seen is None:
            return False
        if isinstance(seen, (httpx.TransportError, SessionNotFound, *BROKER_ERRORS)):
            return True
        if int(getattr(seen, "status_code", 0) or 0) >= 500:  # EnvClient, PolicyClient errors
            return True
        seen = seen.__cause__
    return False


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
class Progress:
    update_idx: int
    env_steps: int
    total_env_steps: int
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Rollout:
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


class RunDriver:
    def __init__(
        self,
        run_id: int,
        envs: Envs,
        policy: RolloutPolicy,
        corrections: Corrections | None,
        trainer: TrainerBackend,
        on_progress: Callable[[Progress], None] | None = None,
        outage_s: float = 300.0,
        max_interruptions: int = 5,
        policy_steps_envs: bool = True,
    ) -> None:
        """``policy_steps_envs``: a policy service that steps our env service may run the
        rollout loop itself (settings' ``policy_steps_envs``; false: two requests a step)."""
        self.run_id = run_id
        self.policy_steps_envs = policy_steps_envs
        self._same_envs: bool | None = None  # the policy service steps our env service
        # An outage is waited out for up to outage_s; max_interruptions in a row (no update
        # trained in between) end the run.
        self.outage_s, self.max_interruptions, self.interruptions = outage_s, max_interruptions, 0
        self.envs, self.policy, self.corrections, self.trainer = envs, policy, corrections, trainer
        self.on_progress = on_progress or (lambda p: None)
        self.blobs = blob_store()
        with session_scope() as s:
            self.cfg = store.run_config(s, run_id)
        self.success = M.SuccessWindow(self.cfg.metrics.success_window)
        self.subtasks: dict[str, M.SuccessWindow] = {}
        self.sessions: list[str] = []
        self.obs: list[Any] = []
        self.cursors: list[EpisodeCursor] = []
        self.clock = StageClock()  # the current rollout's time per stage
        self.frames = FrameShas(self.blobs)
        self.cancel_seen = False  # the recorder thread saw the run's cancel flag
        self._envs_update = -1  # the update whose seeds the open env sessions have
        self.sweep: CorrectionSweep | None = None
        self._stats_at: datetime | None = None  # correction figures are current up to this
        if corrections is not None and self.cfg.uses_corrector:
            c = self.cfg.corrector
            self.sweep = CorrectionSweep(corrections, run_id, c.name, c.wait_timeout_s)
        self.tracking = Trackers.for_run(run_id, self.cfg)
        self.update_started: float | None = None  # wall time of an update, for update_s
        self.train_s: float | None = None

    # ---- the loop -------------------------------------------------------------------------

    def run(self) -> str:
        """Drive the run to its end; returns the final status."""
        try:
            while True:
                try:
                    self._drive()
                    return self._end("completed")
                except Exception as e:
                    if not is_interruption(e):
                        raise
                    self._ride_out(e)
        except Cancelled:
            return self._end("cancelled")
        except Exception as e:
            if isinstance(e, RunCancelled) or cancel_requested(self.run_id):
                return self._end("cancelled")  # the trainer stopped its warm start for it
            log.exception("run %s failed", self.run_id)
            return self._end("failed", f"{type(e).__name__}: {e}")
        finally:
            self._close_envs()

    def _drive(self) -> None:
        self.tracking.begin()  # trackers start in the background during the warm start
        start, unfinished = self._start()
        self._open_envs(start)
        probe = self._probe_states()
        if start == 0 and unfinished is None and probe:
            # The policy before any update: the level a collapse in the first update falls from.
            self._start_relevance = self._probe(probe)["probe_relevance"]
        if unfinished is not None:  # trained, its checkpoint loaded, but never probed/recorded
            self._finish_update(unfinished, probe)
        for u in range(start, self.cfg.train.num_updates):
            self._check_cancel()
            set_phase(self.run_id, "rollout", 0, self.cfg.train.num_steps)
            self._rollout_and_store(u)
            if self.sweep is not None:
                self.sweep.sweep(u)
            trained = time.monotonic()
            set_phase(self.run_id, "training")
            path = self.trainer.update(self.run_id, u)
            self.train_s = time.monotonic() - trained
            self.policy.load_weights(str(path))
            self._finish_update(u, probe)
            self.interruptions = 0
        if self.sweep is not None and (n := self.sweep.finish()):
            log.warning("run %s: %s corrections never came, recorded failed", self.run_id, n)

    def _ride_out(self, e: Exception) -> None:
        """A service went away: wait for it, then resume as a restarted controller does.

        Env sessions die with the env service, and a restarted policy service serves its base
        weights, so the partial rollout is dropped and ``_start`` reloads the last checkpoint."""
        self.interruptions += 1
        if self.interruptions > self.max_interruptions:
            raise Outage(
                f"gave up after {self.max_interruptions} interruptions in a row; "
                f"the last: {type(e).__name__}: {e}"
            ) from e
        log.warning(
            "run %s interrupted (%s of %s): %s: %s; waiting for the services",
            self.run_id,
            self.interruptions,
            self.max_interruptions,
            type(e).__name__,
            e,
        )
        self._close_envs()
        self._wait_for_services(e)
        self._same_envs = None
        self.success = M.SuccessWindow(self.cfg.metrics.success_window)  # _start refills it
        self.subtasks, self.obs, self.cursors = {}, [], []

    def _wait_for_services(self, cause: Exception) -> None:
        """Until every networked backend answers its health check, for up to ``outage_s``."""
        deadline = time.monotonic() + self.outage_s
        parts: list[Any] = [self.envs, self.policy, self.corrections, self.trainer]
        for part in [p for p in parts if hasattr(p, "health")]:  # in-process parts have none
            while True:
                self._check_cancel()
                try:
                    part.health()
                    break
                except Exception as e:
                    if time.monotonic() > deadline:
                        raise Outage(
                            f"{type(part).__name__} did not come back within {self.outage_s:g} s "
                            f"({type(e).__name__}: {e}) after {type(cause).__name__}: {cause}"
                        ) from cause
                time.sleep(1.0)

    def _start(self) -> tuple[int, int | None]:
        """Mark the run running; resume after the last trained update, or warm-start. Returns
        the first update to collect, and a trained update whose ``_finish_update`` never ran
        (the connection dropped in ``load_weights``, the controller died before recording it)."""
        with session_scope() as s:
            at = store.mark_running(s, self.run_id)
            last, pending = at.last_trained, at.pending
            finished = at.updates_done  # set by _finish_update, which comes after training
            if not pending:
                dropped = discard_after(s, self.run_id, last)
                if dropped:
                    log.info(
                        "run %s: discarded %s steps of an interrupted rollout", self.run_id, dropped
                    )
            store.recount_env_steps(s, self.run_id)
            self._restore_success_window(s)
        if pending:
            # The rollout was stored but not trained: train it rather than collect it again.
            self.policy.load_weights(str(self.trainer.update(self.run_id, last + 1)))
            return last + 2, last + 1
        if last < 0:
            set_phase(self.run_id, "warm_start" if self.cfg.init.kind == "warm_start" else None)
        path = self.trainer.init(self.run_id) if last < 0 else checkpoint_dir(self.run_id, last)
        self.policy.load_weights(str(path))
        return last + 1, (last if 0 <= last and finished < last + 1 else None)

    def _rollout_and_store(self, u: int) -> None:
        started = self.update_started = time.monotonic()
        ro = self.collect(u)
        rollout_s = time.monotonic() - started
        if self.cfg.corrector.wait == "update" and self.corrections is not None:
            queued = [sid for sid, ok in zip(ro.step_ids, ro.format_valid, strict=True) if ok]
            set_phase(self.run_id, "corrections")
            self._settle(queued)
        # The policy service may have restarted, silently, while we waited for corrections.
        if hasattr(self.policy, "ensure_loaded") and self.policy.ensure_loaded():
            log.warning("run %s: the policy service had lost the run's checkpoint", self.run_id)
        last_values = self._values(self.obs)
        rollout = self._to_rollout(ro, last_values)
        sha = self.blobs.put(rollout.to_bytes())
        stats = M.batch_metrics(ro.views, self._relevant)
        with session_scope() as s:
            per_subtask = {
                f"success/{k}": w.summary()["success_rate"] for k, w in self.subtasks.items()
            }
            speed = {
                "rollout_s": rollout_s,
                "env_steps_per_s": len(ro.step_ids) / max(rollout_s, 1e-9),
            }
            summary = {
                **stats,
                **self.success.summary(),
                **per_subtask,
                **speed,
                **self.clock.metrics(),
                **store.episode_counts(s, self.run_id),
                **M.benchmark_share([v.state for v in ro.views]),
                "rollout_sha": sha,
            }
            store.add_update(s, self.run_id, u, summary)

    def _finish_update(self, u: int, probe: list[Any]) -> None:
        set_phase(self.run_id, "evaluating")
        extra = self._probe(probe) if probe else {}
        episodes, every = self.cfg.metrics.eval_episodes, self.cfg.metrics.eval_every
        # After the first update (a baseline close to the warm start), every N-th and the last.
        if episodes and (u == 0 or (u + 1) % every == 0 or u + 1 == self.cfg.train.num_updates):
            extra |= evaluate(self.envs, self.policy, self.cfg, episodes)
        with session_scope() as s:
            row, run = store.update_row(s, self.run_id, u), store.run_row(s, self.run_id)
            extra.update(self._correction_stats(s, u))
            if u == 0 and getattr(self, "_start_relevance", None) is not None:
                extra["probe_relevance_start"] = self._start_relevance
            merged = {**row.metrics, **extra, **run_info_metrics(run.info, u, self.timings())}
            best = self._best_relevance(s, u, merged)
            reason = M.alarm_reason(merged, best, u, self._limits())
            merged.pop("alarm_reason", None)
            if reason is not None:
                merged["alarm_reason"] = reason
            if self.tracking:  # a failed tracker shows in the metrics and on the run record
                merged |= self.tracking.log(u, merged)
                store.set_tracking(run, self.tracking.status())
            store.finish_update(run, row, merged, alarm=reason is not None)
            env_steps = run.env_steps
        self.on_progress(Progress(u, env_steps, self.cfg.total_env_steps, merged))

    # ---- stages ---------------------------------------------------------------------------

    def collect(self, u: int) -> _Rollout:
        """``num_steps`` batched env steps. Each step's rows are written, and its well-formed steps
        queued for correction, on the recorder thread while the next step generates."""
        ro = _Rollout()
        if self.cfg.algorithm in GROUP_ALGORITHMS and self._envs_update != u:
            self._regroup(u)
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
            for t in range(self.cfg.train.num_steps):
                if self.cancel_seen:  # read by the recorder thread with each step it writes
                    raise Cancelled()
                images, prompts = [o.image for o in self.obs], [o.prompt for o in self.obs]
                if stream is not None:
                    with clock("stream_wait"):  # generate + env in the policy service
                        step = next(stream)
                else:
                    step = rollout_step(
                        self.policy, self.envs, self.sessions, images, prompts, params
                    )
                clock.add("generate", step.generate_s)
                clock.add("env", step.env_s)
                gens, results = step.generations, step.results
                with clock("record"):
                    records = self._step_records(ro, u, t, prompts, gens, results)
                    writer.submit(self._write_step, u, t, records)
                self.obs = [r.observation for r in results]
                if self.cfg.corrector.wait == "step" and self._correcting:
                    with clock("record_wait"):
                        ids = writer.results()[-1][0]
                    self._settle([i for i, r in zip(ids, records, strict=True) if r.correct])
                    if self.cfg.corrector.feedback:  # the verdicts are in: act on them
                        self._feedback(ro, u, len(ro.rewards) - len(ids), ids)
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
        if len(self.sessions) > MAX_SAMPLES:  # one stream's limit; generate splits its requests
            return None
        if self._same_envs is None:  # asked again after an interruption (the service restarted)
            self._same_envs = self.policy.steps_envs_of(self.envs)  # type: ignore[attr-defined]
            if not self._same_envs:
                log.info(
                    "run %s: the policy service steps another env service than %s; "
                    "a generate and an env step request per rollout step",
                    self.run_id,
                    env_url,
                )
        if not self._same_envs:
            return None
        images, prompts = [o.image for o in self.obs], [o.prompt for o in self.obs]
        return remote(self.sessions, images, prompts, self.cfg.train.num_steps, params)

    @property
    def _correcting(self) -> bool:
        return self.corrections is not None and self.cfg.uses_corrector

    def _step_records(
        self, ro: _Rollout, u: int, t: int, prompts: list[str], gens: list[Any], results: list[Any]
    ) -> list[StepRecord]:
        """The rows of one rollout step (one per env); the rollout's columns are filled here."""
        E = self.cfg.train.num_envs
        records = []
        for e, (g, r) in enumerate(zip(gens, results, strict=True)):
            obs = self.obs[e]
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
                    correct=valid and self._correcting,
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

    def _write_step(self, u: int, t: int, records: list[StepRecord]) -> tuple[list[int], list[str]]:
        """On the recorder thread: one transaction for the step, then its corrections queued
        (after the commit, so the workers see the rows)."""
        with session_scope() as s:
            ids, shas, cancel = record_step_batch(
                s,
                self.run_id,
                u,
                records,
                self.cursors,
                self.frames,
                self._episode_end,
                run_values={"phase_step": t + 1},  # the run page's "rollout step k of n"
            )
        self.cancel_seen = self.cancel_seen or cancel
        to_correct = [i for i, r in zip(ids, records, strict=True) if r.correct]
        if to_correct and self.corrections is not None:
            self.corrections.submit(self.run_id, to_correct)
        return ids, shas

    def _episode_end(self, cur: EpisodeCursor, success: bool, final: dict[str, Any]) -> None:
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

    def _feedback(self, ro: _Rollout, u: int, first: int, ids: list[int]) -> None:
        """GTR's loop (``corrector.feedback``): the corrections of the batch just stepped end
        their episodes ("no solution", or the formula left the target) or set their target.
        ``ids``: the batch's step ids; ``first``: its position in the rollout's columns."""
        from services.controller.feedback import TRUNCATION_REWARD, decide

        with session_scope() as s:
            extras = store.done_correction_extras(s, ids)
            for e, sid in enumerate(ids):
                pos = first + e
                if sid not in extras or ro.dones[pos]:
                    continue  # no verdict, or the episode ended by itself
                obs = self.obs[e]
                fb = decide(extras[sid], obs.state.get("formula_text"))
                if fb.target_formula is not None:
                    self.envs.set_target_formula(self.sessions[e], fb.target_formula)
                    obs.state = {**obs.state, "target_formula": fb.target_formula}
                if not fb.truncate:
                    continue
                cur = self.cursors[e]
                cur.total_return += TRUNCATION_REWARD - store.end_step(s, sid, TRUNCATION_REWARD)
                ro.rewards[pos], ro.dones[pos] = TRUNCATION_REWARD, True
                close_episode(s, cur, False)
                self.success.add(False, cur.total_return, cur.length)
                self.cursors[e] = open_episode(s, self.run_id, e, cur.seq + 1, u)
                self.obs[e] = self.envs.reset(self.sessions[e])
                log.debug("run %s step %s truncated: %s", self.run_id, sid, fb.reason)

    def _settle(self, step_ids: list[int]) -> None:
        """Strict modes: wait for these corrections (the missing re-sent once, then failed)."""
        assert self.corrections is not None
        name, timeout = self.cfg.corrector.name, self.cfg.corrector.wait_timeout_s
        n = settle_corrections(self.corrections, self.run_id, step_ids, name, timeout)
        if n:
            log.warning("run %s: %s corrections timed out, recorded failed", self.run_id, n)

    def _values(self, observations: list[Any]) -> np.ndarray:
        """V(o_T) for bootstrapping: the value head reads the prompt, one token is enough."""
        gens = self.policy.generate(
            [o.image for o in observations],
            [o.prompt for o in observations],
            max_new_tokens=1,
            greedy=True,
        )
        return np.asarray([g.value for g in gens], dtype=np.float32)

    def _to_rollout(self, ro: _Rollout, last_values: np.ndarray) -> Rollout:
        ids, lengths = Rollout.pad_responses([g.token_ids for g in ro.gens])
        L = ids.shape[1]

        def padded(key: str, dtype: Any) -> np.ndarray:
            out = np.zeros((len(ro.gens), L), dtype=dtype)
            for i, g in enumerate(ro.gens):
                vals = getattr(g, key)
                out[i, : len(vals)] = vals
            return out

        return Rollout(
            num_envs=self.cfg.train.num_envs,
            num_steps=self.cfg.train.num_steps,
            step_ids=np.asarray(ro.step_ids, dtype=np.int64),
            prompts=np.asarray(ro.prompts),
            image_shas=np.asarray(ro.shas),
            response_ids=ids,
            response_lengths=lengths,
            old_logprobs=padded("logprobs", np.float32),
            thought_mask=padded("thought_mask", bool),
            action_mask=padded("action_mask", bool),
            values=np.asarray([g.value for g in ro.gens], dtype=np.float32),
            rewards=np.asarray(ro.rewards, dtype=np.float32),
            dones=np.asarray(ro.dones, dtype=bool),
            format_valid=np.asarray(ro.format_valid, dtype=bool),
            actions=np.asarray(ro.actions),
            last_values=last_values,
        )

    # ---- envs, probe, metrics -------------------------------------------------------------

    def _open_envs(self, u: int) -> None:
        # grpo: the G envs of a group share a seed, so their k-th episodes are the same deal.
        per = self.cfg.train.group_size if self.cfg.algorithm in GROUP_ALGORITHMS else 1
        self._envs_update = u
        # Frames for people are drawn from the stored state when viewed; only those no state can
        # redraw (THOR's camera) are drawn while recording.
        size = record_time_size(self.cfg.task, self.cfg.env.model_dump())
        env = self.cfg.env.model_copy(update={"display_size": size})
        with session_scope() as s:
            for e in range(self.cfg.train.num_envs):
                # A resumed run gets fresh seeds: its envs restart, so must not replay old deals.
                sid = self.envs.create(
                    self.cfg.task, env, seed=(self.cfg.seed * 1000 + u) * 1000 + e // per
                )
                self.sessions.append(sid)
                self.obs.append(self.envs.reset(sid))
                seq = store.next_episode_seq(s, self.run_id, e)
                self.cursors.append(open_episode(s, self.run_id, e, seq, u))

    def _regroup(self, u: int) -> None:
        """grpo: every rollout starts fresh groups (same deal within a group, new deals per
        update); the episodes still running are cut off (their steps train nothing)."""
        with session_scope() as s:
            abandon_episodes(s, self.cursors)
        self._close_envs()
        self.obs, self.cursors = [], []
        self._open_envs(u)

    def _close_envs(self) -> None:
        for sid in self.sessions:
            try:
                self.envs.close(sid)
            except Exception:  # the env service may be the thing that failed
                log.debug("closing env session %s failed", sid)
        self.sessions.clear()

    def _probe_states(self) -> list[Any]:
        """A fixed set of distinct states (by image and prompt), the same each update: the first
        observation of each seeded episode or, where that one is already in the set (every
        ALFWorld game of a kitchen opens on one view), a state a few expert steps later."""
        found: dict[tuple[str, str], Any] = {}
        for i in range(self.cfg.metrics.probe_states):
            self._probe_walk(PROBE_SEED + i, found)
        out = list(found.values())
        self._probe_ideal = [self._ideal_thought(o.state) for o in out]
        self._probe_images = [sha for sha, _ in found]
        return out

    def _probe_walk(self, seed: int, found: dict[tuple[str, str], Any], steps: int = 3) -> None:
        """Add one new state of a seeded episode to ``found``: its first, else the first of up
        to ``steps`` expert steps that looks new, else one whose prompt is new (one reset per
        call: ALFWorld's cost seconds)."""
        from services.env.expert import expert_output, format_output

        images = {sha for sha, _ in found}
        fallback: tuple[tuple[str, str], Any] | None = None
        env = self.cfg.env.model_copy(update={"display_size": 0})  # never recorded
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

    def _probe(self, probe: list[Any]) -> dict[str, float]:
        gens = greedy_generate(self.policy, probe, self.cfg.generation.max_new_tokens)
        views = []
        for o, g in zip(probe, gens, strict=True):
            p = self._parse(g.text, o.state)
            views.append(
                M.StepView(p.thought, p.action_text, p.format_valid, p.action_valid, o.state)
            )
        ideal, images = getattr(self, "_probe_ideal", ()), getattr(self, "_probe_images", ())
        return M.probe_metrics(views, self._relevant, ideal, images)

    def _parse(self, text: str, state: dict) -> Any:
        if self.cfg.task == "alfworld":
            # Admissible commands change with the state: parse against the probe state's own.
            from services.env.alfworld.env import parse_with_commands

            return parse_with_commands(text, list(state["admissible"]))
        from services.env import make_env

        if not hasattr(self, "_parser_env"):
            self._parser_env: Any = make_env(self.cfg.task, self.cfg.env, seed=0).unwrapped
        return self._parser_env.parse(text)

    def _relevant(self, thought: str, state: dict) -> bool:
        from services.env.expert import thought_matches_state

        return bool(thought_matches_state(self.cfg.task, thought, state))

    def _limits(self) -> M.AlarmLimits:
        m = self.cfg.metrics
        return M.AlarmLimits(
            m.min_relevance, m.max_top_thought_share, m.relevance_drop, m.alarm_warmup_updates
        )

    def _best_relevance(self, s: Session, u: int, current: dict[str, Any]) -> float | None:
        """The best probe relevance before update ``u``: of the earlier updates and of the
        policy before the first one (None when there is none)."""
        rows = store.metrics_before(s, self.run_id, u)
        keys = ("probe_relevance", "probe_relevance_start")
        seen = [float(m[k]) for m in rows for k in keys if k in m]
        if "probe_relevance_start" in current:  # update 0: the policy it started from
            seen.append(float(current["probe_relevance_start"]))
        return max(seen, default=None)

    def _correction_stats(self, s: Session, u: int) -> dict[str, float]:
        """Update ``u``'s correction figures; earlier updates whose corrections came late are
        recomputed too, so no update keeps a snapshot."""
        since, self._stats_at = self._stats_at, utcnow() - LATE_MARGIN
        CS.refresh_late(s, self.run_id, since, before=u)
        return CS.update_figures(s, self.run_id, u)

    def _refresh_corrections(self) -> None:
        """At the end: the late corrections (the pool drained, the sweep settled) counted."""
        try:
            with session_scope() as s:
                CS.refresh_late(s, self.run_id, self._stats_at, before=None)
        except Exception:  # the figures are a view; the run's status must still be written
            log.exception("run %s: refreshing the correction figures failed", self.run_id)

    def _restore_success_window(self, s: Session) -> None:
        for r in store.last_finished_episodes(s, self.run_id, self.success.size):
            self.success.add(bool(r.success), float(r.total_return), int(r.length))

    def timings(self) -> dict[str, float]:
        """Seconds of the update just finished: all of it, and the trainer's part."""
        out = {}
        if self.update_started is not None:
            out["update_s"] = time.monotonic() - self.update_started
        if self.train_s is not None:
            out["train_s"] = self.train_s
        self.update_started = self.train_s = None
        return out

    def _check_cancel(self) -> None:
        if cancel_requested(self.run_id):
            raise Cancelled()

    def _end(self, status: str, error: str | None = None) -> str:
        if self.corrections is not None and status != "failed":
            try:
                self.corrections.close(wait=status != "cancelled")
            except Exception:
                log.exception("closing the correction pool")
        if self.corrections is not None:
            self._refresh_corrections()
        with session_scope() as s:
            run = store.end_run(s, self.run_id, status, error)
            if self.tracking:
                self.tracking.finish(status, final_summary(s, run))
                store.set_tracking(run, self.tracking.status())
        log.info("run %s %s", self.run_id, status)
        return status
