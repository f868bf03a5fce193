"""What a display frame (the picture people see on a recorded step) costs per env step.

    python bench/display_bench.py [--steps 300] [--size 384]

Steps each card task's env through the env pool with and without ``display_size``, the same
seeded actions, and prints ms per step (the frame is drawn and PNG-encoded in the pool), the PNG
size and the share of frames that are new blobs (identical frames are stored once).
"""

from __future__ import annotations

import argparse
import hashlib
import time

from services.env.service import EnvPool

ACTION = {"numberline": "+", "ezpoints": "+", "points24": "+", "blackjack": "stand"}


def run(task: str, display: int, steps: int) -> tuple[float, float, float]:
    pool = EnvPool()
    sid = pool.create(task, {"image_size": 64, "display_size": display}, seed=0)
    pool.reset(sid)
    sizes, shas = [], set()
    started = time.perf_counter()
    for _ in range(steps):
        obs = pool.step(sid, f'{{"action": "{ACTION[task]}"}}').observation
        if obs.display_png:
            sizes.append(len(obs.display_png))
            shas.add(hashlib.sha256(obs.display_png).hexdigest())
    ms = (time.perf_counter() - started) / steps * 1000
    kb = sum(sizes) / len(sizes) / 1024 if sizes else 0.0
    return ms, kb, len(shas) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--size", type=int, default=384)
    args = ap.parse_args()
    print("| task | ms/step, no frame | ms/step, frame | frame PNG KB | new blobs / step |")
    print("|---|---|---|---|---|")
    for task in ACTION:
        base, _, _ = run(task, 0, args.steps)
        ms, kb, new = run(task, args.size, args.steps)
        print(f"| {task} | {base:.2f} | {ms:.2f} | {kb:.1f} | {new:.2f} |")


if __name__ == "__main__":
    main()
