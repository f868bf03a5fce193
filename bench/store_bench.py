"""Store ingest: steps written per second through the controller's recorder, SQLite and PostgreSQL.

    GTR_TORCH_THREADS=1 .venv/bin/python bench/store_bench.py [--envs 32] [--steps 64] [--repeat 3]

A rollout of NumberLine is played first (``--envs`` envs x ``--steps`` rollout steps, expert
outputs with junk every fourth step, 64 px frames), kept in memory, then written again and again
into fresh runs, so only the store is timed. Two recorder paths:

- ``per step``: what the controller did before: per env an ORM ``add`` flushed for its id, an
  episode ``UPDATE`` (or close + open), then the run's counter and a commit per rollout step.
- ``batched``: ``services.controller.writer.record_step_batch``, one multi-row ``INSERT ...
  RETURNING`` for the steps and a few statements per rollout step, one commit.

Every step row references its frame (``image_sha``; the 36 NumberLine frames are stored once as
blobs). Corrections: the oracle's (no network), one row per well-formed step, timed on the steps
just written; the last column counts steps per second with those corrections included. After the
per-step recorder they are written as before, one transaction per step
(``services.corrector.service.record_correction``); after the batched one, one transaction per
rollout step (``record_corrections``, what one ``corrector.correct_batch`` task does). Rounds
interleave the settings; the median is reported with the load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PG_NAME = "gtr_bench_store"


def play(envs: int, steps: int) -> list[list[tuple[Any, Any, str]]]:
    """``steps`` rollout steps of ``envs`` NumberLine envs: (observation, result, output)."""
    from services.env import EnvPool
    from services.env.expert import expert_output, format_output

    pool = EnvPool()
    ids = [pool.create("numberline", {"image_size": 64}, seed=e) for e in range(envs)]
    obs = [pool.reset(i) for i in ids]
    out = []
    for t in range(steps):
        texts = [
            "junk" if (t + e) % 4 == 3 else format_output(expert_output("numberline", o.state))
            for e, o in enumerate(obs)
        ]
        results = pool.step_batch(list(zip(ids, texts, strict=True)))
        out.append(list(zip(obs, results, texts, strict=True)))
        obs = [r.observation for r in results]
    return out


def columns(t: int, e: int, envs: int, obs: Any, r: Any, text: str) -> dict[str, Any]:
    return {
        "update_idx": 0,
        "rollout_pos": t * envs + e,
        "prompt": obs.prompt,
        "output": text,
        "thought": r.parsed.thought,
        "action_text": r.parsed.action_text,
        "parsed_action": r.action,
        "format_valid": bool(r.parsed.format_valid),
        "action_valid": bool(r.parsed.action_valid),
        "reward": float(r.reward),
        "done": bool(r.done),
        "value": 0.0,
        "logprob": -1.0,
        "thought_entropy": 0.5,
        "state": obs.state,
    }


def new_run(url: str, envs: int) -> tuple[int, list[Any]]:
    from services.api.service import create_run
    from services.controller.recorder import open_episode
    from shared.db.session import session_scope
    from shared.schemas import RunConfig

    with session_scope(url) as s:
        run = create_run(s, RunConfig(task="numberline"), "store-bench")
        return run.id, [open_episode(s, run.id, e, 0, 0) for e in range(envs)]


def per_step(url: str, rollout: list, envs: int) -> list[int]:
    """The recorder as the controller used it before the batched path (one flush per row)."""
    from sqlalchemy import update

    from services.controller.recorder import add_step, close_episode, open_episode, touch_episode
    from shared.db.models import Run, utcnow
    from shared.db.session import session_scope
    from shared.storage import blob_store

    blobs = blob_store()
    run_id, cursors = new_run(url, envs)
    ids = []
    for t, step in enumerate(rollout):
        with session_scope(url) as s:
            for e, (obs, r, text) in enumerate(step):
                cur = cursors[e]
                row = add_step(
                    s, blobs, image=obs.image, run_id=run_id, episode_id=cur.episode_id,
                    idx=cur.length, **columns(t, e, envs, obs, r, text),
                )  # fmt: skip
                s.flush()
                ids.append(row.id)
                cur.length += 1
                cur.total_return += float(r.reward)
                if r.done:
                    close_episode(s, cur, bool(r.success))
                    cursors[e] = open_episode(s, run_id, e, cur.seq + 1, 0)
                else:
                    touch_episode(s, cur)
            s.execute(
                update(Run)
                .where(Run.id == run_id)
                .values(env_steps=Run.env_steps + envs, heartbeat_at=utcnow())
            )
    return ids


def batched(url: str, rollout: list, envs: int) -> list[int]:
    from services.controller.writer import FrameShas, StepRecord, record_step_batch
    from shared.db.session import session_scope
    from shared.storage import blob_store

    frames = FrameShas(blob_store())
    run_id, cursors = new_run(url, envs)
    ids = []
    for t, step in enumerate(rollout):
        records = [
            StepRecord(
                e,
                obs.image,
                columns(t, e, envs, obs, r, text),
                bool(r.done),
                r.success,
                r.final_state,
            )  # fmt: skip
            for e, (obs, r, text) in enumerate(step)
        ]
        with session_scope(url) as s:
            ids += record_step_batch(s, run_id, 0, records, cursors, frames)[0]
    return ids


def correct(url: str, step_ids: list[int], valid: list[bool], envs: int, batch: bool) -> int:
    """The oracle's corrections of the well-formed steps: one transaction per step, or (batch)
    one per rollout step of ``envs`` steps."""
    from services.corrector.oracle import OracleCorrector
    from services.corrector.service import record_correction, record_corrections
    from shared.db.session import session_scope

    oracle = OracleCorrector()
    todo = [sid for sid, ok in zip(step_ids, valid, strict=True) if ok]
    if batch:
        for t in range(0, len(step_ids), envs):
            pairs = zip(step_ids[t : t + envs], valid[t : t + envs], strict=True)
            chunk = [sid for sid, ok in pairs if ok]
            with session_scope(url) as s:
                record_corrections(s, chunk, "oracle", oracle)
        return len(todo)
    for sid in todo:
        with session_scope(url) as s:
            record_correction(s, sid, "oracle", oracle)
    return len(todo)


def fresh_pg() -> str:
    import psycopg

    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as c:
        c.execute(f'DROP DATABASE IF EXISTS "{PG_NAME}" WITH (FORCE)')
        c.execute(f'CREATE DATABASE "{PG_NAME}"')
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{PG_NAME}"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--envs", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64, help="rollout steps per round")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-pg", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gtr-store-bench-"))
    os.environ["GTR_DATA_DIR"] = str(tmp)
    from shared.db.migrate import upgrade

    urls = {"SQLite": f"sqlite:///{tmp / 'gtr.sqlite3'}"}
    if not args.skip_pg:
        urls["PostgreSQL"] = fresh_pg()
    for url in urls.values():
        upgrade(url)
    rollout = play(args.envs, args.steps)
    valid = [bool(r.parsed.format_valid) for step in rollout for _, r, _ in step]
    n = args.envs * args.steps
    rates: dict[tuple[str, str], list[float]] = {}
    with_corr: dict[tuple[str, str], list[float]] = {}
    loads: dict[tuple[str, str], list[float]] = {}
    paths = {"per step": per_step, "batched": batched}
    for r in range(args.repeat):
        for db, url in urls.items():
            order = list(paths) if r % 2 == 0 else list(paths)[::-1]
            for name in order:
                t0 = time.perf_counter()
                ids = paths[name](url, rollout, args.envs)
                dt = time.perf_counter() - t0
                assert len(ids) == n
                t1 = time.perf_counter()
                corrected = correct(url, ids, valid, args.envs, batch=name == "batched")
                dc = time.perf_counter() - t1
                rates.setdefault((db, name), []).append(n / dt)
                loads.setdefault((db, name), []).append(os.getloadavg()[0])
                with_corr.setdefault((db, name), []).append(n / (dt + dc))
                with_corr.setdefault((db, f"{name} corrections/s"), []).append(corrected / dc)
                print(f"round {r} {db} {name}: {n / dt:.0f} steps/s", flush=True)
    print(f"\n{args.envs} envs x {args.steps} rollout steps = {n} steps per round, "
          f"{sum(valid)} well-formed (corrected), median of {args.repeat} rounds")  # fmt: skip
    print("| store | recorder | steps/s (rounds) | load avg | median steps/s | with corrections |")
    print("|---|---|---|---|---:|---:|")
    for (db, name), v in rates.items():
        if "/" in name:
            continue
        rounds = ", ".join(f"{x:.0f}" for x in v)
        load = ", ".join(f"{x:.1f}" for x in loads[(db, name)])
        wc = with_corr.get((db, name))
        wcs = f"{statistics.median(wc):.0f}" if wc else "-"
        print(f"| {db} | {name} | {rounds} | {load} | {statistics.median(v):.0f} | {wcs} |")
    for db in urls:
        for name, how in (("per step", "record_correction"), ("batched", "record_corrections")):
            c = with_corr[(db, f"{name} corrections/s")]
            print(f"{db}: {how} (oracle), median {statistics.median(c):.0f} rows/s")


if __name__ == "__main__":
    main()
