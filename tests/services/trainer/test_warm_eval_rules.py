"""One protocol means the start too: the warm start's own greedy evaluation (``gtr sft``) plays
under the run's evaluation protocol (``shared.evalrules``), as the run's evaluations do, not under
the warm start's env and a token cap of its own."""

from __future__ import annotations

import json
from pathlib import Path

from services.controller.evaluate import protocol
from services.policy.service import Policy
from services.trainer import warmstart
from shared.evalrules import eval_rules
from shared.schemas import EnvConfig, EvalProtocol, InitConfig, RunConfig


def test_the_rules_are_the_declared_protocol_else_the_runs_own() -> None:
    own = RunConfig.model_validate({"task": "numberline", "generation": {"max_new_tokens": 40}})
    rules = eval_rules(own)
    assert rules.max_new_tokens == 40 and rules.env.early_truncation == own.env.early_truncation
    declared = EvalProtocol(env=EnvConfig(early_truncation="off"), max_new_tokens=48)
    study = own.model_copy(
        update={"metrics": own.metrics.model_copy(update={"eval_protocol": declared})}
    )
    got = eval_rules(study)
    assert got.max_new_tokens == 48 and got.env.early_truncation == "off"
    assert protocol(study) == eval_rules(study)  # the run driver's, the same function


def test_the_warm_starts_evaluation_plays_under_the_rules_given(warm_checkpoint: Path) -> None:
    meta = json.loads((warm_checkpoint / "policy.json").read_text())
    policy = Policy.load(Path(meta["base_model"]), finetune="full")
    policy.load_weights(warm_checkpoint)
    env = EnvConfig(image_size=64)
    init = InitConfig(vision_steps=0, sft_steps=0, sft_samples=1)  # the evaluation alone

    def evaluated(tokens: int) -> dict[str, float]:
        rules = EvalProtocol(env=env, max_new_tokens=tokens)
        return warmstart.warm_start(policy, "numberline", env, init, 0, 4, rules)

    assert evaluated(40)["eval/json"] > 0.5  # the warm start writes the task's JSON
    assert evaluated(2)["eval/json"] == 0.0  # cut at the protocol's 2 tokens: never JSON
