"""Cancel acts while a run waits for its corrections, however slow the corrector (issue 17)."""

from __future__ import annotations

import threading
import time
import tomllib
from pathlib import Path

from sqlalchemy import func, select

from services.api.auth import create_token
from services.api.service import cancel_run, create_run, resume_run
from services.controller.backends import InProcessPolicy, InProcessTrainer, ThreadCorrections
from services.controller.service import RunDriver
from services.env import EnvPool
from shared.db.models import Correction, EvalOutcome, Run, Update
from shared.db.session import session_scope
from shared.schemas import RunConfig
from shared.settings import get_settings
from tests.e2e.helpers import tiny_config
from tests.services.corrector.conftest import FakeOpenAI, chat


def test_cancel_acts_while_the_run_waits_for_a_slow_corrector(
    pg_url: str, warm_checkpoint: Path
) -> None:
    fake = FakeOpenAI()  # a corrector that answers after ten minutes (what, the run never sees)
    fake.default = chat('{"verdict": "correct"}')
    fake.default.delay_s = 600
    threading.Thread(target=fake.server.serve_forever, args=(0.05,), daemon=True).start()
    inline = (
        f'name = "slow"\nkind = "openai"\nbase_url = "{fake.url}"\nmodel = "tiny"\n'
        '[corrector.params]\nmax_retries = 0\ntimeout_s = 600\nstructured = "none"\n'
    )
    toml = tiny_config(warm_checkpoint, envs=2, steps=2, updates=2, wait="update")
    toml = toml.replace("wait_timeout_s = 60\n", "wait_timeout_s = 600\n" + inline)
    cfg = RunConfig.model_validate(tomllib.loads(toml))
    with session_scope() as s:
        run_id = create_run(s, cfg, "cancel-test").id
        token = create_token(s, "cancel-test", "write", "cancel-test")[0]
    c = cfg.corrector
    corrections = ThreadCorrections(
        c.name, c.noise, cfg.seed, get_settings(), run_id=run_id, inline=c.inline()
    )
    driver = RunDriver(
        run_id, EnvPool(), InProcessPolicy(cfg.model), corrections, InProcessTrainer()
    )
    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(driver.run()), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 300
        while not (_phase(run_id) == "corrections" and fake.requests):
            assert thread.is_alive() and time.monotonic() < deadline, (result, _phase(run_id))
            time.sleep(0.1)
        with session_scope() as s:
            cancel_run(s, token, run_id)
        # The corrector has not answered, and would not for ten minutes: the wait, not its
        # timeout, saw the cancel.
        thread.join(timeout=120)
        assert result == ["cancelled"]
        with session_scope() as s:
            run = s.get(Run, run_id)
            assert run is not None and run.status == "cancelled" and run.phase is None
            assert run.updates_done == 0  # it never trained on the rollout it was waiting for
            statuses = set(s.scalars(select(Correction.status).where(Correction.run_id == run_id)))
        assert "done" not in statuses
    finally:
        fake.release.set()  # the requests in flight answer now, and the server stops
        thread.join(timeout=60)
        corrections.close()  # their rows written before the test's database goes
        fake.server.shutdown()
        fake.server.server_close()


def _phase(run_id: int) -> str | None:
    with session_scope() as s:
        return s.scalar(select(Run.phase).where(Run.id == run_id))


class _CancelledWhileTraining(InProcessTrainer):
    """The real trainer; a person presses Cancel while it trains update 0."""

    def __init__(self, token: str) -> None:
        self.token = token

    def update(self, run_id: int, update_idx: int) -> Path:
        path = super().update(run_id, update_idx)
        with session_scope() as s:
            cancel_run(s, self.token, run_id)
        return path


def test_a_cancel_during_training_skips_the_evaluation_and_a_resume_finishes_it(
    pg_url: str, warm_checkpoint: Path
) -> None:
    """A cancel seen after training (a person's, or a tuning stage's stop) does not pay for the
    update's evaluation; the resumed run evaluates that update and goes on."""
    toml = tiny_config(warm_checkpoint, envs=2, steps=2, updates=2, wait="update")
    toml += "eval_episodes = 4\neval_every = 1\n"  # [metrics] is the last section
    cfg = RunConfig.model_validate(tomllib.loads(toml))
    with session_scope() as s:
        run_id = create_run(s, cfg, "cancel-test").id
        token = create_token(s, "cancel-train", "write", "cancel-test")[0]

    def drive(trainer: InProcessTrainer) -> str:
        corrections = ThreadCorrections("oracle", 0.0, cfg.seed, get_settings(), run_id=run_id)
        try:
            policy = InProcessPolicy(cfg.model)
            return RunDriver(run_id, EnvPool(), policy, corrections, trainer).run()
        finally:
            corrections.close()

    assert drive(_CancelledWhileTraining(token)) == "cancelled"
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.updates_done == 0
        (row,) = s.scalars(select(Update).where(Update.run_id == run_id)).all()
        assert "eval/success_rate" not in row.metrics  # trained, never evaluated
        assert not s.scalar(
            select(func.count()).where(EvalOutcome.run_id == run_id, EvalOutcome.update_idx == 0)
        )
        resume_run(s, token, run_id)
    assert drive(InProcessTrainer()) == "completed"
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.updates_done == 2
        rows = s.scalars(select(Update).where(Update.run_id == run_id).order_by(Update.idx)).all()
        assert [r.idx for r in rows] == [0, 1]
        assert all("eval/success_rate" in r.metrics for r in rows)
        per_update = s.execute(
            select(EvalOutcome.update_idx, func.count())
            .where(EvalOutcome.run_id == run_id, EvalOutcome.update_idx >= 0)
            .group_by(EvalOutcome.update_idx)
        ).all()
        assert sorted(per_update) == [(0, 4), (1, 4)]  # update 0 evaluated once, by the resume
