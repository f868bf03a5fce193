"""The run driver's collaborators on their own (a whole run reaches them in test_embedded.py):
the env sessions and GRPO groups, the correction book without a corrector, the outage wait that
a cancel ends, and the collapse monitor's alarm against the start policy."""

from __future__ import annotations

from typing import Any

import pytest


def _run(cfg: dict[str, Any]) -> tuple[int, Any]:
    from services.controller import store
    from services.controller.launch import create_run
    from shared.db.session import session_scope
    from shared.schemas import RunConfig

    with session_scope() as s:
        run_id = create_run(s, RunConfig.model_validate(cfg), team="default").id
        return run_id, store.run_config(s, run_id)


def test_grpo_groups_share_a_deal_and_start_fresh_each_update(pg_url: str) -> None:
    from services.controller.episodes import Episodes
    from services.env.service import EnvPool
    from shared.db.models import Episode
    from shared.db.session import session_scope

    run_id, cfg = _run(
        {"task": "numberline", "algorithm": "grpo", "train": {"num_envs": 4, "group_size": 2}}
    )
    eps = Episodes(run_id, EnvPool(), cfg)
    eps.open(0)
    states = [o.state for o in eps.obs]
    assert states[0] == states[1] and states[2] == states[3]  # a group: one deal
    first = list(eps.sessions)
    eps.for_update(0)  # the same update: nothing happens
    assert eps.sessions == first
    eps.for_update(1)  # a new update: new sessions, new deals, the open episodes dropped
    assert eps.opened_for == 1 and not set(eps.sessions) & set(first)
    assert [o.state for o in eps.obs][0] == [o.state for o in eps.obs][1]
    with session_scope() as s:
        rows = s.query(Episode).filter(Episode.run_id == run_id).all()
        assert sorted(r.update_idx for r in rows) == [1, 1, 1, 1]  # stepless episodes dropped
    eps.close()
    assert eps.sessions == []


def test_an_ended_episode_counts_in_its_subtask_and_the_success_window(pg_url: str) -> None:
    from services.controller.episodes import Episodes
    from services.controller.recorder import EpisodeCursor
    from services.env.service import EnvPool

    run_id, cfg = _run({"task": "numberline"})
    eps = Episodes(run_id, EnvPool(), cfg)
    eps.ended(EpisodeCursor(1, 0, length=3, total_return=1.0), True, {"subtask": "pick"})
    eps.ended(EpisodeCursor(2, 0, length=5, total_return=0.0), False, {})
    m = eps.success_metrics()
    assert m["success_rate"] == 0.5 and m["success/pick"] == 1.0
    eps.forget()
    assert "success/pick" not in eps.success_metrics()


def test_the_book_of_a_run_without_a_corrector_does_nothing(pg_url: str) -> None:
    from services.controller.correction_book import CorrectionBook

    run_id, cfg = _run({"task": "numberline"})
    book = CorrectionBook(run_id, None, cfg)
    assert not book.correcting and book.sweeper is None
    book.submit([1, 2])  # nothing to send them to
    book.sweep(0)
    book.finish()
    book.close("completed")


class _Down:
    """A backend whose service stays away."""

    def __init__(self) -> None:
        self.calls = 0

    def health(self) -> None:
        self.calls += 1
        raise ConnectionError("refused")


def test_a_cancel_ends_the_wait_for_a_service(pg_url: str) -> None:
    from services.controller.outages import Cancelled, Outages
    from shared.db.models import Run
    from shared.db.session import session_scope

    run_id, _ = _run({"task": "numberline"})
    down = _Down()
    outages = Outages(run_id, [object(), down], outage_s=600, max_interruptions=1)
    with session_scope() as s:
        run = s.get(Run, run_id)
        assert run is not None
        run.cancel_requested = True
    with pytest.raises(Cancelled):  # at once, not after 600 s
        outages.wait(ConnectionError("refused"))
    outages.count(ConnectionError("one"))
    with pytest.raises(Exception, match="gave up after 1 interruptions in a row"):
        outages.count(ConnectionError("two"))


def test_the_alarm_of_update_0_falls_from_the_start_policy(pg_url: str) -> None:
    from services.controller.monitor import CollapseMonitor
    from services.env.service import EnvPool
    from shared.db.session import session_scope

    run_id, cfg = _run({"task": "numberline"})
    monitor = CollapseMonitor(run_id, EnvPool(), None, cfg)  # type: ignore[arg-type]
    monitor.start_relevance = 1.0
    assert monitor.figures([], 0) == {"probe_relevance_start": 1.0}
    assert monitor.figures([], 1) == {}  # only update 0 carries the start
    merged = {
        "probe_relevance": 0.0,
        "probe_top_thought_share": 0.1,
        "probe_expected_top_share": 0.1,
        "probe_relevance_start": 1.0,
        "alarm_reason": "stale",
    }
    with session_scope() as s:
        reason = monitor.alarm(s, 0, merged)
    assert reason is not None and "under the run's best 1.00" in reason
    assert merged["alarm_reason"] == reason
    held = {k: v for k, v in merged.items() if k != "probe_relevance_start"} | {
        "probe_relevance": 1.0
    }
    with session_scope() as s:
        assert monitor.alarm(s, 0, held) is None and "alarm_reason" not in held
