"""A finished embedded run's figures, read from its data folder: per update the wall seconds,
sampling tokens/s, format-valid shares and greedy success (docs/benchmarks.md, issue 59).

    .venv/bin/python bench/run_figures.py DATA_DIR [--run ID]     # DATA_DIR: GTR_DATA_DIR

Tokens/s is the sampled tokens of the update's rollout (each output re-tokenized with the run's
own tokenizer, plus the EOS it ended on, capped at ``max_new_tokens``) over its
``time/generate_s``. "after the warm start" is update 0's rollout (sampled by the warm-started
policy) and ``eval_start/`` (its greedy deals); update u's greedy probe and ``eval/`` follow it.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEYS = [
    ("warm_start/seconds", "warm start s"),
    ("update_s", "s/update"),
    ("time/generate_s", "generate s"),
    ("train_s", "train s"),
    ("eval_s", "eval s"),
    ("format_valid_rate", "format-valid sampled"),
    ("probe_format_valid_rate", "format-valid greedy probe"),
    ("probe_relevance", "probe relevance"),
    ("eval_start/success_rate", "greedy success at start"),
    ("eval/success_rate", "greedy success"),
    ("success_rate", "sampled success"),
]


def tokenizer_of(cfg: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    from services.trainer.warmstart import base_model_path
    from shared.schemas import ModelConfig

    return AutoTokenizer.from_pretrained(base_model_path(ModelConfig(**cfg["model"]), cfg["task"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("data_dir", type=Path)
    ap.add_argument("--run", type=int, default=None, help="run id (default: the last)")
    args = ap.parse_args()
    db = sqlite3.connect(f"file:{args.data_dir / 'gtr.sqlite3'}?mode=ro", uri=True)
    q = "select id, name, status, config, created_at, started_at, finished_at from runs"
    rows = db.execute(q + (" where id = ?" if args.run else " order by id desc limit 1"),
                      (args.run,) if args.run else ()).fetchall()  # fmt: skip
    if not rows:
        sys.exit(f"no run in {args.data_dir}")
    run_id, name, status, config, created, started, finished = rows[0]
    cfg = json.loads(config)
    print(f"run {run_id} {name}: {status}; created {created}, finished {finished}")
    tok = tokenizer_of(cfg)
    cap = int(cfg["generation"]["max_new_tokens"])
    eos = tok.eos_token_id
    for idx, metrics in db.execute(
        "select idx, metrics from updates where run_id = ? order by idx", (run_id,)
    ):
        m = json.loads(metrics or "{}")
        steps = "select output from steps where run_id = ? and update_idx = ?"
        outputs = [r[0] for r in db.execute(steps, (run_id, idx))]
        tokens = sum(
            min(len(tok.encode(o, add_special_tokens=False)) + (eos is not None), cap)
            for o in outputs
        )
        gen_s = m.get("time/generate_s")
        line = [f"update {idx}:", f"{len(outputs)} steps", f"{tokens} sampled tokens"]
        if gen_s:
            line.append(f"tokens/s {tokens / gen_s:.1f}")
        for key, label in KEYS:
            if key in m and m[key] is not None:
                seconds = key.endswith(("_s", "seconds"))
                line.append(f"{label} {float(m[key]):.{0 if seconds else 2}f}")
        print("  ".join(line))


if __name__ == "__main__":
    main()
