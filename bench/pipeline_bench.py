"""Pipeline throughput: env steps per second of the rollout, full stack vs embedded, and what a
slow corrector costs: the speed beside the coverage (requested corrections done by the run's
end) and the lag (updates between a step and its correction), asynchronous vs synchronous (the
reference's loop), for a loopback HTTP corrector of each latency.

    .venv/bin/python bench/pipeline_bench.py [--envs 8 --steps 8 --updates 3] [--repeat 3]
                                             [--delays 0.5,2,10,30] [--sync] [--skip-stack]
                                             [--stack-delays 2:8,30:64]
                                             [--two-trips] [--hosted-envs]

Each speed is the rollout's (``env_steps_per_s`` of the updates, the trainer's time left out) of
a tiny NumberLine run that starts from the same warm-started checkpoint. Ratios are taken within
one invocation, since the machine is shared. The full stack needs PostgreSQL and Redis.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# One torch thread per process in every setting: two threads per process on a shared 2-core
# machine oversubscribe it, and the figures then swing by 5x from one run to the next.
TORCH_THREADS = os.environ.get("GTR_TORCH_THREADS", "1")
sys.path.insert(0, str(ROOT))

CONFIG = """
name = "bench"
task = "numberline"
algorithm = "{algorithm}"
seed = 0
[env]
image_size = 64
[model]
image_size = 64
finetune = "full"
[generation]
max_new_tokens = 40
[init]
kind = "checkpoint"
checkpoint = "{checkpoint}"
[train]
num_envs = {envs}
num_steps = {steps}
num_updates = {updates}
minibatch_size = 16
ppo_epochs = 1
# A throughput bench, not a learning one: a tiny step size keeps the warm start's share of
# well-formed outputs (~70 %) in every update, so the corrector is exercised in each of them.
# (At the default 1e-3 one update broke the format and later updates queued no correction.)
lr = 1e-6
[corrector]
name = "{corrector}"
wait = "{wait}"
{inline}
[metrics]
probe_states = 0
"""


def latency_corrector(delay_s: float) -> tuple[str, object]:
    """A real HTTP corrector (POST /v1/correct) that answers 'correct' after `delay_s`."""
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/v1/correct")
    async def correct(body: dict) -> dict:
        import asyncio

        await asyncio.sleep(delay_s)
        return {"verdict": "correct", "corrected_thought": None, "extras": {}, "reasoning": "bench"}

    from tests.conftest import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def warm_checkpoint(out: Path) -> Path:
    from tests.e2e.helpers import make_warm_checkpoint

    return make_warm_checkpoint(out)


ENVS = 8  # set from --envs
# The full stack's one corrector worker: threads, and the corrector's per-process limit
# (docs/deploy.md: replicas x min(threads, params.concurrency) requests in flight).
STACK_SLOTS = 512
# setting -> per round: {stage: seconds per rollout step} (``time/<stage>_s`` of the updates)
STAGES: dict[str, list[dict[str, float]]] = {}


def stages(rows: list[dict]) -> dict[str, float]:
    """Milliseconds per rollout step (all envs of the run) for each timed stage of ``collect``."""
    steps = sum(m["env_steps_per_s"] * m["rollout_s"] for m in rows)
    n_rollout_steps = steps / rows[0].get("num_envs", 1)
    out: dict[str, float] = {}
    for m in rows:
        for k, v in m.items():
            if k.startswith("time/"):
                name = k.removeprefix("time/").removesuffix("_s")
                out[name] = out.get(name, 0.0) + 1000 * v / n_rollout_steps
    out["rollout"] = 1000 * sum(m["rollout_s"] for m in rows) / n_rollout_steps
    # Where the policy service steps the envs, the controller waits on its stream
    # (``stream_wait``) while generate and env run there: those two are inside the wait.
    inside = {"rollout", "generate", "env"} if "stream_wait" in out else {"rollout"}
    out["other"] = out["rollout"] - sum(v for k, v in out.items() if k not in inside)
    return out


# setting -> per round: (coverage, mean lag in updates, done, requested, corrector calls)
COVERAGE: dict[str, list[tuple[float, float, float, float, float]]] = {}


def coverage(url: str, setting: str | None) -> None:
    """The run's requested corrections done by its end, their mean lag, and the corrector calls
    they took (retries included)."""
    from sqlalchemy import select

    from services.controller.correction_stats import run_totals
    from shared.db.models import Run
    from shared.db.session import session_scope
    from shared.schemas import RunConfig

    with session_scope(url) as s:
        run = s.scalar(select(Run).order_by(Run.id.desc()).limit(1))
        if run is None or not RunConfig.model_validate(run.config).uses_corrector:
            return
        t = run_totals(s, run.id)
    if setting and t["corrections"]:
        done = (t["corrections_coverage"], t.get("corrections_lag", 0.0))
        counts = (t["corrections_done"], t["corrections"], t["corrector_calls"])
        COVERAGE.setdefault(setting, []).append((*done, *counts))


def speed(url: str, setting: str | None = None) -> float:
    """Env steps per second over every update's rollout."""
    from sqlalchemy import select

    from shared.db.models import Update
    from shared.db.session import session_scope

    with session_scope(url) as s:
        rows = [u.metrics for u in s.scalars(select(Update).order_by(Update.idx))]
    # The first rollout pays each process's warm-up (first forward passes, connections): leave it
    # out when there are others.
    rows = rows[1:] if len(rows) > 1 else rows
    if setting:
        STAGES.setdefault(setting, []).append(stages([{**m, "num_envs": ENVS} for m in rows]))
    steps = sum(m["env_steps_per_s"] * m["rollout_s"] for m in rows)
    coverage(url, setting)
    return steps / sum(m["rollout_s"] for m in rows)


def embedded(tmp: Path, name: str, cfg: str, label: str | None = None) -> float:
    data = tmp / name
    env = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    env["GTR_DATA_DIR"] = str(data)
    env["GTR_TORCH_THREADS"] = TORCH_THREADS
    env["GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS"] = "true"  # the fake corrector is on 127.0.0.1
    url = f"sqlite:///{(data / 'gtr.sqlite3').resolve()}"
    (tmp / f"{name}.toml").write_text(cfg)
    # A degraded run (exit 1) still has figures: its coverage says what went wrong.
    subprocess.run(
        [sys.executable, "-m", "services.cli", "train", str(tmp / f"{name}.toml")],
        cwd=ROOT,
        env=env,
        check=False,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return speed(url, label)


def inline(url: str) -> str:
    """The loopback corrector, inline in the run's config, with the default params."""
    return f'kind = "http"\nbase_url = "{url}"'


def full_stack(
    tmp: Path, cfg: str, label: str | None = None, settings: dict[str, str] | None = None
) -> float:
    """A run through the services; ``settings``: more GTR_* variables for every part."""
    import psycopg

    from tests.conftest import free_port

    name = "gtr_bench_pipeline"
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        c.execute(f'CREATE DATABASE "{name}"')
    db = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    ports = [free_port() for _ in range(3)]
    settings = settings or {}
    hosted = settings.get("GTR_POLICY_HOSTS_ENVS") == "true"
    policy_url = f"http://127.0.0.1:{ports[2]}"
    env = {
        **os.environ,
        "GTR_TORCH_THREADS": TORCH_THREADS,
        "GTR_DATABASE_URL": db,
        "GTR_REDIS_URL": "redis://127.0.0.1:6379/13",
        "GTR_DATA_DIR": str(tmp / "stack"),
        "GTR_ENV_SERVICE_URL": f"{policy_url}/env" if hosted else f"http://127.0.0.1:{ports[1]}",
        "GTR_POLICY_SERVICE_URL": policy_url,
        "GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS": "true",  # the fake corrector is on 127.0.0.1
        **settings,
    }
    os.environ.update({"GTR_DATABASE_URL": db})
    from shared.db.migrate import upgrade

    upgrade(db)
    base = json.loads(
        (Path(cfg.split('checkpoint = "')[1].split('"')[0]) / "policy.json").read_text()
    )["base_model"]
    gtr = [sys.executable, "-m", "services.cli"]
    cmds = {
        "policy": ["policy", "serve", "--model", base, "--port", str(ports[2])],
        "corrector": ["worker", "corrector", "--concurrency", str(STACK_SLOTS)],
        "trainer": ["worker", "trainer"],
        "controller": ["controller", "--poll", "0.5"],
    }
    if not hosted:  # else the policy service serves the env routes
        cmds["env"] = ["env", "serve", "--port", str(ports[1])]
    procs = {
        name: subprocess.Popen(
            [*gtr, *c], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for name, c in cmds.items()
    }
    try:
        import tomllib

        from services.api.service import create_run
        from services.controller.stack import _wait_healthy
        from shared.db.models import Run
        from shared.db.session import session_scope
        from shared.schemas import RunConfig

        _wait_healthy("policy service", policy_url, procs["policy"], timeout_s=300)
        env_proc = procs.get("env", procs["policy"])
        _wait_healthy("env service", env["GTR_ENV_SERVICE_URL"], env_proc, timeout_s=300)
        with session_scope(db) as s:
            run_id = create_run(s, RunConfig.model_validate(tomllib.loads(cfg)), "default").id
        while True:
            with session_scope(db) as s:
                run = s.get(Run, run_id)
                assert run is not None
                status = run.status
            if status in ("completed", "degraded", "failed", "cancelled"):
                break
            time.sleep(1)
        if status not in ("completed", "degraded"):
            raise RuntimeError(f"full-stack bench run ended {status}")
        return speed(db, label)
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(timeout=30)


def main() -> None:
    global ENVS
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--envs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--delays", default="0.5,2,10,30", help="embedded corrector latencies (s)")
    ap.add_argument("--sync", action="store_true", help="also wait = step for each latency")
    ap.add_argument("--skip-stack", action="store_true")
    ap.add_argument(
        "--stack-delays",
        default="2:8,30:64",
        help="full-stack corrector latencies in s, each with its envs (latency:envs)",
    )
    ap.add_argument(
        "--two-trips",
        action="store_true",
        help="also the full stack with the controller running the rollout loop "
        "(GTR_POLICY_STEPS_ENVS=false: a generate and an env step request a rollout step; "
        "the default is the policy service's loop, POST /rollout)",
    )
    ap.add_argument(
        "--hosted-envs",
        action="store_true",
        help="also the full stack with the envs in the policy service's process "
        "(GTR_POLICY_HOSTS_ENVS=true: no env service, no hop a rollout step)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="rounds over every setting (median)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also print milliseconds per rollout step in each stage (generate, env, record...)",
    )
    args = ap.parse_args()
    ENVS = args.envs
    tmp = Path(tempfile.mkdtemp(prefix="gtr-pipeline-bench-"))
    ckpt = warm_checkpoint(tmp)
    shape = {"checkpoint": ckpt, "envs": args.envs, "steps": args.steps, "updates": args.updates}

    def config(algorithm: str, corrector: str, wait: str, url: str = "", **kw: object) -> str:
        extra = inline(url) if url else ""
        return CONFIG.format(
            algorithm=algorithm, corrector=corrector, wait=wait, inline=extra, **{**shape, **kw}
        )

    def floats(text: str) -> list[float]:
        return [float(x) for x in text.split(",") if x.strip()]

    delays = floats(args.delays)
    stack_runs = [
        (float(x.split(":")[0]), int(x.split(":")[1]) if ":" in x else args.envs)
        for x in ([] if args.skip_stack else args.stack_delays.split(","))
        if x.strip()
    ]
    servers = {d: latency_corrector(d) for d in sorted({*delays, *(d for d, _ in stack_runs)})}
    settings: dict[str, Callable[[str], float]] = {
        "embedded, no corrector": lambda tag: embedded(
            tmp, f"none-{tag}", config("rl4vlm", "oracle", "none"), "embedded, no corrector"
        ),
        "embedded, oracle, async": lambda tag: embedded(
            tmp, f"oracle-{tag}", config("gtr", "oracle", "none"), "embedded, oracle, async"
        ),
    }
    for d in delays:
        url = servers[d][0]
        for wait, mode in (("none", "async"), ("step", "sync")):
            if mode == "sync" and not args.sync:
                continue
            label = f"embedded, {d:g} s corrector, {mode}"
            cfg = config("gtr", "bench-http", wait, url)

            def one(tag: str, cfg: str = cfg, label: str = label, d: float = d) -> float:
                return embedded(tmp, f"http-{d:g}-{label[-5:]}-{tag}", cfg, label)

            settings[label] = one
    if not args.skip_stack:
        stack_cfg = config("gtr", "oracle", "none")
        settings["full stack, oracle, async"] = lambda tag: full_stack(
            tmp / tag, stack_cfg, "full stack, oracle, async"
        )
        for d, envs in stack_runs:
            label = f"full stack, {d:g} s corrector, {envs} envs, async"
            cfg = config("gtr", "bench-http", "none", servers[d][0], envs=envs)
            slots = f"[corrector.params]\nconcurrency = {STACK_SLOTS}\n"
            cfg = cfg.replace("[metrics]", slots + "[metrics]")

            def stack(tag: str, cfg: str = cfg, label: str = label, d: float = d) -> float:
                return full_stack(tmp / f"{tag}-http-{d:g}", cfg, label)

            settings[label] = stack
        if args.hosted_envs:
            hosted = "full stack, oracle, async, envs in the policy service"
            settings[hosted] = lambda tag: full_stack(
                tmp / f"{tag}-hosted", stack_cfg, hosted, {"GTR_POLICY_HOSTS_ENVS": "true"}
            )
        if args.two_trips:
            two = "full stack, oracle, async, two round trips"
            settings[two] = lambda tag: full_stack(
                tmp / f"{tag}-two", stack_cfg, two, {"GTR_POLICY_STEPS_ENVS": "false"}
            )
    # Rounds, each over every setting in a rotated order: a burst of load from another job hits
    # one round's figure, not one setting's every figure; the median of the rounds is reported.
    runs: dict[str, list[float]] = {k: [] for k in settings}
    loads: dict[str, list[float]] = {k: [] for k in settings}
    names = list(settings)
    for r in range(args.repeat):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            runs[k].append(settings[k](f"r{r}"))
            loads[k].append(os.getloadavg()[0])
            print(json.dumps({k: v for k, v in runs.items() if v}), flush=True)
    report(runs, loads)
    if args.profile:
        report_stages()


def report(runs: dict[str, list[float]], loads: dict[str, list[float]]) -> None:
    out = {k: statistics.median(v) for k, v in runs.items()}
    base = out["embedded, no corrector"]
    print(
        "| setting | rounds (env steps/s) | load avg (1 min) | median | ÷ embedded, none "
        "| corrections done (done/requested, calls) | lag (updates) |"
    )
    print("|---|---|---|---:|---:|---:|---:|")
    for k, v in out.items():
        rounds = ", ".join(f"{x:.1f}" for x in runs[k])
        load = ", ".join(f"{x:.1f}" for x in loads[k])
        cov = COVERAGE.get(k)
        done = f"{statistics.median(c[0] for c in cov):.0%}" if cov else "-"
        if cov:
            done += " (" + ", ".join(f"{c[2]:.0f}/{c[3]:.0f}, {c[4]:.0f}" for c in cov) + ")"
        lag = f"{statistics.median(c[1] for c in cov):.2f}" if cov else "-"
        print(f"| {k} | {rounds} | {load} | {v:.1f} | {v / base:.2f} | {done} | {lag} |")
    emb = runs["embedded, oracle, async"]
    for k in [k for k in out if k.startswith("full stack") and "oracle" in k]:
        ratio = out[k] / out["embedded, oracle, async"]
        # Round by round, the two settings ran minutes apart, not the whole invocation apart:
        # the median of those ratios is less at the mercy of the host's drift.
        paired = [x / e for x, e in zip(runs[k], emb, strict=True)]
        by_round = ", ".join(f"{x:.2f}" for x in paired)
        print(f"\n{k} ÷ embedded (oracle, async): {ratio:.2f} (ratio of the medians)")
        print(f"  round by round: {by_round} (median {statistics.median(paired):.2f})")


def report_stages() -> None:
    """Median over rounds of each stage's milliseconds per rollout step, one column per setting."""
    names = [k for k in STAGES if STAGES[k]]
    keys = sorted({s for k in names for r in STAGES[k] for s in r}, key=_stage_order)
    print("\nms per rollout step (all envs), median of rounds")
    print("| stage | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for s in keys:
        vals = [statistics.median(r.get(s, 0.0) for r in STAGES[k]) for k in names]
        print(f"| {s} | " + " | ".join(f"{v:.1f}" for v in vals) + " |")


def _stage_order(stage: str) -> tuple[int, str]:
    order = ["cancel_check", "stream_wait", "generate", "env", "record", "publish", "other"]
    order.append("rollout")
    return (order.index(stage) if stage in order else len(order) - 2, stage)


if __name__ == "__main__":
    main()
