"""GTR's corrector feedback (corrector.feedback): what a step's correction does to its episode."""

from __future__ import annotations

from services.controller.feedback import decide


def test_no_solution_truncates() -> None:
    fb = decide({"possible_solution": False, "target_formula": "(1+1)*12"}, "(")
    assert fb.truncate and fb.target_formula is None


def test_target_formula_is_kept_while_the_formula_follows_it() -> None:
    fb = decide({"possible_solution": True, "target_formula": "(10 + 2) * (4 - 1)"}, "(10+")
    assert not fb.truncate and fb.target_formula == "(10+2)*(4-1)"


def test_leaving_the_target_formula_truncates() -> None:
    fb = decide({"possible_solution": True, "target_formula": "(10+2)*(4-1)"}, "(4")
    assert fb.truncate and fb.target_formula == "(10+2)*(4-1)"


def test_nothing_to_say_changes_nothing() -> None:
    assert decide({}, "1").truncate is False and decide(None, None).target_formula is None
    # The episode already ended (formula None): a target is remembered, nothing truncated.
    assert not decide({"target_formula": "4*6"}, None).truncate


def test_the_run_driver_applies_feedback_to_its_episodes(pg_url: str) -> None:
    """Points24, wait = step: the oracle's "no solution" ends env 0's episode with −1; env 1
    typed the first token of the oracle's target formula, which its episode then keeps."""
    import json

    from sqlalchemy import select

    from services.api.service import create_run
    from services.controller.collector import Collected
    from services.controller.service import RunDriver
    from services.corrector.oracle import OracleCorrector
    from services.corrector.service import record_correction
    from services.env.expert import target_tokens
    from services.env.service import EnvPool
    from services.policy.schemas import Generation
    from shared.db.models import Episode, Step
    from shared.db.session import session_scope
    from shared.schemas import RunConfig

    cfg = RunConfig.model_validate(
        {
            "task": "points24",
            "train": {"num_envs": 2, "num_steps": 1, "num_updates": 1},
            "corrector": {"wait": "step", "feedback": True},
        }
    )
    with session_scope() as s:
        run_id = create_run(s, cfg, "feedback-test").id
    pool = EnvPool()
    driver = RunDriver(run_id, pool, None, None, None)  # type: ignore[arg-type]
    driver.episodes.open(0)
    ep = driver.episodes
    deals = [["HA", "SA", "DA", "CA"], ["HK", "S4", "D2", "CA"]]  # 1,1,1,1 cannot make 24
    ep.obs = [pool.reset(sid, {"cards": d}) for sid, d in zip(ep.sessions, deals, strict=True)]
    target = "".join(target_tokens("points24", ep.obs[1].state) or [])
    outputs = [
        {"cards": [1, 1, 1, 1], "formula": "", "thoughts": "1 first", "action": "1"},
        {"cards": [10, 4, 2, 1], "formula": "", "thoughts": "go", "action": target[0]},
    ]
    gens = [Generation(json.dumps(o), [], [], 0.0, [], [], [], True, True) for o in outputs]
    results = pool.step_batch([(sid, g.text) for sid, g in zip(ep.sessions, gens, strict=True)])
    ro = Collected()
    prompts = [o.prompt for o in ep.obs]
    # The rollout's own path: the step's records, written as the recorder thread writes them.
    records = driver.collector.step_records(ro, 0, 0, prompts, gens, results)
    ro.step_ids, _ = driver.collector.write_step(0, 0, records)
    with session_scope() as s:
        for sid in ro.step_ids:
            record_correction(s, sid, "oracle", OracleCorrector())
    ep.obs = [r.observation for r in results]
    old_obs0 = ep.obs[0]
    driver.collector.feedback(ro, 0, 0, ro.step_ids)
    assert ro.rewards == [-1.0, 0.0] and ro.dones == [True, False]
    with session_scope() as s:
        steps = s.scalars(select(Step).where(Step.run_id == run_id).order_by(Step.id)).all()
        assert [(x.reward, x.done) for x in steps] == [(-1.0, True), (0.0, False)]
        eps = s.scalars(select(Episode).where(Episode.run_id == run_id).order_by(Episode.id)).all()
        first = [e for e in eps if e.env_index == 0]
        assert first[0].finished and first[0].success is False and first[0].total_return == -1.0
        assert len(first) == 2 and not first[1].finished  # a new episode began
    assert ep.obs[0] is not old_obs0 and ep.obs[0].state["formula"] == []
    assert ep.obs[1].state["target_formula"] == target  # the corrector's memory
    pool_state = pool.step_batch([(ep.sessions[1], json.dumps({"action": target[1]}))])
    assert pool_state[0].observation.state["target_formula"] == target
