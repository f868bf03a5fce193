"""Points24's ceiling at a preset: supervised training on many expert states, with its curve.

The warm start of ``configs/repro/points24-warm.toml`` (800 vision steps, 6,000 oracle states,
2,000 SFT steps) is deliberately short. This bench asks how far the same product code goes with
plenty of data: the vision warm-up, then the warm start's SFT (``services/trainer/warmstart.py``:
``oracle_samples``, ``vision_warmup``, ``sft_warmup``, one optimizer throughout) on ``--samples``
expert states, and every ``--every`` SFT steps the greedy success on the task's evaluation deals
(``greedy_eval``) under the study's evaluation protocol (``shared/evalrules.py`` over
``--protocol``, the reproduction's Points24 config). ``gtr sft`` evaluates only at the end, so
the curve comes from the warm start's progress hook (``shared/phase.py``), which the SFT loop
calls every 10 steps; evaluating there changes no optimizer or sampler state.

``--baseline DIR`` first evaluates a kept warm start (a policy checkpoint) under the same
protocol, for comparison. One JSON line per point on stdout, the summary last; CPU seconds
(this process) beside wall seconds.

    GTR_TORCH_THREADS=1 nice -n 10 .venv/bin/python bench/points24_ceiling.py \
        --samples 20000 --steps 4000 --every 500 --baseline docs/results/warm/points24
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _clock(t0: tuple[float, float]) -> dict[str, float]:
    return {
        "wall_s": round(time.monotonic() - t0[0], 1),
        "cpu_s": round(time.process_time() - t0[1], 1),
    }


def _emit(row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/repro/points24-warm.toml"))
    ap.add_argument("--protocol", default=str(ROOT / "configs/repro/points24.toml"))
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--vision-steps", type=int, default=800)
    ap.add_argument("--steps", type=int, default=4000, help="SFT steps")
    ap.add_argument("--every", type=int, default=500, help="evaluate every N SFT steps")
    ap.add_argument("--eval-episodes", type=int, default=128)
    ap.add_argument("--lr", type=float, default=None, help="default: the config's init.lr")
    ap.add_argument("--tiny-size", default=None, help="model.tiny_size (default: the config's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", default=None, help="a kept warm start to evaluate first")
    args = ap.parse_args()
    if args.every % 10:
        ap.error("--every must be a multiple of 10 (the SFT loop reports every 10 steps)")

    from services.policy.service import Policy
    from services.trainer.warmstart import (
        base_model_path,
        greedy_eval,
        oracle_samples,
        sft_warmup,
        vision_warmup,
    )
    from shared.evalrules import eval_rules
    from shared.phase import warm_progress
    from shared.schemas import RunConfig
    from shared.warmenv import warm_env

    cfg = RunConfig.from_toml(args.config)
    if args.tiny_size:
        cfg = cfg.model_copy(
            update={"model": cfg.model.model_copy(update={"tiny_size": args.tiny_size})}
        )
    rules = eval_rules(RunConfig.from_toml(args.protocol))
    t0 = (time.monotonic(), time.process_time())
    _emit(
        {
            "bench": "points24_ceiling",
            "preset": cfg.model.tiny_size,
            "samples": args.samples,
            "vision_steps": args.vision_steps,
            "steps": args.steps,
            "lr": args.lr or cfg.init.lr,
            "eval_episodes": args.eval_episodes,
            "protocol": rules.model_dump(mode="json"),
            "threads": os.environ.get("GTR_TORCH_THREADS"),
        }
    )

    def evaluate(policy: Any) -> dict[str, float]:
        return greedy_eval(
            policy, cfg.task, rules.env, args.eval_episodes, args.seed, rules.max_new_tokens
        )

    base = base_model_path(cfg.model, cfg.task)
    if args.baseline:
        # A kept policy checkpoint (its policy.json names the base by its folder name only).
        warm = Policy.from_config(cfg.model, base, seed=args.seed)
        warm.load_weights(Path(args.baseline))
        _emit({"baseline": args.baseline, **evaluate(warm), **_clock(t0)})
        del warm

    policy = Policy.from_config(cfg.model, base, seed=args.seed)
    samples = oracle_samples(cfg.task, warm_env(cfg.env), args.samples, args.seed)
    _emit({"stage": "samples", "n": len(samples), **_clock(t0)})
    vision = vision_warmup(policy, samples, cfg.task, args.vision_steps, args.seed)
    _emit({"stage": "vision", **vision, **_clock(t0)})

    curve: list[dict[str, float]] = []

    def hook(step: int, _planned: int) -> None:
        if step % args.every == 0:
            point = {"step": float(step), **evaluate(policy), **_clock(t0)}
            curve.append(point)
            _emit(point)

    token = warm_progress.set(hook)
    try:
        lr = args.lr or cfg.init.lr
        sft = sft_warmup(policy, samples, args.steps, cfg.init.batch_size, lr, args.seed)
    finally:
        warm_progress.reset(token)
    best = max(curve, key=lambda p: p["eval/success"]) if curve else {}
    _emit({"summary": True, **sft, "best": best, "curve": curve, **_clock(t0)})


if __name__ == "__main__":
    main()
