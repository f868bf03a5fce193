"""The study page of the v3 study (63 runs, docs/results/v3/study.json.gz) as a person loads it.

Imports the bundle into a fresh PostgreSQL database with the product's importer, serves the app
with uvicorn on a free port (in this process, as bench/ui_bench.py does), builds and keeps the
report as `gtr study import` does (timed), and times at the client the first GET /studies/1
after the server started (the kept report read from the data folder), then the page and its
curves (/studies/1/curves.json, fetched by the page's script) again and again, then the first
GET with the server's memory emptied again; prints the page's size. Issue 58: served well under
a second.

    .venv/bin/python bench/study_page_bench.py --repeat 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BUNDLE = ROOT / "docs" / "results" / "v3" / "study.json.gz"
DB_NAME = "gtr_bench_study_page"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    import bench.ui_bench as ub  # its database and server helpers

    ub.DB_NAME = DB_NAME
    url = ub.pg_url()
    ub.fresh_database(url)
    os.environ["GTR_DATABASE_URL"] = url
    os.environ["GTR_REDIS_URL"] = ""
    import httpx

    from services.api.auth import COOKIE_NAME, create_token
    from services.study.bundle import import_study, read_bundle
    from shared.db.migrate import upgrade
    from shared.db.session import session_scope

    upgrade(url)
    from services.study import kept
    from shared.db.models import Study

    with session_scope(url) as s:
        study_id = import_study(s, read_bundle(BUNDLE)).study_id
        token = create_token(s, "bench", "read", "default")[1]
    with session_scope(url) as s:  # what `gtr study import` does once the study is stored
        t = time.perf_counter()
        kept.report_of(s, s.get(Study, study_id))  # type: ignore[arg-type]
        print(f"the import's report build (kept): {(time.perf_counter() - t) * 1000:.0f} ms")
    kept._CACHE.clear()  # the server is another process: it finds the report on disk only
    print(f"load average {os.getloadavg()[0]:.2f}")
    base = ub.serve()
    with httpx.Client(base_url=base, cookies={COOKIE_NAME: token}, timeout=120) as c:
        t = time.perf_counter()
        first = c.get(f"/studies/{study_id}")
        cold = time.perf_counter() - t
        assert first.status_code == 200, first.status_code
        rows = {"page": [], "curves": []}
        for _ in range(args.repeat):
            for name, path in (("page", ""), ("curves", "/curves.json")):
                t = time.perf_counter()
                got = c.get(f"/studies/{study_id}{path}")
                rows[name].append((time.perf_counter() - t) * 1000)
                assert got.status_code == 200
        # A server started anew (its memory empty) finds the report kept in the data folder.
        kept._CACHE.clear()
        t = time.perf_counter()
        assert c.get(f"/studies/{study_id}").status_code == 200
        restarted = time.perf_counter() - t
    print(f"first GET after a restart (report kept on disk): {restarted * 1000:.0f} ms")
    size = len(first.content)
    print(f"first GET /studies/{study_id} after the import: {cold * 1000:.0f} ms ({size:,} bytes)")
    for name, ms in rows.items():
        ms.sort()
        p95 = ms[max(0, int(len(ms) * 0.95) - 1)]
        print(f"{name}: p50 {statistics.median(ms):.1f} ms, p95 {p95:.1f} ms over {len(ms)}")
    print(f"load average {os.getloadavg()[0]:.2f}")
    ub.drop_database(url)


if __name__ == "__main__":
    main()
