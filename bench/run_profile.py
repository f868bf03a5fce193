"""Where a whole run's CPU time goes, stage by stage, and the cost of a run against another commit.

    .venv/bin/python bench/run_profile.py                          # profile: 4 arms, 4 updates
    .venv/bin/python bench/run_profile.py --arms gtr --updates 3 --compare 01ba92f --rounds 2

Each arm is one embedded ``gtr train``-like run of the study's EZPoints cell (the task's config in
configs/repro/ with the arm's keys from configs/repro/arms.toml), started from the study's kept
warm start (docs/results/warm/ezpoints), in its own process and data folder, with one torch
thread. The warm start is excluded: counting starts when the first update's rollout does.

CPU seconds, not wall seconds: the machine is shared, and a process's CPU time moves far less
than its wall time when others load the cores. Every stage is timed with the CPU clock of the
thread that runs it (``time.thread_time``), exclusive of the stages nested in it, so a stage on
the recorder or corrector threads is counted where it runs; ``(other threads)`` is the process's
CPU time (``getrusage``, children included) that no timed stage holds. The figures of a short run
are scaled to a 60-update run by each phase's number of calls there (an evaluation every
``eval_every`` updates, a probe per update plus one before the first).

``--compare REV`` also runs the same arms on REV (a detached git worktree), the old and the new
tree alternating round by round, and prints new / old CPU seconds: a ratio from one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TASK = "ezpoints"
ARMS = ("gtr", "rl4vlm", "sft_only", "gtr_turbo")
FULL_UPDATES = 60  # the study's run length the estimate is scaled to

# ---- the child: one instrumented run -------------------------------------------------------

_local = threading.local()
_lock = threading.Lock()
TOTALS: dict[tuple[str, str], float] = {}  # (phase, stage) -> CPU seconds, exclusive
CALLS: dict[str, int] = {}  # phase -> calls


def _stack() -> list[list[Any]]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _timed(fn: Callable[..., Any], stage: str, phase: bool) -> Callable[..., Any]:
    """``fn`` timed on its thread's CPU clock as ``stage``, exclusive of the timed calls inside
    it: a phase of its own when ``phase``, else a stage of the phase that encloses it."""

    def wrapper(*args: Any, **kw: Any) -> Any:
        stack = _stack()
        ph = stage if phase else (stack[-1][0] if stack else "(unphased)")
        if phase and not (stack and stack[-1][0] == stage):  # not a phase's call of its own kind
            with _lock:
                CALLS[stage] = CALLS.get(stage, 0) + 1
        frame = [ph, stage, 0.0]  # phase, stage, CPU of nested stages
        stack.append(frame)
        start = time.thread_time()
        try:
            return fn(*args, **kw)
        finally:
            spent = time.thread_time() - start
            stack.pop()
            with _lock:
                key = (ph, stage)
                TOTALS[key] = TOTALS.get(key, 0.0) + spent - frame[2]
            if stack:
                stack[-1][2] += spent

    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


# (module, attribute path, stage, is a phase). A name missing in a tree is skipped (reported).
TARGETS: list[tuple[str, str, str, bool]] = [
    # the run driver (before the RunDriver split: its methods; after: its collaborators)
    ("services.controller.service", "RunDriver._start", "warm start", True),
    ("services.controller.service", "RunDriver._probe_states", "probe set", True),
    ("services.controller.monitor", "CollapseMonitor.states", "probe set", True),
    ("services.controller.service", "RunDriver._rollout_and_store", "rollout", True),
    ("services.controller.service", "RunDriver.collect", "collect", False),
    ("services.controller.collector", "RolloutCollector.collect", "collect", False),
    ("services.controller.service", "RunDriver._values", "values", False),
    ("services.controller.collector", "last_values", "values", False),
    ("services.controller.service", "RunDriver._step_records", "record", False),
    ("services.controller.collector", "RolloutCollector.step_records", "record", False),
    ("services.controller.service", "RunDriver._write_step", "record (db thread)", True),
    ("services.controller.collector", "RolloutCollector.write_step", "record (db thread)", True),
    ("services.controller.backends", "CorrectionSweep.sweep", "corrections sweep", True),
    ("services.controller.backends", "InProcessTrainer.update", "train", True),
    ("services.controller.backends", "InProcessPolicy.load_weights", "load checkpoint", True),
    ("services.controller.service", "RunDriver._finish_update", "metrics/tracking", True),
    ("services.controller.service", "RunDriver._probe", "probe", True),
    ("services.controller.monitor", "CollapseMonitor.probe", "probe", True),
    ("services.controller.evaluate", "evaluate", "eval", True),
    ("services.controller.evaluate", "evaluate_deals", "eval", True),
    ("services.controller.service", "RunDriver._parse", "parse", False),
    ("services.controller.monitor", "CollapseMonitor._parse", "parse", False),
    ("services.controller.tracking", "Trackers.log", "trackers", False),
    ("services.controller.metrics", "probe_metrics", "metrics", False),
    ("services.controller.metrics", "batch_metrics", "metrics", False),
    ("services.corrector.service", "record_correction", "corrector", True),
    ("services.corrector.service", "record_corrections", "corrector", True),
    ("services.policy.service", "Policy.generate", "generate", False),
    ("services.policy.service", "Policy.score", "score", False),
    ("services.policy.service", "Policy.load_weights", "load weights", False),
    ("services.env.service", "EnvPool.step_batch", "env", False),
    ("services.env.service", "EnvPool.reset", "env", False),
    ("services.env.service", "EnvPool.create", "env", False),
    ("services.trainer.service", "Trainer.compute_advantages", "advantages", False),
    ("services.trainer.service", "Trainer.ppo_loss", "ppo loss", False),
    ("services.trainer.service", "Trainer.sft_loss", "sft loss", False),
    ("services.trainer.service", "Trainer._backward", "backward", False),
    ("services.trainer.service", "Trainer._accumulate_apart", "backward", False),
    ("services.trainer.service", "Trainer.optimizer_step", "optimizer", False),
    ("services.trainer.service", "Trainer.image", "images", False),
    ("services.trainer.buffer", "DaggerBuffer.refresh", "dagger buffer", False),
    ("services.trainer.checkpoint", "save_checkpoint", "checkpoint", False),
    ("services.policy.teacher", "TeacherCache.get", "teacher merge", False),
    ("shared.rollout", "Rollout.to_bytes", "rollout blob", False),
    ("shared.rollout", "Rollout.from_bytes", "rollout blob", False),
]


def instrument() -> list[str]:
    """Wrap every target that exists in this tree; returns the stages none of whose targets
    does. Module-level functions are replaced wherever a loaded module imported them by name."""
    import importlib

    found: set[str] = set()
    for mod_name, path, stage, phase in TARGETS:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        *owners, attr = path.split(".")
        owner: Any = mod
        for o in owners:
            owner = getattr(owner, o, None)
        raw = owner.__dict__.get(attr) if owner is not None else None
        if isinstance(raw, classmethod):
            setattr(owner, attr, classmethod(_timed(raw.__func__, stage, phase)))
            found.add(stage)
            continue
        if raw is None or not callable(raw):
            continue
        wrapped = _timed(raw, stage, phase)
        setattr(owner, attr, wrapped)
        found.add(stage)
        if not owners:  # `from module import fn` elsewhere
            for m in list(sys.modules.values()):
                for k, v in list(getattr(m, "__dict__", {}).items()):
                    if v is raw:
                        setattr(m, k, wrapped)
    return sorted({stage for _, _, stage, _ in TARGETS} - found)


def _process_cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def child(spec_path: Path) -> None:
    spec = json.loads(spec_path.read_text())
    tree = Path(spec["tree"])
    sys.path.insert(0, str(tree))
    os.chdir(tree)
    import services  # noqa: F401 - the tree's own, checked below

    where = Path(sys.modules["services"].__file__ or "").resolve()
    if tree.resolve() not in where.parents:
        sys.exit(f"services imported from {where}, not from {tree}")
    from services.api.service import create_run
    from services.controller import loop
    from shared.db.migrate import ensure_schema
    from shared.db.session import session_scope
    from shared.schemas import RunConfig
    from shared.settings import get_settings

    # Import what the run uses before wrapping, so from-imports are found and replaced.
    for m in (
        "services.controller.service",
        "services.controller.collector",
        "services.controller.monitor",
        "services.controller.backends",
        "services.controller.evaluate",
        "services.corrector.service",
        "services.trainer.runs",
        "services.trainer.service",
        "services.trainer.checkpoint",
        "services.trainer.buffer",
        "services.policy.teacher",
        "services.policy.service",
        "services.env.service",
    ):
        try:
            __import__(m)
        except ImportError:  # a module of the other tree's layout
            pass
    missing = instrument()
    ensure_schema()
    cfg = RunConfig.model_validate(spec["config"])
    with session_scope() as s:
        run_id = create_run(s, cfg, team="default").id

    marks: dict[str, float] = {}
    start_fn = sys.modules["services.controller.service"].RunDriver._start

    def start_then_reset(*a: Any, **kw: Any) -> Any:
        out = start_fn(*a, **kw)
        with _lock:  # the warm start (and what ran beside it) is not part of the run's cost
            TOTALS.clear()
            CALLS.clear()
        marks["start"] = _process_cpu()
        marks["wall"] = time.monotonic()
        return out

    sys.modules["services.controller.service"].RunDriver._start = start_then_reset
    status = loop.drive(run_id, get_settings())
    total = _process_cpu() - marks["start"]
    wall = time.monotonic() - marks["wall"]
    attributed = sum(TOTALS.values())
    rows = [[p, s, v] for (p, s), v in sorted(TOTALS.items())]
    rows.append(["(other threads)", "", max(0.0, total - attributed)])
    out = {
        "status": status,
        "cpu_s": total,
        "wall_s": wall,
        "rows": rows,
        "calls": CALLS,
        "missing": missing,
        "eval_every": cfg.metrics.eval_every,
        "eval_episodes": cfg.metrics.eval_episodes,
        "updates": cfg.train.num_updates,
        "load": os.getloadavg()[0],
    }
    Path(spec["out"]).write_text(json.dumps(out))


# ---- the parent -----------------------------------------------------------------------------


def arm_config(arm: str, updates: int, warm: Path) -> dict[str, Any]:
    """The study cell's config with the arm's dotted keys (configs/repro/arms.toml)."""
    with open(ROOT / "configs" / "repro" / f"{TASK}.toml", "rb") as fh:
        raw = tomllib.load(fh)
    with open(ROOT / "configs" / "repro" / "arms.toml", "rb") as fh:
        arms = tomllib.load(fh)
    for key, value in arms[arm].items():
        if key == "description":
            continue
        *parents, last = key.split(".")
        node = raw
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    raw["name"] = f"profile-{arm}"
    raw["init"] = {"kind": "checkpoint", "checkpoint": str(warm)}
    raw["train"]["num_updates"] = updates
    return raw


def child_env(data: Path, models: Path, tree: Path) -> dict[str, str]:
    drop = ("GTR_DATABASE_URL", "GTR_REDIS_URL", "GTR_ENV_SERVICE_URL", "GTR_POLICY_SERVICE_URL")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("GTR_BLOB")}
    return env | {
        "GTR_DATA_DIR": str(data),
        "GTR_MODEL_DIR": str(models),
        "GTR_TORCH_THREADS": "1",
        # the tree first; packages installed beside the interpreter's (a GPU machine's
        # carried wheels) stay importable
        "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }


def install_warm(tmp: Path) -> Path:
    """The study's kept warm start with its base model built here (as bench/reproduce.py does)."""
    from services.trainer.warmstart import base_model_path
    from shared.schemas import ModelConfig

    src = ROOT / "docs" / "results" / "warm" / TASK
    with open(ROOT / "configs" / "repro" / f"{TASK}-warm.toml", "rb") as fh:
        model = ModelConfig.model_validate(tomllib.load(fh).get("model", {}))
    os.environ["GTR_MODEL_DIR"] = str(tmp / "models")
    from shared.settings import get_settings

    get_settings.cache_clear()  # type: ignore[attr-defined]
    base = base_model_path(model, TASK)
    dest = tmp / "warm"
    dest.mkdir()
    for f in src.iterdir():
        if f.name != "policy.json":
            shutil.copy2(f, dest / f.name)
    meta = json.loads((src / "policy.json").read_text()) | {"base_model": str(base)}
    (dest / "policy.json").write_text(json.dumps(meta))
    return dest


def run_one(tree: Path, arm: str, updates: int, warm: Path, tmp: Path, tag: str) -> dict:
    data = tmp / tag
    data.mkdir(parents=True)
    spec = {
        "tree": str(tree),
        "config": arm_config(arm, updates, warm),
        "out": str(data / "profile.json"),
    }
    (data / "spec.json").write_text(json.dumps(spec))
    with open(data / "log.txt", "w") as log:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child", str(data / "spec.json")],
            cwd=tree,
            env=child_env(data, tmp / "models", tree),
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if proc.returncode != 0 or not (data / "profile.json").exists():
        tail = (data / "log.txt").read_text()[-3000:]
        raise RuntimeError(f"{tag}: the run failed (exit {proc.returncode}):\n{tail}")
    out = json.loads((data / "profile.json").read_text())
    if out["status"] != "completed":
        raise RuntimeError(f"{tag}: the run ended {out['status']}; see {data / 'log.txt'}")
    return out


def full_run_scale(prof: dict) -> dict[str, float]:
    """Per phase: the factor from this short run to a FULL_UPDATES-update one."""
    u, every = prof["updates"], prof["eval_every"]
    evals = len({0, FULL_UPDATES - 1} | {k for k in range(FULL_UPDATES) if (k + 1) % every == 0})
    calls = prof["calls"]
    scale = {p: FULL_UPDATES / u for p in calls}
    scale["eval"] = evals / max(1, calls.get("eval", 1))
    scale["probe"] = (FULL_UPDATES + 1) / max(1, calls.get("probe", 1))
    scale["probe set"] = 1.0
    return scale


def table(prof: dict, arm: str) -> list[str]:
    scale = full_run_scale(prof)
    default = FULL_UPDATES / prof["updates"]
    est = [(p, s, v, v * scale.get(p, default)) for p, s, v in prof["rows"]]
    full = sum(e for *_, e in est)
    lines = [
        f"{arm}: {prof['cpu_s']:.1f} CPU-s for {prof['updates']} updates "
        f"(wall {prof['wall_s']:.0f} s, load {prof['load']:.1f}); "
        f"a {FULL_UPDATES}-update run ≈ {full / 60:.1f} CPU-min",
        "| phase | stage | CPU-s measured | CPU-s per 60-update run | share |",
        "|---|---|---|---|---|",
    ]
    for p, s, v, e in sorted(est, key=lambda r: -r[3]):
        if e / full >= 0.002:
            lines.append(f"| {p} | {s or '-'} | {v:.1f} | {e:.0f} | {100 * e / full:.1f} % |")
    return lines


def worktree(rev: str) -> Path:
    path = Path(tempfile.gettempdir()) / f"gtr-base-{rev}"
    if not (path / "services").exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS), help="arms of configs/repro/arms.toml")
    ap.add_argument("--updates", type=int, default=4, help="updates per measured run")
    ap.add_argument("--compare", metavar="REV", help="also run on this commit; print new/old")
    ap.add_argument("--rounds", type=int, default=1, help="old/new pairs per arm (--compare)")
    ap.add_argument("--compare-arms", default="gtr", help="the arms --compare runs on REV too")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time")
    ap.add_argument("--keep", action="store_true", help="keep the runs' folders")
    ap.add_argument("--json", type=Path, help="write every profile here")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    sys.path.insert(0, str(ROOT))
    arms = [a for a in args.arms.split(",") if a]
    tmp = Path(tempfile.mkdtemp(prefix="gtr-run-profile-"))
    try:
        warm = install_warm(tmp)
        base = worktree(args.compare) if args.compare else None
        compared = set(args.compare_arms.split(",")) if base else set()
        plan: list[tuple[str, str, Path]] = []
        for arm in arms:
            both = arm in compared
            for r in range(args.rounds if both else 1):
                # old first in even rounds, new first in odd: drift in the load hits both alike
                order = [("new", ROOT), ("old", base)] if both else [("new", ROOT)]
                if r % 2:
                    order.reverse()
                plan += [(arm, f"{label}-{r}", tree) for label, tree in order if tree is not None]
        results: dict[str, list[dict]] = {}

        def one(job: tuple[str, str, Path]) -> None:
            arm, tag, tree = job
            prof = run_one(tree, arm, args.updates, warm, tmp, f"{arm}-{tag}")
            results.setdefault(f"{arm}/{tag.split('-')[0]}", []).append(prof)
            print(f"{arm} {tag}: {prof['cpu_s']:.1f} CPU-s", flush=True)

        # --jobs > 1: runs side by side (each its own process; CPU seconds are per process)
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for f in [pool.submit(one, job) for job in plan]:
                try:
                    f.result()
                except RuntimeError as e:
                    sys.exit(str(e))
        for arm in arms:
            print()
            print("\n".join(table(results[f"{arm}/new"][0], arm)))
            if results[f"{arm}/new"][0]["missing"]:
                print("not timed (absent):", ", ".join(results[f"{arm}/new"][0]["missing"]))
            if arm in compared:
                new = sum(p["cpu_s"] for p in results[f"{arm}/new"])
                old = sum(p["cpu_s"] for p in results[f"{arm}/old"])
                print(
                    f"\n{arm}: new / old ({args.compare}) CPU seconds = {new:.1f} / {old:.1f}"
                    f" = {new / old:.2f} over {args.rounds} round(s) of {args.updates} updates"
                )
                print("\n".join(table(results[f"{arm}/old"][0], f"{arm} (old)")))
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"runs kept in {tmp}")


if __name__ == "__main__":
    main()
