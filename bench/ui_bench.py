"""Step-page and step-search latency with a million steps in PostgreSQL (issue 8: a step page
within 200 ms; issue 17: a step search page within 100 ms at p95).

Creates its own database, bulk-loads one run of N steps with COPY (episodes of 10 steps, a third
of the steps corrected, one thought in 1,000 holding the word "misread"), serves the app with
uvicorn on a free port, and times the step page's JSON (`GET /api/steps/{id}`) and HTML
(`GET /runs/{run}/steps/{id}`) on random steps, the trace browser's episode list, the step search
(verdict, update, full text, REST) and a step whose thought has 25,000 characters. Prints a
markdown table for docs/benchmarks.md.

    .venv/bin/python bench/ui_bench.py --steps 1000000
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import socket
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

PG_ADMIN = os.environ.get("GTR_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
DB_NAME = "gtr_bench_ui"
EP_LEN = 10
ENVS = 16
ROLLOUT = ENVS * 128
PROMPT = (
    "You are playing NumberLine. The image shows a target number and the current number. "
    'Move the current number toward the target by one with "+" or "-". Answer in JSON with '
    'the keys "current number", "target number", "thoughts" and "action".'
)


def fresh_database() -> str:
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{DB_NAME}"')
    return (
        PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + f"/{DB_NAME}"
    )


def drop_database() -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DB_NAME}" WITH (FORCE)')


def images() -> list[str]:
    """The 30 NumberLine frames, rendered and stored once as blobs."""
    from PIL import Image, ImageDraw

    from shared.storage import blob_store

    shas = []
    for target in range(6):
        for current in range(5):
            img = Image.new("RGB", (300, 300), "white")
            draw = ImageDraw.Draw(img)
            draw.text((30, 60), f"Target: {target}", fill="black")
            draw.text((30, 180), f"Current: {current}", fill="black")
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            shas.append(blob_store().put(buf.getvalue()))
    return shas


def _thought(current: int, target: int) -> str:
    return (
        f'{{"current number": {current}, "target number": {target}, "thoughts": "The current '
        f'number is {current} and the target is {target}, so I should increase it."}}'
    )


def step_rows(run_id: int, n_steps: int, shas: list[str], now: datetime) -> Iterator[tuple]:
    rng = random.Random(0)
    for sid in range(1, n_steps + 1):
        ep, idx = (sid - 1) // EP_LEN + 1, (sid - 1) % EP_LEN
        upd = (sid - 1) // ROLLOUT
        cur, tgt = rng.randint(0, 4), rng.randint(0, 5)
        thought = _thought(cur, tgt)
        if sid % 1000 == 7:  # a rare word for the full-text search
            thought = thought.replace("so I should", "I misread it, so I should")
        yield (
            sid,
            run_id,
            ep,
            idx,
            upd,
            (sid - 1) % ROLLOUT,
            PROMPT,
            thought[:-1] + ', "action": "+"}',
            thought,
            "+",
            "+",
            True,
            True,
            rng.choice((-1.0, 0.0, 1.0)),
            idx == EP_LEN - 1,
            rng.uniform(-1, 1),
            -rng.random(),
            rng.random(),
            shas[rng.randrange(len(shas))],
            json.dumps({"Target": tgt, "Current": cur}),
            now,
        )


def episode_rows(run_id: int, n_steps: int, now: datetime) -> Iterator[tuple]:
    for ep in range(1, n_steps // EP_LEN + 1):
        first = (ep - 1) * EP_LEN
        yield (
            ep,
            run_id,
            (ep - 1) % ENVS,
            (ep - 1) // ENVS,
            first // ROLLOUT,
            ep,
            EP_LEN,
            1.0 if ep % 3 else -2.0,
            ep % 3 != 0,
            True,
            3 if ep % 2 else 0,
            "{}",
        )


def correction_rows(run_id: int, n_steps: int, now: datetime) -> Iterator[tuple]:
    for sid in range(1, n_steps + 1, 3):
        incorrect = sid % 2 == 0
        yield (
            sid,
            sid,
            run_id,
            (sid - 1) // ROLLOUT,
            "oracle",
            "done",
            "incorrect" if incorrect else "correct",
            _thought(1, 4) if incorrect else None,
            "{}",
            "The image shows another target.",
            2.0,
            120,
            1,
            now,
        )


STEP_COLS = (
    "id, run_id, episode_id, idx, update_idx, rollout_pos, prompt, output, thought, "
    "action_text, parsed_action, format_valid, action_valid, reward, done, value, logprob, "
    "thought_entropy, image_sha, state, created_at"
)
EPISODE_COLS = (
    "id, run_id, env_index, seq, update_idx, seed, length, total_return, success, "
    "finished, corrected_steps, meta"
)
CORRECTION_COLS = (
    "id, step_id, run_id, update_idx, corrector, status, verdict, corrected_thought, "
    "extras, reasoning, latency_ms, tokens, attempts, created_at"
)


def load(url: str, n_steps: int) -> tuple[int, str]:
    """Bulk-load one run with COPY; returns the run id and a read token."""
    import psycopg
    from sqlalchemy import text

    from services.api.auth import create_token
    from shared.db.models import Run
    from shared.db.session import session_scope

    with session_scope(url) as s:
        run = Run(
            name="bench-1m",
            task="numberline",
            algorithm="gtr",
            status="completed",
            config={"task": "numberline"},
            total_env_steps=n_steps,
            num_updates=n_steps // ROLLOUT + 1,
            team="default",
        )
        s.add(run)
        s.flush()
        run_id, token = run.id, create_token(s, "bench", "read")[1]
    now, shas = datetime.now(UTC), images()
    with psycopg.connect(url.replace("+psycopg", "")) as conn, conn.cursor() as cur:
        for table, cols, rows in (
            ("episodes", EPISODE_COLS, episode_rows(run_id, n_steps, now)),
            ("steps", STEP_COLS, step_rows(run_id, n_steps, shas, now)),
            ("corrections", CORRECTION_COLS, correction_rows(run_id, n_steps, now)),
        ):
            with cur.copy(f"COPY {table} ({cols}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
            cur.execute(
                f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                f"(SELECT max(id) FROM {table}))"
            )
        conn.commit()
    with session_scope(url) as s:
        s.execute(text("ANALYZE"))
    return run_id, token


def long_step(url: str, run_id: int) -> int:
    """One more step whose thought has 25,000 characters, corrected with 20,000 others."""
    from shared.db.models import Correction, Step
    from shared.db.session import session_scope

    words = "the current number is three and the target is five so I go up".split()
    thought = " ".join(words[i % len(words)] + str(i % 97) for i in range(4000))[:25_000]
    other = " ".join(words[(i * 7) % len(words)] + str(i % 89) for i in range(4000))[:20_000]
    with session_scope(url) as s:
        step = Step(
            run_id=run_id, episode_id=1, idx=EP_LEN, update_idx=0, rollout_pos=0, prompt=PROMPT,
            output=thought, thought=thought, action_text="+", parsed_action="+",
            format_valid=True, action_valid=True, reward=0.0, done=False, state={},
        )  # fmt: skip
        s.add(step)
        s.flush()
        s.add(Correction(step_id=step.id, run_id=run_id, update_idx=0, corrector="long",
                         status="done", verdict="incorrect", corrected_thought=other))  # fmt: skip
        return step.id


def serve() -> str:
    import uvicorn

    from services.api.app import create_app

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning")
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}"


def timed(get: Callable[[str], object], paths: list[str]) -> dict[str, float]:
    for p in paths[:10]:
        get(p)  # warm the connection pool and the caches
    ms = []
    for p in paths:
        t = time.perf_counter()
        get(p)
        ms.append((time.perf_counter() - t) * 1000)
    ms.sort()
    return {
        "n": len(ms),
        "p50": statistics.median(ms),
        "p95": ms[int(0.95 * (len(ms) - 1))],
        "max": ms[-1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1_000_000)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--keep", action="store_true", help=f"keep the {DB_NAME} database afterwards")
    args = ap.parse_args()
    url = fresh_database()
    os.environ.update(
        GTR_DATABASE_URL=url,
        GTR_DATA_DIR=tempfile.mkdtemp(prefix="gtr-bench-"),
        GTR_API_RATE_LIMIT_PER_MINUTE="0",
    )
    import httpx

    from shared.db.migrate import upgrade

    upgrade(url)
    t = time.perf_counter()
    run_id, token = load(url, args.steps)
    print(f"loaded {args.steps:,} steps with COPY in {time.perf_counter() - t:.0f} s")
    long_id = long_step(url, run_id)
    base = serve()
    rng = random.Random(1)
    ids = [rng.randint(1, args.steps) for _ in range(args.samples)]
    eps = [rng.randint(1, args.steps // EP_LEN) for _ in range(args.samples)]
    updates = [rng.randint(0, args.steps // ROLLOUT) for _ in range(args.samples)]
    with httpx.Client(
        base_url=base, headers={"Authorization": f"Bearer {token}"}, cookies={"gtr_token": token}
    ) as c:

        def get(path: str) -> None:
            c.get(path).raise_for_status()

        cases = {
            "GET /api/steps/{id} (JSON)": [f"/api/steps/{i}" for i in ids],
            "GET /runs/{run}/steps/{id} (HTML)": [f"/runs/{run_id}/steps/{i}" for i in ids],
            "GET /api/episodes/{id}/steps": [f"/api/episodes/{e}/steps" for e in eps],
            "GET /runs/{run}/episodes?update=U (HTML)": [
                f"/runs/{run_id}/episodes?update={u}" for u in updates
            ],
            "GET /runs/{run}/episodes?corrected=true&page=P (HTML)": [
                f"/runs/{run_id}/episodes?corrected=true&page={rng.randint(1, 1000)}"
                for _ in updates
            ],
            "GET /runs/{run}/steps/{25k-char thought} (HTML)": [
                f"/runs/{run_id}/steps/{long_id}" for _ in range(args.samples // 4)
            ],
            "GET /runs/{run}/steps?verdict=corrected&page=P (HTML search)": [
                f"/runs/{run_id}/steps?verdict=corrected&page={rng.randint(1, 20)}" for _ in updates
            ],
            "GET /runs/{run}/steps?update=U&verdict=corrected (HTML search)": [
                f"/runs/{run_id}/steps?update={u}&verdict=corrected" for u in updates
            ],
            "GET /runs/{run}/steps?q=misread (HTML full text, 1,000 hits)": [
                f"/runs/{run_id}/steps?q=misread&page={rng.randint(1, 20)}" for _ in updates
            ],
            "GET /runs/{run}/steps?q=increase&update=U (HTML full text, every step)": [
                f"/runs/{run_id}/steps?q=increase&update={u}" for u in updates
            ],
            "GET /runs/{run}/steps?q=increase (HTML full text, 1M hits)": [
                f"/runs/{run_id}/steps?q=increase&page={rng.randint(1, 20)}" for _ in updates
            ],
            "GET /api/runs/{run}/steps?verdict=failed (JSON, no hit)": [
                f"/api/runs/{run_id}/steps?verdict=failed" for _ in updates
            ],
        }
        print(
            f"\n{args.steps:,} steps, {args.steps // EP_LEN:,} episodes, "
            f"{len(range(1, args.steps + 1, 3)):,} corrections; "
            f"{args.samples} random requests each\n"
        )
        print("| request | p50 ms | p95 ms | max ms |\n| --- | ---: | ---: | ---: |")
        for name, paths in cases.items():
            r = timed(get, paths)
            print(f"| {name} | {r['p50']:.1f} | {r['p95']:.1f} | {r['max']:.1f} |")
    if not args.keep:
        drop_database()


if __name__ == "__main__":
    main()
