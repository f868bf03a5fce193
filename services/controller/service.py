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

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from services.controller import metrics as M
from services.controller.backends import (
    BROKER_ERRORS,
    Corrections,
    CorrectionSweep,
    TrainerBackend,
    checkpoint_dir,
    settle_corrections,
)
from services.controller.evaluate import evaluate, greedy_generate
from services.controller.recorder import (
    EpisodeCursor,
    add_step,
    close_cut_off,
    close_episode,
    discard_after,
    open_episode,
    touch_episode,
)
from shared.db.models import Correction, Run, Step, Update, utcnow
from shared.db.session import session_scope
from shared.phase import RunCancelled, cancel_requested, set_phase
from shared.rollout import Rollout
from shared.schemas import RunConfig
from shared.storage import blob_store

log = logging.getLogger("gtr.controller")

PROBE_SEED = 1_000_003  # probe states are the same for every run of a task


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
        envs: Any,
        policy: Any,
        corrections: Corrections | None,
        trainer: TrainerBackend,
        on_progress: Callable[[Progress], None] | None = None,
        outage_s: float = 300.0,
        max_interruptions: int = 5,
    ) -> None:
        self.run_id = run_id
        # An outage is waited out for up to outage_s; max_interruptions in a row (no update
        # trained in between) end the run.
        self.outage_s, self.max_interruptions, self.interruptions = outage_s, max_interruptions, 0
        self.envs, self.policy, self.corrections, self.trainer = envs, policy, corrections, trainer
        self.on_progress = on_progress or (lambda p: None)
        self.blobs = blob_store()
        with session_scope() as s:
            run = s.get(Run, run_id)
            if run is None:
                raise LookupError(f"run {run_id} does not exist")
            self.cfg = RunConfig.model_validate(run.config)
        self.success = M.SuccessWindow(self.cfg.metrics.success_window)
        self.subtasks: dict[str, M.SuccessWindow] = {}
        self.sessions: list[str] = []
        self.obs: list[Any] = []
        self.cursors: list[EpisodeCursor] = []
        self.sweep: CorrectionSweep | None = None
        if corrections is not None and self.cfg.algorithm != "rl4vlm":
            c = self.cfg.corrector
            self.sweep = CorrectionSweep(corrections, run_id, c.name, c.wait_timeout_s)

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
        start, unfinished = self._start()
        self._open_envs(start)
        probe = self._probe_states()
        if unfinished is not None:  # trained, its checkpoint loaded, but never probed/recorded
            self._finish_update(unfinished, probe)
        for u in range(start, self.cfg.train.num_updates):
            self._check_cancel()
            set_phase(self.run_id, "rollout", 0, self.cfg.train.num_steps)
            self._rollout_and_store(u)
            if self.sweep is not None:
                self.sweep.sweep(u)
            set_phase(self.run_id, "training")
            path = self.trainer.update(self.run_id, u)
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
            run = s.get(Run, self.run_id)
            assert run is not None
            run.status, run.error = "running", None
            run.started_at = run.started_at or utcnow()
            rows = s.scalars(select(Update).where(Update.run_id == self.run_id)).all()
            last = max((u.idx for u in rows if u.metrics.get("trained")), default=-1)
            pending = any(u.idx == last + 1 and u.metrics.get("rollout_sha") for u in rows)
            finished = run.updates_done  # set by _finish_update, which comes after training
            if not pending:
                dropped = discard_after(s, self.run_id, last)
                if dropped:
                    log.info(
                        "run %s: discarded %s steps of an interrupted rollout", self.run_id, dropped
                    )
            run.env_steps = (
                s.scalar(select(func.count()).select_from(Step).where(Step.run_id == self.run_id))
                or 0
            )
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
        started = time.monotonic()
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
                "rollout_sha": sha,
            }
            s.add(Update(run_id=self.run_id, idx=u, metrics=summary))

    def _finish_update(self, u: int, probe: list[Any]) -> None:
        set_phase(self.run_id, "evaluating")
        extra = self._probe(probe) if probe else {}
        episodes, every = self.cfg.metrics.eval_episodes, self.cfg.metrics.eval_every
        # After the first update (a baseline close to the warm start), every N-th and the last.
        if episodes and (u == 0 or (u + 1) % every == 0 or u + 1 == self.cfg.train.num_updates):
            extra |= evaluate(self.envs, self.policy, self.cfg, episodes)
        with session_scope() as s:
            row = s.scalar(select(Update).where(Update.run_id == self.run_id, Update.idx == u))
            assert row is not None
            extra.update(self._correction_stats(s, u))
            merged = {**row.metrics, **extra}
            row.alarm = M.collapse_alarm(
                merged, self.cfg.metrics.min_relevance, self.cfg.metrics.max_top_thought_share
            )
            row.metrics = merged
            run = s.get(Run, self.run_id)
            assert run is not None
            run.updates_done, run.alarm, run.heartbeat_at = u + 1, row.alarm, utcnow()
            env_steps = run.env_steps
        self.on_progress(Progress(u, env_steps, self.cfg.total_env_steps, merged))

    # ---- stages ---------------------------------------------------------------------------

    def collect(self, u: int) -> _Rollout:
        """``num_steps`` batched env steps; steps recorded and queued for correction at once."""
        ro = _Rollout()
        gen = self.cfg.generation
        E = self.cfg.train.num_envs
        for t in range(self.cfg.train.num_steps):
            self._check_cancel()
            images, prompts = [o.image for o in self.obs], [o.prompt for o in self.obs]
            gens = self.policy.generate(
                images,
                prompts,
                temperature=gen.temperature,
                top_p=gen.top_p,
                max_new_tokens=gen.max_new_tokens,
                repetition_penalty=gen.repetition_penalty,
            )
            results = self.envs.step_batch(
                [(sid, g.text) for sid, g in zip(self.sessions, gens, strict=True)]
            )
            to_correct: list[int] = []
            with session_scope() as s:
                for e, (g, r) in enumerate(zip(gens, results, strict=True)):
                    step = self._record(s, u, t * E + e, e, g, r)
                    ro.step_ids.append(step.id)
                    ro.prompts.append(prompts[e])
                    ro.shas.append(step.image_sha or "")
                    ro.gens.append(g)
                    ro.rewards.append(float(r.reward))
                    ro.dones.append(bool(r.done))
                    ro.format_valid.append(bool(r.parsed.format_valid))
                    ro.actions.append(step.parsed_action or "")
                    ro.views.append(
                        M.StepView(
                            step.thought,
                            step.parsed_action,
                            step.format_valid,
                            step.action_valid,
                            step.state,
                            step.thought_entropy,
                        )
                    )
                    if (
                        step.format_valid
                        and self.corrections is not None
                        and self.cfg.algorithm != "rl4vlm"
                    ):
                        to_correct.append(step.id)
                s.execute(
                    update(Run)
                    .where(Run.id == self.run_id)
                    .values(env_steps=Run.env_steps + E, heartbeat_at=utcnow(), phase_step=t + 1)
                )
            if to_correct and self.corrections is not None:
                # After the commit, so the workers see the rows.
                self.corrections.submit(self.run_id, to_correct)
                if self.cfg.corrector.wait == "step":
                    self._settle(to_correct)
            self.obs = [r.observation for r in results]
        return ro

    def _settle(self, step_ids: list[int]) -> None:
        """Strict modes: wait for these corrections (the missing re-sent once, then failed)."""
        assert self.corrections is not None
        name, timeout = self.cfg.corrector.name, self.cfg.corrector.wait_timeout_s
        n = settle_corrections(self.corrections, self.run_id, step_ids, name, timeout)
        if n:
            log.warning("run %s: %s corrections timed out, recorded failed", self.run_id, n)

    def _record(self, s: Session, u: int, pos: int, e: int, g: Any, r: Any) -> Step:
        cur, obs = self.cursors[e], self.obs[e]
        thought_ent = [h for h, m in zip(g.entropy, g.thought_mask, strict=False) if m]
        step = add_step(
            s,
            self.blobs,
            image=obs.image,
            run_id=self.run_id,
            episode_id=cur.episode_id,
            idx=cur.length,
            update_idx=u,
            rollout_pos=pos,
            prompt=obs.prompt,
            output=g.text,
            thought=r.parsed.thought,
            action_text=r.parsed.action_text,
            parsed_action=r.action,
            format_valid=bool(r.parsed.format_valid),
            action_valid=bool(r.parsed.action_valid),
            reward=float(r.reward),
            done=bool(r.done),
            value=float(g.value),
            logprob=float(sum(g.logprobs)),
            thought_entropy=float(np.mean(thought_ent)) if thought_ent else None,
            state=obs.state,
        )
        s.flush()
        cur.length += 1
        cur.total_return += float(r.reward)
        if r.done:
            success = bool(r.success)
            final = r.final_state or {}
            if "subtask" in final:  # ALFWorld: success per subtask (pick, look, clean, ...)
                cur.meta = {"subtask": final["subtask"], "synthetic": bool(final.get("synthetic"))}
                window = self.subtasks.setdefault(
                    final["subtask"], M.SuccessWindow(self.success.size)
                )
                window.add(success, cur.total_return, cur.length)
            close_episode(s, cur, success)
            self.success.add(success, cur.total_return, cur.length)
            self.cursors[e] = open_episode(s, self.run_id, e, cur.seq + 1, u)
        else:
            touch_episode(s, cur)
        return step

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
        with session_scope() as s:
            for e in range(self.cfg.train.num_envs):
                # A resumed run gets fresh seeds: its envs restart, so must not replay old deals.
                sid = self.envs.create(
                    self.cfg.task, self.cfg.env, seed=(self.cfg.seed * 1000 + u) * 1000 + e
                )
                self.sessions.append(sid)
                self.obs.append(self.envs.reset(sid))
                self.cursors.append(open_episode(s, self.run_id, e, self._next_seq(s, e), u))

    def _next_seq(self, s: Session, e: int) -> int:
        from shared.db.models import Episode

        return int(
            s.scalar(
                select(func.count())
                .select_from(Episode)
                .where(Episode.run_id == self.run_id, Episode.env_index == e)
            )
            or 0
        )

    def _close_envs(self) -> None:
        for sid in self.sessions:
            try:
                self.envs.close(sid)
            except Exception:  # the env service may be the thing that failed
                log.debug("closing env session %s failed", sid)
        self.sessions.clear()

    def _probe_states(self) -> list[Any]:
        """A fixed set of states, the same each update: first observations of seeded episodes."""
        out = []
        for i in range(self.cfg.metrics.probe_states):
            sid = self.envs.create(self.cfg.task, self.cfg.env, seed=PROBE_SEED + i)
            try:
                out.append(self.envs.reset(sid))
            finally:
                self.envs.close(sid)
        return out

    def _probe(self, probe: list[Any]) -> dict[str, float]:
        gens = greedy_generate(self.policy, probe, self.cfg.generation.max_new_tokens)
        views = []
        for o, g in zip(probe, gens, strict=True):
            p = self._parse(g.text, o.state)
            views.append(
                M.StepView(p.thought, p.action_text, p.format_valid, p.action_valid, o.state)
            )
        return M.probe_metrics(views, self._relevant)

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

    def _correction_stats(self, s: Session, u: int) -> dict[str, float]:
        rows = s.execute(
            select(
                Correction.status, Correction.verdict, Correction.latency_ms, Correction.tokens
            ).where(Correction.run_id == self.run_id, Correction.update_idx == u)
        ).all()
        done = [r for r in rows if r.status == "done"]
        out: dict[str, float] = {
            "corrections": float(len(rows)),
            "corrections_failed": float(sum(r.status == "failed" for r in rows)),
        }
        if done:
            out["corrected_rate"] = sum(r.verdict == "incorrect" for r in done) / len(done)
            lat = [r.latency_ms for r in done if r.latency_ms is not None]
            out["corrector_latency_ms"] = float(np.mean(lat)) if lat else 0.0
            out["corrector_tokens"] = float(sum(r.tokens for r in done))
        return out

    def _restore_success_window(self, s: Session) -> None:
        from shared.db.models import Episode

        rows = s.execute(
            select(Episode.success, Episode.total_return, Episode.length)
            .where(
                Episode.run_id == self.run_id,
                Episode.finished.is_(True),
                Episode.success.is_not(None),
            )
            .order_by(Episode.id.desc())
            .limit(self.success.size)
        ).all()
        for r in reversed(rows):
            self.success.add(bool(r.success), float(r.total_return), int(r.length))

    def _check_cancel(self) -> None:
        with session_scope() as s:
            if s.scalar(select(Run.cancel_requested).where(Run.id == self.run_id)):
                raise Cancelled()

    def _end(self, status: str, error: str | None = None) -> str:
        if self.corrections is not None and status != "failed":
            try:
                self.corrections.close()
            except Exception:
                log.exception("closing the correction pool")
        with session_scope() as s:
            run = s.get(Run, self.run_id)
            assert run is not None
            run.status, run.finished_at = status, utcnow()
            run.phase = run.phase_step = run.phase_total = None
            close_cut_off(s, self.run_id)
            if error:
                run.error = error[:4000]
        log.info("run %s %s", self.run_id, status)
        return status
