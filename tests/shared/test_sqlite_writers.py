"""The embedded default's SQLite file under concurrent writers: the rollout's recorder thread and
the corrector threads write at the same time, and none of them may lose a row to a lock."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from shared.db import models
from shared.db.migrate import upgrade
from shared.db.session import make_engine


def test_a_savepoint_write_beside_a_committing_recorder_is_not_lost(tmp_path: Path) -> None:
    """`record_correction` inserts inside a SAVEPOINT after reading the step. A SAVEPOINT opened a
    deferred transaction whose write failed at once with "database is locked" when another
    thread had committed since its read (seen on a real run: a correction lost, the run waiting
    60 s to send it again)."""
    url = f"sqlite:///{tmp_path / 'gtr.sqlite'}"
    upgrade(url)
    engine = make_engine(url)
    with Session(engine) as s:
        s.add(
            models.Run(
                id=1, name="r", team="t", task="numberline", algorithm="gtr", config={},
                total_env_steps=1, num_updates=1,
            )
        )  # fmt: skip
        s.commit()
    # The writers race for 3 s and on until the correctors have written `want` corrections,
    # however long a loaded host takes (3 s alone wrote 5 under a load average of 10), within a cap.
    start = time.monotonic()
    want, least, cap = 12, start + 3.0, start + 60.0
    errors: list[str] = []
    written = [0]

    def racing() -> bool:
        now = time.monotonic()
        return (now < least or written[0] < want) and not errors and now < cap

    def recorder() -> None:  # one episode and its step per transaction, as fast as it can
        i = 0
        while racing():
            with Session(engine) as s:
                ep = models.Episode(run_id=1, env_index=0, seq=i, update_idx=0)
                s.add(ep)
                s.flush()
                s.add(
                    models.Step(
                        run_id=1, episode_id=ep.id, idx=0, update_idx=0, rollout_pos=i,
                        prompt="p", output="o", thought="the target is 3", format_valid=True,
                        action_valid=True, reward=0.0, done=False,
                    )
                )  # fmt: skip
                s.commit()
            i += 1

    def corrector(name: str) -> None:  # read the newest step, then write its correction
        while racing():
            with Session(engine) as s:
                step_id = s.scalar(select(func.max(models.Step.id)))
                if step_id is None:
                    continue
                try:
                    with s.begin_nested():
                        s.add(
                            models.Correction(
                                step_id=step_id, run_id=1, update_idx=0, corrector=name,
                                status="done", corrected_thought="the target is 4",
                            )
                        )  # fmt: skip
                    s.commit()
                    written[0] += 1
                except IntegrityError:
                    s.rollback()  # this step is corrected already: the next one
                except Exception as exc:  # noqa: BLE001 - the failure under test
                    errors.append(str(exc).splitlines()[0])

    threads = [threading.Thread(target=recorder)]
    threads += [threading.Thread(target=corrector, args=(f"c{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"{len(errors)} writes lost, e.g. {errors[0]}"
    assert written[0] >= want, f"{written[0]} corrections written in 60 s"
