"""Step-page and step-search latency with a million steps (issue 8: a step page within 200 ms;
issue 17: a step search page within 100 ms at p95), on PostgreSQL or on the embedded SQLite.

Creates its own database, bulk-loads one run of N steps (PostgreSQL: COPY; SQLite: one
transaction of INSERTs, through the FTS5 triggers of migration 0008), with episodes of 10 steps,
a third of the steps corrected and one thought in 1,000 holding the word "misread"; serves the app
with uvicorn on a free port, and times the step page's JSON (`GET /api/steps/{id}`) and HTML
(`GET /runs/{run}/steps/{id}`) on random steps, the trace browser's episode list, the step search
(verdict, update, action and reward filters, full text, REST; deep pages through the `after`
cursor a "later" link carries) and a step whose thought has 25,000 characters. Prints a markdown
table for docs/benchmarks.md.

    .venv/bin/python bench/ui_bench.py --steps 1000000
    .venv/bin/python bench/ui_bench.py --steps 1000000 --store sqlite
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
from pathlib import Path

PG_ADMIN = os.environ.get("GTR_BENCH_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/postgres")
DB_NAME = "gtr_bench_ui"
SQLITE_URL = f"sqlite:///{Path(tempfile.gettempdir()) / 'gtr_bench_ui.sqlite3'}"
EP_LEN = 10
ENVS = 16
ROLLOUT = ENVS * 128
PROMPT = (
    "You are playing NumberLine. The image shows a target number and the current number. "
    'Move the current number toward the target by one with "+" or "-". Answer in JSON with '
    'the keys "current number", "target number", "thoughts" and "action".'
)


def pg_url() -> str:
    return (
        PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://") + f"/{DB_NAME}"
    )


def fresh_database(url: str) -> None:
    drop_database(url)
    if url.startswith("postgresql"):
        import psycopg

        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{DB_NAME}"')


def drop_database(url: str) -> None:
    if url.startswith("sqlite"):
        for suffix in ("", "-wal", "-shm"):
            Path(url.removeprefix("sqlite:///") + suffix).unlink(missing_ok=True)
        return
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


def _create_run(url: str, n_steps: int) -> tuple[int, str]:
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
        return run.id, create_token(s, "bench", "read")[1]


def _tables(run_id: int, n_steps: int, now: datetime) -> list[tuple[str, str, Iterator[tuple]]]:
    return [
        ("episodes", EPISODE_COLS, episode_rows(run_id, n_steps, now)),
        ("steps", STEP_COLS, step_rows(run_id, n_steps, images(), now)),
        ("corrections", CORRECTION_COLS, correction_rows(run_id, n_steps, now)),
    ]


def load(url: str, n_steps: int) -> tuple[int, str]:
    """Bulk-load one run; returns the run id and a read token."""
    from sqlalchemy import text

    from shared.db.session import session_scope

    run_id, token = _create_run(url, n_steps)
    if url.startswith("sqlite"):
        _insert_sqlite(url, _tables(run_id, n_steps, datetime.now(UTC)))
    else:
        _copy_postgres(url, _tables(run_id, n_steps, datetime.now(UTC)))
    if url.startswith("sqlite"):
        with session_scope(url) as s:
            s.execute(text("ANALYZE"))
    else:  # as autovacuum leaves a table that has settled: statistics, GIN pending lists merged
        from sqlalchemy import create_engine

        engine = create_engine(url, isolation_level="AUTOCOMMIT")
        with engine.connect() as conn:
            conn.execute(text("VACUUM ANALYZE"))
        engine.dispose()
    return run_id, token


def _copy_postgres(url: str, tables: list[tuple[str, str, Iterator[tuple]]]) -> None:
    import psycopg

    with psycopg.connect(url.replace("+psycopg", "")) as conn, conn.cursor() as cur:
        for table, cols, rows in tables:
            with cur.copy(f"COPY {table} ({cols}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
            cur.execute(
                f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                f"(SELECT max(id) FROM {table}))"
            )
        conn.commit()


def _insert_sqlite(url: str, tables: list[tuple[str, str, Iterator[tuple]]]) -> None:
    """Plain INSERTs in one transaction: the FTS5 triggers index every thought as it comes."""
    import sqlite3

    def cell(v: object) -> object:  # SQLAlchemy's own text form of a datetime on SQLite
        return v.strftime("%Y-%m-%d %H:%M:%S.%f") if isinstance(v, datetime) else v

    conn = sqlite3.connect(url.removeprefix("sqlite:///"))
    conn.execute("PRAGMA foreign_keys=OFF")  # the rows are consistent by construction
    with conn:
        for table, cols, rows in tables:
            marks = ", ".join("?" * len(cols.split(",")))
            conn.executemany(
                f"INSERT INTO {table} ({cols}) VALUES ({marks})",
                (tuple(cell(v) for v in row) for row in rows),
            )
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


def reuse(url: str) -> tuple[int, str, int]:
    """The run a previous --keep left in the database, a fresh token and its long step."""
    from sqlalchemy import select

    from services.api.auth import create_token
    from shared.db.models import Run, Step
    from shared.db.session import session_scope

    with session_scope(url) as s:
        run_id = s.scalar(select(Run.id).where(Run.name == "bench-1m"))
        if run_id is None:
            raise SystemExit(f"no bench run in {url}: run once with --keep first")
        long_id = s.scalar(select(Step.id).where(Step.run_id == run_id, Step.idx == EP_LEN))
        assert long_id is not None
        return run_id, create_token(s, "bench", "read")[1], long_id


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
    ap.add_argument("--store", choices=("postgresql", "sqlite"), default="postgresql")
    ap.add_argument("--keep", action="store_true", help="keep the bench database afterwards")
    ap.add_argument("--reuse", action="store_true", help="time the database --keep left")
    ap.add_argument("--only", default="", help="time only the requests whose name holds this")
    args = ap.parse_args()
    url = SQLITE_URL if args.store == "sqlite" else pg_url()
    os.environ.update(
        GTR_DATABASE_URL=url,
        GTR_DATA_DIR=tempfile.mkdtemp(prefix="gtr-bench-"),
        GTR_API_RATE_LIMIT_PER_MINUTE="0",
    )
    import httpx

    from shared.db.migrate import upgrade

    if args.reuse:
        run_id, token, long_id = reuse(url)
    else:
        fresh_database(url)
        upgrade(url)
        t = time.perf_counter()
        run_id, token = load(url, args.steps)
        print(f"loaded {args.steps:,} steps into {args.store} in {time.perf_counter() - t:.0f} s")
        long_id = long_step(url, run_id)
    base = serve()
    rng = random.Random(1)
    ids = [rng.randint(1, args.steps) for _ in range(args.samples)]
    eps = [rng.randint(1, args.steps // EP_LEN) for _ in range(args.samples)]
    updates = [rng.randint(0, args.steps // ROLLOUT) for _ in range(args.samples)]
    run = f"/runs/{run_id}"
    with httpx.Client(
        base_url=base, headers={"Authorization": f"Bearer {token}"}, cookies={"gtr_token": token}
    ) as c:

        def get(path: str) -> None:
            c.get(path).raise_for_status()

        # Deep pages: the `after` cursor of a "later" link, anywhere in the run.
        cases = {
            "GET /api/steps/{id} (JSON)": [f"/api/steps/{i}" for i in ids],
            "GET /runs/{run}/steps/{id} (HTML)": [f"{run}/steps/{i}" for i in ids],
            "GET /api/episodes/{id}/steps": [f"/api/episodes/{e}/steps" for e in eps],
            "GET /runs/{run}/episodes?update=U (HTML)": [
                f"{run}/episodes?update={u}" for u in updates
            ],
            "GET /runs/{run}/episodes?corrected=true&page=P (HTML)": [
                f"{run}/episodes?corrected=true&page={rng.randint(1, 1000)}" for _ in updates
            ],
            "GET /runs/{run}/steps/{25k-char thought} (HTML)": [
                f"{run}/steps/{long_id}" for _ in range(args.samples // 4)
            ],
            "GET /runs/{run}/steps?verdict=corrected (HTML search, first page)": [
                f"{run}/steps?verdict=corrected" for _ in updates
            ],
            "GET /runs/{run}/steps?verdict=corrected&after=S (HTML search, deep page)": [
                f"{run}/steps?verdict=corrected&after={i}" for i in ids
            ],
            "GET /runs/{run}/steps?update=U&verdict=corrected (HTML search)": [
                f"{run}/steps?update={u}&verdict=corrected" for u in updates
            ],
            "GET /runs/{run}/steps?action=+&reward_min=1&after=S (HTML search)": [
                f"{run}/steps?action=%2B&reward_min=1&after={i}" for i in ids
            ],
            "GET /runs/{run}/steps?q=misread&after=S (HTML full text, 1,000 hits)": [
                f"{run}/steps?q=misread&after={i}" for i in ids
            ],
            "GET /runs/{run}/steps?q=increase&update=U (HTML full text, every step)": [
                f"{run}/steps?q=increase&update={u}" for u in updates
            ],
            "GET /runs/{run}/steps?q=increase&after=S (HTML full text, 1M hits)": [
                f"{run}/steps?q=increase&after={i}" for i in ids
            ],
            "GET /runs/{run}/steps?q=zzyzx&after=S (HTML full text, a word in no thought)": [
                f"{run}/steps?q=zzyzx&after={i}" for i in ids
            ],
            "GET /api/runs/{run}/steps?verdict=failed (JSON, no hit)": [
                f"/api/runs/{run_id}/steps?verdict=failed" for _ in updates
            ],
        }
        print(
            f"\n{args.steps:,} steps, {args.steps // EP_LEN:,} episodes, "
            f"{len(range(1, args.steps + 1, 3)):,} corrections in {args.store}; "
            f"{args.samples} random requests each; load average before: {os.getloadavg()}\n"
        )
        print("| request | p50 ms | p95 ms | max ms |\n| --- | ---: | ---: | ---: |")
        for name, paths in cases.items():
            if args.only in name:
                r = timed(get, paths)
                print(f"| {name} | {r['p50']:.1f} | {r['p95']:.1f} | {r['max']:.1f} |")
        print(f"\nload average after: {os.getloadavg()}")
    if not args.keep:
        drop_database(url)


if __name__ == "__main__":
    main()
