"""What a display frame (the picture people see on a recorded step) costs, and where.

    python bench/display_bench.py [--steps 300] [--size 320] [--views 50]

Steps each card task's env through the env pool, the same seeded actions, three ways: with no
frame for people; drawing and PNG-encoding one at every step (``display_size`` given to the pool,
as every recorded step did before frames were drawn on demand); and as a run's pool is set up
now (``record_time_size``: none for frames the stored state can redraw). Prints ms per env step
for each. Then the step page's side: ms to draw a step's frame from its stored (JSON) state and
store it as a blob at its first view, and to read it back at the next, over ``--views`` distinct
recorded states, with the PNG cache cleared before each first view.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from services.env import render
from services.env.display import draw_state, record_time_size
from services.env.service import EnvPool
from shared.storage import LocalBlobStore

ACTION = {"numberline": "+", "ezpoints": "+", "points24": "+", "blackjack": "stand"}


def rollout(task: str, display: int, steps: int) -> tuple[float, list[dict[str, Any]]]:
    """ms per env step, and the states the steps saw (as a step row stores them)."""
    pool = EnvPool()
    sid = pool.create(task, {"image_size": 64, "display_size": display}, seed=0)
    obs = pool.reset(sid)
    states = []
    started = time.perf_counter()
    for _ in range(steps):
        states.append(obs.state)
        obs = pool.step(sid, f'{{"action": "{ACTION[task]}"}}').observation
    ms = (time.perf_counter() - started) / steps * 1000
    return ms, states


def views(task: str, states: list[dict[str, Any]], size: int, n: int) -> tuple[float, float]:
    """ms for a step's first view (draw from state, encode, store) and its next (read)."""
    distinct = list({json.dumps(s, sort_keys=True): s for s in states}.values())[:n]
    env = {"image_size": 64}
    first = second = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        blobs = LocalBlobStore(Path(tmp))
        for state in distinct:
            stored = json.loads(json.dumps(state))
            render._PNGS.clear()
            t0 = time.perf_counter()
            frame = draw_state(task, env, stored, size)
            assert frame is not None
            sha = blobs.put(render.display_png(frame))
            t1 = time.perf_counter()
            blobs.get(sha)
            first, second = first + t1 - t0, second + time.perf_counter() - t1
    return first / len(distinct) * 1000, second / len(distinct) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--size", type=int, default=320)
    ap.add_argument("--views", type=int, default=50)
    args = ap.parse_args()
    print(
        "| task | ms/step, no frame | ms/step, frame every step (before) | ms/step, as a run "
        "records now | first view ms | next view ms |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for task in ACTION:
        run_size = record_time_size(task, {"image_size": 64, "display_size": args.size})
        base, states = rollout(task, 0, args.steps)
        eager, _ = rollout(task, args.size, args.steps)
        now, _ = rollout(task, run_size, args.steps)
        first, second = views(task, states, args.size, args.views)
        print(f"| {task} | {base:.2f} | {eager:.2f} | {now:.2f} | {first:.2f} | {second:.2f} |")


if __name__ == "__main__":
    main()
