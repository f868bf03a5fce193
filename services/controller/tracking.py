"""Experiment trackers: a run's metrics, evaluation, config and summary in TensorBoard, W&B and
MLflow, through each project's own client library.

``Trackers`` is what the run driver holds: ``start`` (the config), ``log`` (one update's metrics,
the greedy evaluation among them), ``finish`` (the final summary). A tracker that raises is
switched off for the rest of the run and its error kept in ``failures``; the driver writes them
to the run record and the update metrics. A tracker never fails the run.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from shared.schemas import RunConfig, TrackingConfig
from shared.settings import Settings, get_settings

log = logging.getLogger("gtr.tracking")


class Tracker(Protocol):
    name: str
    where: str  # a folder or URI a person can open

    def start(self, run_id: int, cfg: RunConfig) -> None: ...
    def log(self, step: int, metrics: dict[str, float]) -> None: ...
    def finish(self, status: str, summary: dict[str, Any]) -> None: ...


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics dict (booleans as 0/1); ids and shas are left out."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool):
            out[k] = float(v)
        elif isinstance(v, int | float) and math.isfinite(v) and not k.endswith("_id"):
            out[k] = float(v)
    return out


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-4}} -> {"train.lr": 1e-4}: the form trackers' params take."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out |= flatten(v, key + ".")
        else:
            out[key] = v
    return out


def run_folder(run_id: int, settings: Settings | None = None) -> Path:
    """The run's own folder, beside its checkpoints."""
    from shared.storage import checkpoint_store

    return checkpoint_store(settings).root / f"run-{run_id}"


class TensorBoard:
    name = "tensorboard"

    def __init__(self, logdir: Path) -> None:
        self.logdir, self.where = logdir, str(logdir)
        self.writer: Any = None

    def start(self, run_id: int, cfg: RunConfig) -> None:
        import json

        from torch.utils.tensorboard import SummaryWriter

        self.logdir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.logdir))
        text = json.dumps(cfg.model_dump(mode="json"), indent=2, sort_keys=True)
        # Markdown code block: TensorBoard's text tab renders it as written.
        self.writer.add_text("config", "```\n" + text + "\n```", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        assert self.writer is not None
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        assert self.writer is not None
        lines = [f"| {k} | {v} |" for k, v in sorted(summary.items())]
        self.writer.add_text("summary", "| key | value |\n|---|---|\n" + "\n".join(lines), 0)
        self.writer.close()


class WandB:
    name = "wandb"

    def __init__(self, folder: Path, project: str, mode: str) -> None:
        self.folder, self.project, self.mode = folder, project, mode
        self.where = str(folder / "wandb")
        self.run: Any = None

    def start(self, run_id: int, cfg: RunConfig) -> None:
        import wandb

        self.folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=self.project,
            name=f"{cfg.name}-{run_id}",
            config=cfg.model_dump(mode="json"),
            dir=str(self.folder),
            mode=self.mode,  # type: ignore[arg-type]
            reinit="create_new",
            tags=[cfg.task, cfg.algorithm],
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        assert self.run is not None
        self.run.log(metrics, step=step)

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        assert self.run is not None
        self.run.summary.update(summary)
        self.run.finish(exit_code=0 if status == "completed" else 1)


class MLflow:
    name = "mlflow"

    def __init__(self, uri: str, experiment: str, artifacts: Path | None) -> None:
        self.uri, self.experiment, self.artifacts = uri, experiment, artifacts
        self.where, self.run_id = uri, ""
        self.client: Any = None

    def start(self, run_id: int, cfg: RunConfig) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if self.uri.startswith("sqlite:///"):
            Path(self.uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        client = MlflowClient(self.uri)
        exp = client.get_experiment_by_name(self.experiment)
        art = self.artifacts.resolve().as_uri() if self.artifacts is not None else None
        exp_id = exp.experiment_id if exp else client.create_experiment(self.experiment, art)
        tags = {"gtr.run_id": str(run_id), "gtr.task": cfg.task, "gtr.algorithm": cfg.algorithm}
        run = client.create_run(exp_id, run_name=f"{cfg.name}-{run_id}", tags=tags)
        self.client, self.run_id = client, run.info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten(cfg.model_dump(mode="json")).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
            client.log_batch(self.run_id, params=params[i : i + 100])
        client.log_dict(self.run_id, cfg.model_dump(mode="json"), "config.json")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        assert self.client is not None
        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        assert self.client is not None
        self.client.log_dict(self.run_id, summary, "summary.json")
        state = {"completed": "FINISHED", "cancelled": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, state)


def resolve(cfg: TrackingConfig, settings: Settings) -> dict[str, bool]:
    """Which trackers are on: the run's [tracking] section, else the GTR_TRACKING_* defaults."""
    pick = lambda run, default: default if run is None else run  # noqa: E731
    return {
        "tensorboard": pick(cfg.tensorboard, settings.tracking_tensorboard),
        "wandb": pick(cfg.wandb, settings.tracking_wandb),
        "mlflow": pick(cfg.mlflow, settings.tracking_mlflow),
    }


def make_trackers(run_id: int, cfg: RunConfig, settings: Settings | None = None) -> list[Tracker]:
    settings = settings or get_settings()
    on, t = resolve(cfg.tracking, settings), cfg.tracking
    folder = run_folder(run_id, settings)
    out: list[Tracker] = []
    if on["tensorboard"]:
        out.append(TensorBoard(folder / "tensorboard"))
    if on["wandb"]:
        out.append(
            WandB(
                folder,
                t.wandb_project or settings.tracking_wandb_project,
                settings.tracking_wandb_mode,
            )
        )
    if on["mlflow"]:
        local = settings.data_dir / "mlruns"
        uri = settings.tracking_mlflow_uri or f"sqlite:///{(local / 'mlflow.db').resolve()}"
        # A local store keeps its artifacts beside it; a server decides for itself.
        db = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else None
        artifacts = Path(db).parent / "artifacts" if db else None
        out.append(
            MLflow(uri, t.mlflow_experiment or settings.tracking_mlflow_experiment, artifacts)
        )
    return out


class Trackers:
    """All of a run's trackers; each call goes to every tracker still working."""

    def __init__(self, run_id: int, cfg: RunConfig, trackers: list[Tracker]) -> None:
        self.run_id, self.cfg, self.trackers = run_id, cfg, trackers
        self.started: list[Tracker] | None = None
        self.failures: dict[str, str] = {}
        self.seconds = 0.0  # time the run waited on trackers (docs/benchmarks.md: overhead)
        self._starting: threading.Thread | None = None

    @classmethod
    def for_run(cls, run_id: int, cfg: RunConfig) -> Trackers:
        return cls(run_id, cfg, make_trackers(run_id, cfg))

    def __bool__(self) -> bool:
        return bool(self.trackers)

    def begin(self) -> None:
        """Start the trackers in a thread while the run warms up and rolls out (W&B's service
        and MLflow's store take seconds to start); ``log`` waits for it."""
        if self.trackers and self.started is None and self._starting is None:
            self._starting = threading.Thread(target=self._start_all, name="trackers", daemon=True)
            self._starting.start()

    def _start_all(self) -> None:
        self.started = [t for t in self.trackers if self._call(t, "start", self.run_id, self.cfg)]

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, float]:
        """One update; trackers start here unless ``begin`` started them (a resumed run too).
        Returns the metrics the update row gets: failed trackers and the seconds spent here."""
        before = self.seconds
        if self._starting is not None:
            waited = time.monotonic()
            self._starting.join()
            self._starting = None
            self.seconds += time.monotonic() - waited  # only what the run waited for
        if self.started is None:
            self._start_all()
        values = numeric(metrics)
        for t in self._live():
            self._call(t, "log", step, values)
        return {
            "tracking/failures": float(len(self.failures)),
            "tracking_s": self.seconds - before,
        }

    def finish(self, status: str, summary: dict[str, Any]) -> None:
        if self._starting is not None:  # the run ended before its first update
            self._starting.join()
            self._starting = None
        for t in self._live():
            self._call(t, "finish", status, summary)

    def status(self) -> dict[str, dict[str, Any]]:
        """For the run record: where each tracker writes, and the error of a failed one."""
        out: dict[str, dict[str, Any]] = {}
        for t in self.trackers:
            err = self.failures.get(t.name)
            out[t.name] = {"ok": err is None, "where": t.where, **({"error": err} if err else {})}
        return out

    def _live(self) -> list[Tracker]:
        return [t for t in self.started or [] if t.name not in self.failures]

    def _call(self, t: Tracker, method: str, *args: Any) -> bool:
        started = time.monotonic()
        counted = threading.current_thread() is not self._starting
        try:
            getattr(t, method)(*args)
            return True
        except Exception as e:  # a tracker never fails the run: the error goes on the record
            log.warning("run %s: tracker %s failed in %s: %s", self.run_id, t.name, method, e)
            self.failures[t.name] = f"{method}: {type(e).__name__}: {e}"[:1000]
            return False
        finally:
            if counted:  # a background start costs the run only the wait in ``log``
                self.seconds += time.monotonic() - started


def run_info_metrics(info: dict[str, Any] | None, u: int, timings: dict[str, float]) -> dict:
    """Update metrics from the run record: the warm start's reuse on the first update."""
    out: dict[str, float] = dict(timings)
    warm = (info or {}).get("warm_start")
    if u == 0 and warm:
        out["warm_start/reused"] = float(bool(warm.get("reused")))
        out["warm_start/seconds"] = float(warm.get("seconds", 0.0))
    return out


def final_summary(session: Any, run: Any) -> dict[str, Any]:
    """What a tracker's summary holds: the run's end state and its last update's metrics."""
    from sqlalchemy import select

    from shared.db.models import Update

    last = session.scalar(
        select(Update).where(Update.run_id == run.id).order_by(Update.idx.desc()).limit(1)
    )
    out: dict[str, Any] = numeric(dict(last.metrics)) if last is not None else {}
    out |= {
        "status": run.status,
        "updates_done": run.updates_done,
        "env_steps": run.env_steps,
        "gtr_run_id": run.id,
    }
    if run.error:
        out["error"] = run.error[:500]
    return out
