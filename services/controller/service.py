"""The run driver: rollout -> corrections -> update -> publish checkpoint, until the budget ends.

``RunDriver`` is a plain object over four backends (envs, policy, corrections, trainer); the
embedded mode hands it in-process objects, the full stack hands it network clients. It reads as
the stages of an update; each concern is a collaborator in its own module:
- ``Episodes`` (episodes.py): the env sessions, their seeds and GRPO groups, the open episodes
  and the success windows;
- ``RolloutCollector`` (collector.py): ``num_steps`` batched steps, each written to the store and
  queued for correction at once, so corrections run while the rollout goes on;
- ``CorrectionBook`` (correction_book.py): waiting for corrections (``corrector.wait``), sending
  again, once, the ones that never came (the sweep), and each update's correction figures;
- ``CollapseMonitor`` (monitor.py): the fixed probe set decoded greedily, the thought-collapse
  figures and the alarm;
- ``Outages`` (outages.py): a cancel, and a service that went away, waited out.
Each update: collect; settle its corrections where the run waits for them; the rollout to the
blob store and its metrics to the ``updates`` row; the trainer trains on it and writes a
checkpoint, which the policy loads; then the probe set and the alarm.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.controller import metrics as M
from services.controller import store
from services.controller.backends import Corrections, Envs, TrainerBackend, checkpoint_dir
from services.controller.collector import RolloutCollector, last_values
from services.controller.correction_book import CorrectionBook
from services.controller.episodes import Episodes
from services.controller.evaluate import (
    DealOutcome,
    evaluate_deals,
    protocol_record,
    summarize,
)
from services.controller.monitor import CollapseMonitor
from services.controller.outages import Cancelled, Outages, check_cancel, is_interruption
from services.controller.recorder import discard_after
from services.controller.start_eval import StartEval, evaluate_start, start_figures
from services.controller.tracking import Trackers, final_summary, run_info_metrics
from shared.db.session import session_scope
from shared.phase import RunCancelled, cancel_requested, set_phase
from shared.storage import blob_store

if TYPE_CHECKING:
    from services.policy.protocol import RolloutPolicy

log = logging.getLogger("gtr.controller")


@dataclass
class Progress:
    update_idx: int
    env_steps: int
    total_env_steps: int
    metrics: dict[str, Any] = field(default_factory=dict)


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
        self.envs, self.policy, self.trainer = envs, policy, trainer
        self.on_progress = on_progress or (lambda p: None)
        self.blobs = blob_store()
        with session_scope() as s:
            self.cfg = cfg = store.run_config(s, run_id)
        self.outages = Outages(
            run_id, [envs, policy, corrections, trainer], outage_s, max_interruptions
        )
        self.episodes = Episodes(run_id, envs, cfg)
        self.book = CorrectionBook(run_id, corrections, cfg)
        self.collector = RolloutCollector(
            run_id, cfg, envs, policy, self.episodes, self.book, self.blobs, policy_steps_envs
        )
        self.monitor = CollapseMonitor(run_id, envs, policy, cfg)
        self.tracking = Trackers.for_run(run_id, cfg)
        self.update_started: float | None = None  # wall time of an update, for update_s
        self.update_cpu: float | None = None  # this process's CPU time then, for update_cpu_s
        self.train_s: float | None = None
        self.start: StartEval | None = None  # the start's evaluation, before update 0

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
            self.episodes.close()

    def _drive(self) -> None:
        self.tracking.begin()  # trackers start in the background during the warm start
        start, unfinished = self._start()
        self.episodes.open(start)
        probe = self.monitor.states()
        if start == 0 and unfinished is None and probe:
            self.monitor.probe_start(probe)
        if start == 0 and unfinished is None and self.cfg.metrics.eval_episodes:
            # The start is a data point: the same deals and protocol, before any update; played
            # once per start (another arm's outcomes of the same start are taken: start_eval.py).
            set_phase(self.run_id, "evaluating")
            self.start = evaluate_start(
                self.run_id, self.envs, self.policy, self.cfg, self.cfg.metrics.eval_episodes
            )
        if unfinished is not None:  # trained, its checkpoint loaded, but never probed/recorded
            self._finish_update(unfinished, probe)
        for u in range(start, self.cfg.train.num_updates):
            check_cancel(self.run_id)
            set_phase(self.run_id, "rollout", 0, self.cfg.train.num_steps)
            self._rollout_and_store(u)
            self.book.sweep(u)
            trained = time.monotonic()
            set_phase(self.run_id, "training")
            path = self.trainer.update(self.run_id, u)
            self.train_s = time.monotonic() - trained
            self.policy.load_weights(str(path))
            # A cancel (a person's, or a tuning stage's stop of a hopeless trial) that came
            # during the rollout or training: the evaluation is left to a resume, which finds
            # the update trained but unfinished (``_start``) and finishes it.
            check_cancel(self.run_id)
            self._finish_update(u, probe)
            self.outages.interruptions = 0
        self.book.finish()

    def _ride_out(self, e: Exception) -> None:
        """A service went away: wait for it, then resume as a restarted controller does.

        Env sessions die with the env service, and a restarted policy service serves its base
        weights, so the partial rollout is dropped and ``_start`` reloads the last checkpoint."""
        self.outages.count(e)
        self.episodes.close()
        self.outages.wait(e)
        self.collector.same_envs = None
        self.episodes.forget()  # _start refills the success window

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
            self.episodes.restore(s)
        if pending:
            # The rollout was stored but not trained: train it rather than collect it again.
            self.policy.load_weights(str(self.trainer.update(self.run_id, last + 1)))
            return last + 2, last + 1
        if last < 0:
            set_phase(self.run_id, "warm_start" if self.cfg.init.kind == "warm_start" else None)
        path = self.trainer.init(self.run_id) if last < 0 else checkpoint_dir(self.run_id, last)
        self.policy.load_weights(str(path))
        return last + 1, (last if 0 <= last and finished < last + 1 else None)

    # ---- the stages of an update ----------------------------------------------------------

    def _rollout_and_store(self, u: int) -> None:
        started = self.update_started = time.monotonic()
        self.update_cpu = time.process_time()
        ro = self.collector.collect(u)
        rollout_s = time.monotonic() - started
        if self.cfg.corrector.wait == "update" and self.book.backend is not None:
            queued = [sid for sid, ok in zip(ro.step_ids, ro.format_valid, strict=True) if ok]
            set_phase(self.run_id, "corrections")
            self.book.settle(queued)
        self.book.bound(u)  # bounded staleness: wait rather than train on uncorrected steps
        # The policy service may have restarted, silently, while we waited for corrections.
        if hasattr(self.policy, "ensure_loaded") and self.policy.ensure_loaded():
            log.warning("run %s: the policy service had lost the run's checkpoint", self.run_id)
        rollout = ro.to_rollout(self.cfg, last_values(self.policy, self.episodes.obs))
        sha = self.blobs.put(rollout.to_bytes())
        stats = M.batch_metrics(ro.views, self.monitor.relevant)
        with session_scope() as s:
            speed = {
                "rollout_s": rollout_s,
                "env_steps_per_s": len(ro.step_ids) / max(rollout_s, 1e-9),
            }
            summary = {
                **stats,
                **self.episodes.success_metrics(),
                **speed,
                **self.collector.clock.metrics(),
                **store.episode_counts(s, self.run_id),
                **M.benchmark_share([v.state for v in ro.views]),
                "rollout_sha": sha,
            }
            store.add_update(s, self.run_id, u, summary)

    def _finish_update(self, u: int, probe: list[Any]) -> None:
        set_phase(self.run_id, "evaluating")
        extra = self.monitor.figures(probe, u)
        episodes, every = self.cfg.metrics.eval_episodes, self.cfg.metrics.eval_every
        deals: list[DealOutcome] = []  # each deal's outcome, for the studies' statistics
        # After the first update (a baseline close to the warm start), every N-th and the last.
        if episodes and (u == 0 or (u + 1) % every == 0 or u + 1 == self.cfg.train.num_updates):
            began = time.monotonic()
            deals = evaluate_deals(self.envs, self.policy, self.cfg, episodes)
            extra |= summarize(deals) | {"eval_s": time.monotonic() - began}  # for the ETA
        with session_scope() as s:
            row, run = store.update_row(s, self.run_id, u), store.run_row(s, self.run_id)
            if deals:
                store.record_eval_outcomes(s, self.run_id, u, deals)
                run.info = {**(run.info or {}), "eval_protocol": protocol_record(self.cfg)}
            if u == 0 and self.start is not None and self.start.outcomes:
                extra |= start_figures(self.start)
            extra.update(self.book.figures(s, u))
            merged = {**row.metrics, **extra, **run_info_metrics(run.info, u, self.timings())}
            reason = self.monitor.alarm(s, u, merged)
            if self.tracking:  # a failed tracker shows in the metrics and on the run record
                merged |= self.tracking.log(u, merged)
                store.set_tracking(run, self.tracking.status())
            store.finish_update(run, row, merged, alarm=reason is not None)
            env_steps = run.env_steps
        self.on_progress(Progress(u, env_steps, self.cfg.total_env_steps, merged))

    def timings(self) -> dict[str, float]:
        """Seconds of the update just finished: all of it, the trainer's part, and the CPU
        seconds this process spent on it. Wall seconds grow when the host is shared or paused;
        CPU seconds do not. On the embedded default this process does everything (rollout,
        training, evaluation); on the full stack it is the controller's part only."""
        out = {}
        if self.update_started is not None:
            out["update_s"] = time.monotonic() - self.update_started
        if self.update_cpu is not None:
            out["update_cpu_s"] = time.process_time() - self.update_cpu
        if self.train_s is not None:
            out["train_s"] = self.train_s
        self.update_started = self.update_cpu = self.train_s = None
        return out

    def _end(self, status: str, error: str | None = None) -> str:
        self.book.close(status)
        with session_scope() as s:
            status, error = self.book.final_status(s, status, error)  # degraded: see why
            run = store.end_run(s, self.run_id, status, error)
            if self.tracking:
                self.tracking.finish(status, final_summary(s, run))
                store.set_tracking(run, self.tracking.status())
        log.info("run %s %s", self.run_id, status)
        return status
