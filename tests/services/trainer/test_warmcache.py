"""The warm-start cache: the second run of the same recipe reuses the first one's warm start."""

from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner

from services.trainer.warmcache import key_inputs, list_entries, warm_start_key
from shared.db.models import Run
from shared.schemas import RunConfig
from tests.services.trainer.dbutil import make_run


def _cfg(tiny_dir: Path, seed: int = 0, finetune: str = "full") -> RunConfig:
    return RunConfig.model_validate(
        {
            "task": "numberline",
            "seed": seed,
            "env": {"image_size": 64},
            "model": {"path": str(tiny_dir), "image_size": 64, "finetune": finetune},
            "init": {"kind": "warm_start", "vision_steps": 3, "sft_samples": 16, "sft_steps": 3},
        }
    )


def test_key_covers_model_task_recipe_seed_and_code(tiny_dir: Path) -> None:
    base = _cfg(tiny_dir)
    key = warm_start_key(key_inputs(base, tiny_dir))
    assert key == warm_start_key(key_inputs(_cfg(tiny_dir), tiny_dir))  # stable
    other_init = base.model_copy(update={"init": base.init.model_copy(update={"sft_steps": 4})})
    other_env = base.model_copy(update={"env": base.env.model_copy(update={"image_size": 48})})
    no_cache = base.model_copy(update={"init": base.init.model_copy(update={"cache": False})})
    variants = [_cfg(tiny_dir, seed=1), other_init, other_env, _cfg(tiny_dir, finetune="lora")]
    assert all(warm_start_key(key_inputs(c, tiny_dir)) != key for c in variants)
    assert warm_start_key(key_inputs(no_cache, tiny_dir)) == key  # the switch is not the recipe
    inputs = key_inputs(base, tiny_dir)
    assert len(inputs["code"]) == 64 and inputs["base_model"] and inputs["seed"] == 0


def test_the_training_loops_truncation_rule_is_not_the_warm_starts(tiny_dir: Path) -> None:
    """GTR's loop truncates, RL4VLM's does not: the arms of one seed still share a warm start,
    played with no truncation (warm_env), so the study schedules one (warm_group)."""
    from services.study.service import warm_group
    from shared.warmenv import warm_env

    base = _cfg(tiny_dir)
    for rule in ("reference", "solver"):
        other = base.model_copy(
            update={"env": base.env.model_copy(update={"early_truncation": rule})}
        )
        assert warm_start_key(key_inputs(other, tiny_dir)) == warm_start_key(
            key_inputs(base, tiny_dir)
        )
        assert warm_group(other) == warm_group(base) is not None
        assert warm_env(other.env).early_truncation == "off"
        assert warm_env(other.env).model_dump() == {
            **other.env.model_dump(),
            "early_truncation": "off",
        }


def test_second_run_reuses_the_warm_start_and_says_so(db, tiny_dir: Path) -> None:
    from services.cli import main
    from services.policy.checkpoint import read_checkpoint_meta
    from services.trainer.checkpoint import checkpoint_path, get_checkpoint
    from services.trainer.runs import run_init

    cfg = _cfg(tiny_dir, seed=7)
    first, second = make_run(db, cfg), make_run(db, cfg)
    run_init(db, first.id)
    run_init(db, second.id)
    db.flush()
    info = [db.get(Run, r.id).info["warm_start"] for r in (first, second)]
    assert [i["reused"] for i in info] == [False, True] and info[0]["key"] == info[1]["key"]
    # The same weights, and the reused run's checkpoint stands on its own (not in the cache).
    paths = [checkpoint_path(get_checkpoint(db, r.id, -1)) for r in (first, second)]
    from safetensors.torch import load_file

    def _load(f: Path):  # type: ignore[no-untyped-def]
        return load_file(f).items()

    weights = [
        {
            f"{f.name}:{k}": v
            for f in sorted(p.glob("*.safetensors"))
            for k, v in load_file(f).items()
        }
        for p in paths
    ]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert read_checkpoint_meta(paths[1])["base_model"] == str(tiny_dir)

    key = info[0]["key"]
    assert any(e.key == key for e in list_entries())
    cli = CliRunner()
    listed = cli.invoke(main, ["cache", "ls"])
    assert listed.exit_code == 0 and key[:16] in listed.output
    bad = cli.invoke(main, ["cache", "rm", "../etc"])
    assert bad.exit_code != 0 and "hex" in bad.output and any(e.key == key for e in list_entries())
    gone = cli.invoke(main, ["cache", "rm", key[:8]])
    assert gone.exit_code == 0 and key[:16] in gone.output
    assert not any(e.key == key for e in list_entries())
    third = make_run(db, cfg)
    run_init(db, third.id)  # the cache was emptied: built again
    assert db.get(Run, third.id).info["warm_start"]["reused"] is False
