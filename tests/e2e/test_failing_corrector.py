"""A run whose corrector always answers garbage: it goes to its end and ends ``degraded``
(``gtr train`` exits non-zero after its summary), saying why on every line a user reads, with
figures recomputed from the corrections as they came in (``wait = "none"``: after their update)."""

from __future__ import annotations

import json
import threading

import pytest
from sqlalchemy import create_engine, text

from tests.e2e.helpers import tiny_config
from tests.e2e.test_embedded import _train
from tests.services.corrector.conftest import FakeOpenAI, chat

pytestmark = pytest.mark.slow

GARBAGE = "The player is right <script>alert(1)</script>"


def test_a_run_whose_corrector_always_fails_reports_it(tmp_path, warm_checkpoint) -> None:
    fake = FakeOpenAI()
    fake.default = chat(GARBAGE)
    threading.Thread(target=fake.server.serve_forever, args=(0.05,), daemon=True).start()
    inline = (
        f'name = "garbage"\nkind = "openai"\nbase_url = "{fake.url}"\nmodel = "tiny"\n'
        '[corrector.params]\nmax_retries = 0\nstructured = "none"\n'
    )
    cfg = tiny_config(warm_checkpoint, envs=2, steps=3, updates=1, wait="none")
    cfg = cfg.replace("wait_timeout_s = 60\n", "wait_timeout_s = 60\n" + inline)
    (tmp_path / "run.toml").write_text(cfg)
    try:
        # The fake server is on loopback, which corrector calls refuse unless allowed.
        allow = {"GTR_CORRECTOR_ALLOW_PRIVATE_NETWORKS": "true"}
        proc = _train(tmp_path / "run.toml", tmp_path, timeout=600, **allow)
    finally:
        fake.server.shutdown()
        fake.server.server_close()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    engine = create_engine(f"sqlite:///{tmp_path / 'gtr-data' / 'gtr.sqlite3'}")
    with engine.connect() as conn:
        run_status, run_error = conn.execute(text("SELECT status, error FROM runs")).one()
        rows = conn.execute(text("SELECT status, error, raw FROM corrections")).all()
        metrics = json.loads(conn.execute(text("SELECT metrics FROM updates")).scalar_one())
        calls = conn.execute(text("SELECT calls FROM corrector_spend")).scalar_one()
    engine.dispose()
    n = len(rows)
    assert n > 0 and all(r.status == "failed" and r.error.startswith("malformed:") for r in rows)
    assert all(r.raw == GARBAGE for r in rows)  # the raw answer is kept for the step page
    assert len(fake.requests) == n == calls  # one call per step, and the spend saw each
    # The update's figures count every correction, though they all came after it trained.
    assert metrics["corrections_failed/malformed"] == metrics["corrections_failed"] == n
    assert metrics["corrections_done"] == 0 and metrics["corrections_alarm"] == 1.0
    assert f"corrections: 0 done, {n} failed (malformed {n})" in proc.stdout
    assert "most corrections FAILED" in proc.stdout
    # Stdout is a pipe: the per-update line carries what the terminal's bar shows, the update
    # numbered from 0 as the charts and `gtr run watch` number it.
    line = next(x for x in proc.stdout.splitlines() if x.startswith("update 0 done (1 of 1)"))
    assert f"corrections 0 done, {n} failed (malformed {n})" in line, line
    assert line.endswith("CORRECTIONS FAILING"), line
    # The reason of the failures, in the summary; the run is degraded, and says why.
    assert f"why: malformed: answer is not JSON ({n})" in proc.stdout
    assert run_status == "degraded" and "run 1: degraded in" in proc.stdout
    assert run_error == (
        f"degraded: {n} of {n} requested corrections failed (over "
        f"corrector.degraded_share = 0.5): malformed: answer is not JSON ({n})"
    )
