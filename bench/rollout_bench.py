"""The rollout loop alone, per rollout step: in this process, through the services with two
round trips a step, through the policy service's own loop (``POST /rollout``), and through that
loop where the policy service hosts the envs itself (``--host-envs``: no hop at all).

    GTR_TORCH_THREADS=1 .venv/bin/python bench/rollout_bench.py [--envs 8] [--steps 8]
                                                               [--rounds 10] [--new-tokens 40]

``gtr env serve`` and ``gtr policy serve`` run as child processes (the policy service told of the
env service, as ``gtr up`` does), and a second ``gtr policy serve --host-envs``, on a tiny model
built here; the embedded loop runs the same model folder in this process over an ``EnvPool``. The
model is untrained, so nearly every response runs to ``--new-tokens`` and every mode decodes the
same number of tokens a step: no sampling luck between modes. Each round runs a ``--steps``
rollout in every mode (rotated order, a 0.3 s pause before each, as an update leaves the
processes idle); a ratio is the median of the per-round ratios. It also prints where each mode's
step goes, as the run driver's stage clock would: generation and env step, timed where they ran
(``RolloutStep``).

What the pipeline bench (``bench/pipeline_bench.py``) measures with whole runs, recorder,
corrector and trainer included, this measures without them: the hops between services alone.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MODES = ("embedded", "two round trips", "policy service's loop", "envs in the policy service")
LOOPS = MODES[2:]  # the modes that run POST /rollout


def _serve(cmd: list[str], url: str, env: dict[str, str]) -> subprocess.Popen:
    from services.controller.stack import _wait_healthy

    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *cmd],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_healthy(f"{cmd[0]} service", url, proc, timeout_s=300)
    except BaseException:
        proc.kill()
        raise
    return proc


@click.command()
@click.option("--envs", default=8, show_default=True)
@click.option("--steps", default=8, show_default=True, help="rollout steps a round and mode")
@click.option("--rounds", default=10, show_default=True)
@click.option("--new-tokens", default=40, show_default=True)
def main(envs: int, steps: int, rounds: int, new_tokens: int) -> None:
    from services.env import EnvPool
    from services.env.client import EnvClient
    from services.policy.client import PolicyClient
    from services.policy.rollout import RolloutStep, rollout_step
    from services.policy.service import Policy
    from services.policy.tiny import build_tiny
    from tests.conftest import free_port
    from tests.services.policy.conftest import sample_corpus

    out = Path(tempfile.mkdtemp(prefix="gtr-rollout-bench-"))
    model = build_tiny(out, "llava", "1m", corpus=sample_corpus())
    env_url, policy_url, hosted_url = (f"http://127.0.0.1:{free_port()}" for _ in range(3))
    child_env = {
        **os.environ,
        "GTR_TORCH_THREADS": os.environ.get("GTR_TORCH_THREADS", "1"),
        "GTR_ENV_SERVICE_URL": env_url,
    }
    procs = [
        _serve(["env", "serve", "--port", env_url.rsplit(":", 1)[1]], env_url, child_env),
        _serve(
            ["policy", "serve", "--model", str(model), "--port", policy_url.rsplit(":", 1)[1]],
            policy_url,
            child_env,
        ),
        _serve(
            ["policy", "serve", "--host-envs", "--model", str(model)]
            + ["--port", hosted_url.rsplit(":", 1)[1]],
            hosted_url,
            child_env,
        ),
    ]
    try:
        local, pool = Policy.load(model), EnvPool()
        remote_envs, remote = EnvClient(env_url), PolicyClient(policy_url)
        hosted_envs, hosted = EnvClient(f"{hosted_url}/env"), PolicyClient(hosted_url)
        # Each mode's policy and envs; the last two run the policy service's loop.
        envs_of = dict(zip(MODES, (pool, remote_envs, remote_envs, hosted_envs), strict=True))
        policy_of = dict(zip(MODES, (local, remote, remote, hosted), strict=True))
        params: dict[str, Any] = {"max_new_tokens": new_tokens}
        # Each mode keeps its own sessions (an episode goes on from round to round).
        state: dict[str, list[Any]] = {}
        for mode in MODES:
            where = envs_of[mode]
            sids = [where.create("numberline", {"image_size": 64}, seed=i) for i in range(envs)]
            state[mode] = [sids, [where.reset(s) for s in sids]]
        ms: dict[str, list[float]] = {m: [] for m in MODES}
        parts: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
        for r in range(rounds):
            for mode in MODES[r % len(MODES) :] + MODES[: r % len(MODES)]:
                sids, obs = state[mode]
                images, prompts = [o.image for o in obs], [o.prompt for o in obs]
                time.sleep(0.3)
                t0 = time.perf_counter()
                done: list[RolloutStep] = []
                policy, stepped = policy_of[mode], envs_of[mode]
                if mode in LOOPS:
                    done = list(policy.rollout(sids, images, prompts, steps, params))
                else:
                    for _ in range(steps):
                        done.append(rollout_step(policy, stepped, sids, images, prompts, params))
                        images = [x.observation.image for x in done[-1].results]
                        prompts = [x.observation.prompt for x in done[-1].results]
                ms[mode].append(1000 * (time.perf_counter() - t0) / steps)
                state[mode][1] = [x.observation for x in done[-1].results]
                parts[mode] += [(s.generate_s * 1000, s.env_s * 1000) for s in done]
            print(f"round {r + 1}: " + ", ".join(f"{m} {ms[m][-1]:.1f}" for m in MODES), flush=True)
        report(ms, parts, envs, steps)
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)


def report(
    ms: dict[str, list[float]], parts: dict[str, list[tuple[float, float]]], envs: int, steps: int
) -> None:
    print(f"\n{envs} envs, {steps} steps a rollout; ms per rollout step\n")
    print("| mode | rounds | median | generate | env | embedded ÷ mode (median of rounds) |")
    print("|---|---|---:|---:|---:|---:|")
    for m in MODES:
        ratio = statistics.median(e / x for e, x in zip(ms["embedded"], ms[m], strict=True))
        gen = statistics.median(g for g, _ in parts[m])
        env = statistics.median(e for _, e in parts[m])
        rounds = ", ".join(f"{x:.0f}" for x in ms[m])
        median = statistics.median(ms[m])
        print(f"| {m} | {rounds} | {median:.1f} | {gen:.1f} | {env:.1f} | {ratio:.3f} |")
    print(
        "\n(generate: timed where it ran; through two round trips it includes the request to the"
        " policy service, in the policy service's loop it does not)"
    )


if __name__ == "__main__":
    main()
