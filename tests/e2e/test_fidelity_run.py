"""One short embedded `gtr train` with every new fidelity option on at once (docs/fidelity.md):
GTR's DAgger draw, the ratio rule, the cosine SFT weight, thought+action cloning, the newest
corrections only, the judge and length rewards, the reference's cosine period, the image-reading
value head, the generated-only repetition penalty, the synchronous loop with corrector feedback,
the fallible oracle (corrector.errors) whose accuracy against the exact judge each update records.
"""

from __future__ import annotations

import json

import pytest
from sqlalchemy import create_engine, text

from tests.e2e.helpers import tiny_config
from tests.e2e.test_embedded import _train

pytestmark = pytest.mark.slow

OPTIONS = """
[generation]
max_new_tokens = 40
repetition_penalty = 1.2
repetition_scope = "generated"
"""

TRAIN = """dagger = "reference"
dagger_sampling = "latest"
ratio_guard = "reference"
sft_schedule = "cosine"
sft_target = "output"
judge_reward = 1.0
length_reward = 0.5
lr_schedule = "cosine"
lr_schedule_updates = 25
"""


def _config(checkpoint) -> str:  # type: ignore[no-untyped-def]
    # 8 steps an update: the asserts below need a well-formed step in update 0's rollout (the
    # oracle corrects only those), and the warm start writes one in ~3 of 5 samples (4 samples
    # once drew none).
    cfg = tiny_config(checkpoint, envs=4, steps=2, updates=2, wait="step")
    cfg = cfg.replace('finetune = "full"\n', 'finetune = "full"\nvalue_head = "mlp+image"\n')
    cfg = cfg.replace("[generation]\nmax_new_tokens = 40\n", OPTIONS)
    cfg = cfg.replace("ppo_epochs = 1\n", "ppo_epochs = 1\n" + TRAIN)
    cfg = cfg.replace(
        "wait_timeout_s = 60\n", "wait_timeout_s = 60\nfeedback = true\nerrors = { choice = 0.3 }\n"
    )
    return cfg.replace("probe_states = 4", "probe_states = 0")


def test_every_fidelity_option_trains_end_to_end(tmp_path, warm_checkpoint) -> None:
    cfg = tmp_path / "fidelity.toml"
    cfg.write_text(_config(warm_checkpoint))
    proc = _train(cfg, tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    engine = create_engine(f"sqlite:///{tmp_path / 'gtr-data' / 'gtr.sqlite3'}")
    with engine.connect() as conn:
        config = json.loads(conn.execute(text("SELECT config FROM runs")).scalar_one())
        updates = [
            json.loads(m) if isinstance(m, str) else m
            for (m,) in conn.execute(text("SELECT metrics FROM updates ORDER BY idx"))
        ]
        # Each update's share of steps the oracle judged correct (the judge reward's input).
        judged = conn.execute(
            text(
                "SELECT s.update_idx, AVG(CASE WHEN c.verdict = 'correct' THEN 1.0 ELSE 0 END),"
                " COUNT(*) FROM steps s LEFT JOIN corrections c ON c.step_id = s.id"
                " AND c.status = 'done' GROUP BY s.update_idx ORDER BY s.update_idx"
            )
        ).all()
        ckpt = conn.execute(text("SELECT path FROM checkpoints ORDER BY update_idx DESC")).first()
        marks = conn.execute(
            text("SELECT update_idx, extras FROM corrections WHERE status = 'done' ORDER BY id")
        ).all()
    engine.dispose()
    assert config["train"]["dagger"] == "reference" and config["model"]["value_head"] == "mlp+image"
    assert [u.get("trained") for u in updates] == [True, True]
    for u, (_, share, n) in zip(updates, judged, strict=True):
        assert n == 8 and u["reward/judge"] == pytest.approx(float(share))
        assert 0.0 < u["reward/length"] <= 0.5  # 0.5 × thought tokens / max_new_tokens
        assert all(v == v for v in u.values() if isinstance(v, float))  # no NaN anywhere
    # The cosine SFT weight: 1.0 at the first update, ½·(1 + cos(π/2)) = 0.5 at the second
    # (update 0's rollout has corrections: the warm start is far from perfect).
    assert judged[0][1] < 1.0
    assert [u["sft_coef"] for u in updates] == pytest.approx([1.0, 0.5])
    assert ckpt is not None
    # The fallible oracle's answers, each marked against the exact judge; the update's
    # corrector/accuracy is their mean (update 0 has some; a later update's policy may write
    # no well-formed output, hence no correction and no figure).
    assert config["corrector"]["errors"]["choice"] == 0.3
    for idx, u in enumerate(updates):
        got = [
            json.loads(e)["accurate"] if isinstance(e, str) else e["accurate"]
            for i, e in marks
            if i == idx
        ]
        if got:
            assert u["corrector/accuracy"] == pytest.approx(sum(got) / len(got))
        else:
            assert idx > 0 and "corrector/accuracy" not in u
