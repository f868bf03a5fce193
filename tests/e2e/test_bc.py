"""The bc arm (configs/repro/arms.toml): DAgger supervised on the corrector's whole answer, the
action included, learns actions where the paper's thought-only SFT-only cannot make a model with
no language prior act (issue 55). One embedded `gtr train` on NumberLine with the exact oracle.

An unparsable output plays a no-op here, not the reference's random action: a random walk finds
NumberLine's target often enough to hide whether the model's own actions improved."""

from __future__ import annotations

import json
import sqlite3
import tomllib
from pathlib import Path

import pytest

from tests.e2e.helpers import ROOT, tiny_config
from tests.e2e.test_embedded import _train

pytestmark = pytest.mark.slow


def test_bc_with_the_exact_corrector_lifts_greedy_success_above_its_warm_start(
    tmp_path: Path, warm_checkpoint: Path
) -> None:
    arm = tomllib.loads((ROOT / "configs/repro/arms.toml").read_text())["bc"]
    text = tiny_config(warm_checkpoint, envs=8, steps=8, updates=10)
    for old, new in (
        ('algorithm = "gtr"', f'algorithm = "{arm["algorithm"]}"'),
        ("[train]\n", f'[train]\nsft_target = "{arm["train.sft_target"]}"\nlr = 1e-3\n'),
        ("minibatch_size = 8", "minibatch_size = 16"),
        ("ppo_epochs = 1", "ppo_epochs = 2"),
        ("probe_states = 4", "probe_states = 2\neval_episodes = 32\neval_every = 10"),
        ("image_size = 64\n[model]", 'image_size = 64\ninvalid_action = "noop"\n[model]'),
    ):
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / "bc.toml"
    path.write_text(text)
    proc = _train(path, tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    db = sqlite3.connect(tmp_path / "gtr-data" / "gtr.sqlite3")
    rows = [json.loads(m) for (m,) in db.execute("SELECT metrics FROM updates ORDER BY idx")]
    start = rows[0]["eval_start/success_rate"]  # the warm start, greedy, before update 0
    final = rows[-1]["eval/success_rate"]  # the same 32 deals after the last update
    # The suite's warm start is not the same on every machine (measured 0.8125 on one, 0.25 on
    # another, each reproducible there): its 300 training steps amplify small float differences
    # (the CPU's kernels, the library builds installed). What bc must show is the lift from the
    # start it gets, to near the task's ceiling: 0.8125 -> 1.0 and 0.25 -> 0.875 measured at 6
    # updates. Ten, because lr 1e-3 on a fresh optimizer first shakes a strong start: on a CPU
    # without AVX-512 the 0.8125 start fell to 0.47-0.59 over updates 0-4 and was at 0.75 after
    # update 5, then at 1.0 from update 7 on (evaluated after every update; lr 3e-4 stayed at
    # 0.75 through update 5).
    assert final >= min(1.0, start + 0.125) and final >= 0.75, (start, final)
    assert all(r["sft_draws"] > 0 for r in rows[1:])  # it imitated the corrections
