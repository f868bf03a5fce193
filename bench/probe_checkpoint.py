"""A checkpoint's greedy probe, as a run's collapse monitor decodes it: the format-valid and
action-valid shares and the relevance over the run's fixed probe states (docs/benchmarks.md,
issue 59: the warm start's figures, which a run records only from update 0 on).

    .venv/bin/python bench/probe_checkpoint.py CONFIG CHECKPOINT_DIR
    # e.g. configs/ezpoints-smol.toml gtr-data/checkpoints/run-1/init (the run's warm start)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", type=Path)
    ap.add_argument("checkpoint", type=Path)
    args = ap.parse_args()
    from services.controller.console import load_config
    from services.controller.monitor import CollapseMonitor
    from services.env.service import EnvPool
    from services.policy.service import policy_for_checkpoint

    cfg = load_config(args.config)
    policy = policy_for_checkpoint(None, args.checkpoint)
    monitor = CollapseMonitor(0, EnvPool(), policy, cfg)
    states = monitor.states()
    began = time.monotonic()
    figures = monitor.probe(states)
    print(f"{args.checkpoint}: {len(states)} probe states, {time.monotonic() - began:.0f} s")
    for key in ("probe_format_valid_rate", "probe_relevance", "probe_top_thought_share"):
        print(f"  {key} {figures[key]:.2f}")


if __name__ == "__main__":
    main()
