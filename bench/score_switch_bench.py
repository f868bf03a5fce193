"""CPU seconds of one trainer-shaped score pass (forward + backward) with the last decoder layer
run at every position (HF) and at the read positions only (services/policy/last_layer.py),
alternated in one process (docs/benchmarks.md, issue 41).

    GTR_TORCH_THREADS=1 .venv/bin/python bench/score_switch_bench.py [--rounds 5]

The study's shape: the 1M tiny LLaVA at 96 px, full fine-tuning, a minibatch of 32 EZPoints
observations (its prompts and images, the expert's JSON as the responses), a loss reading the
log-probs, entropies and values. CPU time of this thread (``time.thread_time``), so other load on
the host moves it less than wall time.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import click


@click.command()
@click.option("--rounds", default=5, show_default=True)
@click.option("--batch", default=32, show_default=True)
@click.option("--value-head", default="linear", show_default=True)
def main(rounds: int, batch: int, value_head: str) -> None:
    from services.env.expert import expert_output
    from services.env.registry import make_env
    from services.policy import last_layer
    from services.policy.service import Policy
    from services.policy.tiny import build_tiny

    last_layer.ENABLED = True  # the bench measures it on and off, whatever the default
    path = build_tiny(tempfile.mkdtemp(), "llava", "1m", image_size=96)
    policy = Policy.load(path, finetune="full", value_head=value_head)
    held = policy.response_last_layer
    env = make_env("ezpoints")
    images, prompts, responses = [], [], []
    for seed in range(batch):
        obs, _ = env.reset(seed=seed)
        images.append(obs)
        prompts.append(env.unwrapped.prompt())  # type: ignore[attr-defined]
        responses.append(
            policy.encode_response(json.dumps(expert_output("ezpoints", env.unwrapped.state())))
        )  # type: ignore[attr-defined]
    n_prompt = policy._inputs(images, prompts)["input_ids"].shape[1]
    n_resp = max(len(r) for r in responses)

    def cpu_seconds(on: bool) -> float:
        policy.response_last_layer = held if on else None
        policy.model.zero_grad(set_to_none=True)
        t0 = time.thread_time()
        out = policy.score(images, prompts, responses, with_grad=True)
        ((out.logprobs * out.mask).sum() + out.entropy.sum() + out.values.sum()).backward()
        return time.thread_time() - t0

    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for on in (r % 2 == 1, r % 2 == 0):  # which goes first alternates by round
            cpu_seconds(on)  # warm-up in this mode
            times[on].append(cpu_seconds(on))
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(
        f"tiny llava 1m, 96 px, full FT, value head {value_head}, batch {batch}: {n_prompt} "
        f"prompt + {n_resp} response positions; {os.environ.get('GTR_TORCH_THREADS', 'default')}"
        f" torch threads, {rounds} rounds; load average (1 min) at the end: "
        f"{os.getloadavg()[0]:.1f}"
    )
    print("| last layer | CPU s per score pass, fwd + bwd (rounds) | median |")
    print("|---|---|---:|")
    for label, key in (("every position (HF)", False), ("read positions only", True)):
        xs = ", ".join(f"{x:.3f}" for x in times[key])
        print(f"| {label} | {xs} | {statistics.median(times[key]):.3f} |")
    print(f"read-only / every position: **{on / off:.3f}**")


if __name__ == "__main__":
    main()
