"""Generated tokens/s of the tiny policies on a device, at the dtype a run loads there.

    python3 bench/gpu_bench.py [--device cuda] [--sizes 1m,10m,50m] [--batches 1,16,64]

For each preset size a random-weight LLaVA (64 px) is built on the spot and loaded as a run loads
it (LoRA, ``dtype = "auto"``: bf16 on a GPU, fp32 on a CPU); each batch size is timed ``--repeats``
times after a warm-up, sampling up to ``--new-tokens`` tokens per row, and the median is kept.
Tokens are the ones generated (a row may stop early at its end token). Prints a markdown table
and writes JSON with ``--json``. A study cell's updates/s come from ``bench/run_profile.py`` on
the same machine (its ``wall_s``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.policy.service import Policy  # noqa: E402
from services.policy.tiny import build_tiny  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tokens_per_s(policy: Policy, batch: int, new_tokens: int, repeats: int) -> float:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 255, (64, 64, 3), dtype=np.uint8) for _ in range(batch)]
    prompts = ["What is the next number on the line? Answer with a thought and an action."] * batch
    policy.generate(images, prompts, max_new_tokens=new_tokens, seed=0)  # warm-up
    rates = []
    for r in range(repeats):
        sync(policy.device)
        t0 = time.perf_counter()
        out = policy.generate(images, prompts, max_new_tokens=new_tokens, seed=r + 1)
        sync(policy.device)
        rates.append(sum(len(g.token_ids) for g in out) / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    ap.add_argument("--sizes", default="1m,10m,50m")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes.split(","):
            path = build_tiny(Path(tmp) / size, "llava", size)  # type: ignore[arg-type]
            policy = Policy.load(path, finetune="lora", device=args.device)
            for b in (int(x) for x in args.batches.split(",")):
                rate = tokens_per_s(policy, b, args.new_tokens, args.repeats)
                rows.append({"size": size, "batch": b, "tokens_per_s": round(rate, 1)})
                print(f"{size} batch {b}: {rate:.0f} tokens/s", flush=True)
            dev, dtype = str(policy.device), str(policy.dtype).removeprefix("torch.")
            del policy
    name = torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu"
    print(f"\n{name}, torch {torch.__version__}, {dtype}\n")
    print("| size | batch | tokens/s |\n|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['batch']} | {r['tokens_per_s']:.0f} |")
    if args.json:
        meta = {"device": name, "torch": torch.__version__, "dtype": dtype}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
