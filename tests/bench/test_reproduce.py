"""bench/reproduce.py --report-only rebuilds the results page from the CSV alone, and its
conclusion follows from the numbers in that CSV (not from a hand-written sentence)."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
JUDGE = "eval/success_rate"
KEYS = [
    "group",
    "task",
    "variant",
    "arm",
    "seed",
    "update",
    "env_steps",
    "created_at",
    "eval/success_rate",
    "success_rate",
    "probe_top_thought_share",
    "probe_relevance",
]


def _write(path: Path, tasks: dict[str, tuple[dict[str, list[float]], dict[str, float]]]) -> None:
    """Per task: two updates per (arm, seed); the last holds finals[arm][seed] as its greedy
    success, and share[arm] as the probe's top-thought share (1 - share as its relevance)."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=KEYS)
        w.writeheader()
        for task, (finals, share) in tasks.items():
            for arm, values in finals.items():
                for seed, final in enumerate(values):
                    for update, sr in ((0, 0.1), (1, final)):
                        w.writerow(
                            {
                                "group": task,
                                "task": task,
                                "variant": "",
                                "arm": arm,
                                "seed": seed,
                                "update": update,
                                "env_steps": 128 * (update + 1),
                                "created_at": "",
                                "eval/success_rate": sr,
                                "success_rate": sr / 2,
                                "probe_top_thought_share": share[arm],
                                "probe_relevance": 1 - share[arm],
                            }
                        )


def test_report_only_rebuilds_the_page_from_the_csv_and_concludes_from_it(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    _write(
        results / "updates.csv",
        {
            "ezpoints": (
                {"gtr": [0.9, 0.8, 0.7], "sft_only": [0.5, 0.6, 0.4], "rl4vlm": [0.2, 0.1, 0.3]},
                {"gtr": 0.2, "sft_only": 0.2, "rl4vlm": 0.9},
            ),
            "points24": (
                {"gtr": [0.2, 0.3], "sft_only": [0.5, 0.6], "rl4vlm": [0.4, 0.4]},
                {"gtr": 0.8, "sft_only": 0.2, "rl4vlm": 0.8},
            ),
        },
    )
    (tmp_path / "results.md").write_text(
        "# Results\n\nhand-written text stays\n\n<!-- BEGIN GENERATED (bench/reproduce.py) -->\n"
        "<!-- END GENERATED -->\n\ntail stays\n"
    )
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "reproduce.py"),
            "--report-only",
            "--results",
            str(results),
            "--out",
            str(tmp_path / "no-runs-here"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert (results / "ezpoints.png").stat().st_size > 0
    page = (tmp_path / "results.md").read_text()
    assert "hand-written text stays" in page and "tail stays" in page
    # The default --tasks name numberline too; the page's budget and meta are the CSV's tasks.
    meta = json.loads((results / "meta.json").read_text())
    assert meta["tasks"] == ["ezpoints", "points24"]
    assert "points24:" in meta["budget"] and "numberline" not in meta["budget"]
    # The ordering holds on ezpoints, with RL4VLM's probe collapsed and GTR's not ...
    assert "gtr 0.80, sft_only 0.50, rl4vlm 0.20: the paper's ordering holds" in page
    assert "gtr beat sft_only on 3 of 3 seeds" in page
    assert "evaluations gtr 0.80, sft_only 0.50, rl4vlm 0.20: it holds." in page
    assert "RL4VLM's probe thoughts collapsed and GTR's did not" in page
    assert (
        "| ezpoints | gtr vs sft_only | 3 | 0.30 ± 0.10 | 3 / 0 / 0 | 0.30 ± 0.10 | 3 / 0 / 0 |"
        in page
    )
    # ... and the page says plainly where it does not (points24).
    assert "the paper's ordering does **not** hold (gtr beat sft_only on 0 of 2 seeds" in page
    assert "no collapse contrast: both collapsed" in page
    assert "**points24** (2 seeds finished by every arm, preliminary: fewer than the 3" in page
    assert "**ezpoints** (3 seeds finished by every arm; final" in page
    # A seed one arm lacks is left out of every arm's mean: the arms are compared on one set.
    _write(
        results / "updates.csv",
        {
            "g": (
                {"gtr": [0.1, 0.9], "sft_only": [0.3, 0.5], "rl4vlm": [0.2]},
                {"gtr": 0.2, "sft_only": 0.2, "rl4vlm": 0.9},
            )
        },
    )
    again = subprocess.run(out.args, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    page = (tmp_path / "results.md").read_text()
    assert "**g** (1 seed finished by every arm, preliminary" in page
    assert "seed 1 of some arms left out; final greedy success on them): gtr 0.10, " in page
    assert "sft_only 0.30, rl4vlm 0.20: the paper's ordering does **not** hold" in page
    # The wins are counted on the same seeds as the means (not on all that gtr and sft_only share).
    assert "(gtr beat sft_only on 0 of 1 seeds; sft_only beat rl4vlm on 1 of 1 seeds)" in page


def _reproduce() -> Any:
    spec = importlib.util.spec_from_file_location("reproduce", ROOT / "bench" / "reproduce.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["reproduce"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_a_run_whose_updates_are_in_the_csv_is_not_run_again(tmp_path: Path) -> None:
    """A study resumed in a new checkout (no run folders) skips the runs its CSV completes from
    the same warm start; a run recorded from another start model (another machine's warm start)
    is not a run of this study's and runs again."""
    rp = _reproduce()
    warm = tmp_path / "warm" / "ezpoints"
    warm.mkdir(parents=True)
    (warm / "model.safetensors").write_bytes(b"the weights this machine's warm start trained")
    here = rp.warm_identity(warm)["warm_start"]

    def run(arm: str, updates: int, start: str) -> list[dict[str, Any]]:
        return [
            {"task": "ezpoints", "arm": arm, "seed": 0, "variant": "", "update": u,
             "warm_start": start}
            for u in range(updates)
        ]  # fmt: skip

    # configs/repro/ezpoints.toml: 60 updates. gtr all recorded; rl4vlm cut off half-way;
    # sft_only complete, but from other weights (and an older row with no hash at all).
    rows = run("gtr", 60, here) + run("rl4vlm", 30, here) + run("sft_only", 60, "0badc0de")
    rows += [{k: v for k, v in r.items() if k != "warm_start"} for r in run("grpo", 60, "")]
    done = rp.recorded(rows, tmp_path, None)
    assert done == {"ezpoints-gtr-s0"}
    assert rp.recorded(rows, tmp_path, 30) == {"ezpoints-gtr-s0", "ezpoints-rl4vlm-s0"}
    arms = ["gtr", "rl4vlm", "sft_only", "grpo"]
    jobs = rp.train_jobs([("ezpoints", 0, "")], arms, tmp_path, None, done)
    assert [j.name for j in jobs] == [
        "ezpoints-rl4vlm-s0",
        "ezpoints-sft_only-s0",
        "ezpoints-grpo-s0",
    ]
    assert not (tmp_path / "runs" / "ezpoints-gtr-s0").exists()
    (warm / "model.safetensors").write_bytes(b"retrained")  # another start: nothing is done
    assert rp.recorded(rows, tmp_path, None) == set()
    (warm / "model.safetensors").unlink()  # none at all: nothing can match it
    unknown = run("gtr", 60, rp.warm_identity(warm)["warm_start"])
    assert rp.recorded(unknown, tmp_path, None) == set()


def test_a_run_another_driver_started_after_planning_is_not_started_again(tmp_path: Path) -> None:
    """Two reproduce.py processes whose plans overlap (a second one started to use a free core)
    each plan the same run; once one has started it, the other skips it instead of training a
    second copy into the same folder."""
    rp = _reproduce()
    items = [("ezpoints", 2, "")]
    first = rp.train_jobs(items, ["sft_only"], tmp_path, None)
    second = rp.train_jobs(items, ["sft_only"], tmp_path, None)
    assert [j.name for j in first] == [j.name for j in second] == ["ezpoints-sft_only-s2"]
    marker = tmp_path / "second-ran"
    started = rp.Job(  # the first driver's run, as far as the folder shows: its database exists
        first[0].name,
        [sys.executable, "-c", "import sys; open(sys.argv[1], 'w').close()",
         str(first[0].data_dir / "gtr.sqlite3")],
        first[0].data_dir, first[0].log,
    )  # fmt: skip
    assert set(rp.run_jobs([started], 1, tmp_path / "models")) == {started.name}
    mine = rp.Job(
        second[0].name,
        [sys.executable, "-c", "import sys; open(sys.argv[1], 'w').close()", str(marker)],
        second[0].data_dir, second[0].log,
    )  # fmt: skip
    assert rp.run_jobs([mine], 1, tmp_path / "models") == {}
    assert not marker.exists()


def test_each_pair_is_compared_once() -> None:
    rp = _reproduce()
    assert rp.pairs(["gtr", "rl4vlm"]) == [("gtr", "rl4vlm")]
    assert rp.pairs(["gtr", "sft_only", "rl4vlm", "grpo"]) == [
        ("gtr", "sft_only"),
        ("sft_only", "rl4vlm"),
        ("gtr", "rl4vlm"),
        ("grpo", "gtr"),
        ("grpo", "rl4vlm"),
    ]
    assert rp.pairs(["gtr", "grpo", "gtr_turbo"]) == [("grpo", "gtr"), ("gtr_turbo", "gtr")]


def test_collect_only_merges_a_finished_run_and_starts_nothing(
    tmp_path: Path, warm_checkpoint: Path
) -> None:
    """A study stopped part-way keeps its finished runs: --collect-only reads them into the CSV
    beside the rows already there and rebuilds the page, without starting the runs left."""
    from tests.e2e.helpers import tiny_config

    out, results = tmp_path / "out", tmp_path / "results"
    run_dir = out / "runs" / "numberline-gtr-s0"
    run_dir.mkdir(parents=True)
    results.mkdir()
    (run_dir / "config.toml").write_text(tiny_config(warm_checkpoint, envs=2, steps=4, updates=2))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GTR_")}
    env |= {"GTR_DATA_DIR": str(run_dir / "data"), "GTR_TORCH_THREADS": "1"}
    trained = subprocess.run(
        [sys.executable, "-m", "services.cli", "train", str(run_dir / "config.toml")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-2000:]
    _write(results / "updates.csv", {"ezpoints": ({"gtr": [0.5]}, {"gtr": 0.3})})
    (tmp_path / "results.md").write_text(
        "<!-- BEGIN GENERATED (bench/reproduce.py) -->\n<!-- END GENERATED -->\n"
    )
    base = [sys.executable, str(ROOT / "bench" / "reproduce.py"), "--results", str(results)]
    both = subprocess.run(
        [*base, "--collect-only", "--report-only"], capture_output=True, text=True, timeout=60
    )
    assert both.returncode != 0 and "exclude each other" in both.stderr
    collect = [*base, "--collect-only", "--out", str(out), "--tasks", "numberline"]
    done = subprocess.run(
        [*collect, "--arms", "gtr,rl4vlm", "--seeds", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    with open(results / "updates.csv") as f:
        rows = list(csv.DictReader(f))
    got = Counter((r["task"], r["arm"], r["seed"]) for r in rows)
    assert got == {("ezpoints", "gtr", "0"): 2, ("numberline", "gtr", "0"): 2}
    # The collected run names the start model it began from, and is grouped by it.
    warm = _reproduce().warm_identity(warm_checkpoint)["warm_start"]
    ours = [r for r in rows if r["task"] == "numberline"]
    assert {(r["warm_start"], r["group"]) for r in ours} == {(warm, f"numberline (warm {warm})")}
    assert not (out / "runs" / "numberline-rl4vlm-s0").exists()  # nothing was started
    assert not (out / "models").exists()  # nor a warm start
    page = (tmp_path / "results.md").read_text()
    assert "numberline" in page
    # What its final checkpoint writes on the held-out deals: decoded once, kept in the CSV.
    samples = json.loads(ours[-1]["greedy_samples"])
    assert len(samples) == 3 and all(isinstance(x["output"], str) for x in samples)
    assert len({json.dumps(x["state"]) for x in samples}) == 3  # three different deals
    assert (run_dir / "greedy_samples.json").exists()
    assert "What the final checkpoints write" in page


def test_the_kept_warm_start_is_what_a_new_machine_starts_from(tmp_path: Path) -> None:
    """The study's warm start kept in git (docs/results/warm/TASK) is installed, not retrained:
    its base folder built here, its weights loaded as they are, the same identity."""
    import torch
    from safetensors.torch import load_file

    from services.policy.service import policy_for_checkpoint

    rp = _reproduce()
    kept = ROOT / "docs" / "results" / rp.KEPT / "ezpoints"
    assert rp.warm_jobs(["ezpoints"], tmp_path, kept.parent.parent) == []  # no gtr sft to run
    dest = tmp_path / "warm" / "ezpoints"
    assert rp.warm_identity(dest) == rp.warm_identity(kept)
    policy = policy_for_checkpoint(None, dest)
    assert Path(policy.model_path).parent == tmp_path / "models"
    weights = load_file(kept / "model.safetensors")
    state = policy.model.state_dict()
    assert weights and all(torch.equal(state[k], v) for k, v in weights.items())
    # A warm start made on this machine is kept the same way, with no machine path in it.
    results = tmp_path / "results"
    rp.keep_warm("ezpoints", dest, results)
    again = results / "warm" / "ezpoints"
    assert rp.warm_identity(again) == rp.warm_identity(kept)
    assert (again / "policy.json").read_text() == (kept / "policy.json").read_text()


def test_a_metric_measured_every_k_updates_is_drawn_at_those_updates() -> None:
    """The greedy evaluation runs after update 1, every 5th and the last: its curve must be those
    points (mean over seeds, min-max band), not a line broken at every update without it."""
    rp = _reproduce()
    nan = float("nan")
    evals = {0: [nan, 0.2, nan, nan, nan, 0.4, nan], 1: [nan, 0.0, nan, nan, nan, nan, nan]}
    rows = [
        {"group": "g", "arm": "gtr", "seed": s, "update": u, "env_steps": 128 * (u + 1), JUDGE: v}
        for s, values in evals.items()
        for u, v in enumerate(values)
    ]
    rows = [{k: v for k, v in r.items() if not (isinstance(v, float) and v != v)} for r in rows]
    steps, mean, lo, hi = rp.curve(rows, "g", "gtr", JUDGE)
    assert steps == [256, 768]
    assert mean == [0.1, 0.4]
    assert (lo, hi) == ([0.0, 0.4], [0.2, 0.4])
    assert rp.curve(rows, "g", "gtr", "grad_norm/sft") == ([], [], [], [])
    assert rp.curve(rows, "g", "rl4vlm", JUDGE) == ([], [], [], [])


def test_report_only_writes_back_the_csv_it_read(tmp_path: Path) -> None:
    """Rebuilding the page must not rewrite the study's raw data: ints stay ints ("2", not
    "2.0"), floats and strings as they were."""
    rp = _reproduce()
    path = tmp_path / "updates.csv"
    text = (
        "group,task,variant,arm,seed,update,env_steps,created_at,checkpoint_id,lr,trained\n"
        "g,ezpoints,,gtr,0,1,256,2026-12-01 16:02:11,2,0.0001,True\n"
        "g,ezpoints,,gtr,0,2,384,2026-12-01 16:02:40,3.0,-1.5,\n"
    )
    path.write_text(text)
    rp.write_csv(rp.read_csv(path), path)
    assert path.read_text().replace("\r\n", "\n") == text


def test_model_outputs_on_the_page_are_escaped_cells() -> None:
    """A model writes anything: quotes, HTML, script, pipes and backticks must stay one table cell
    of inert text on the results page."""
    rp = _reproduce()
    hostile = '{"thoughts": "<script>alert(\'x\')</script> | `rm -rf` \\"q\\"", "action": "<b>"}'
    samples = [
        {
            "state": {"cards": ["H6", "S2"], "numbers": [6, 2]},
            "output": hostile,
            "reads_state": False,
        },
        {"state": {"cards": ["C4", "S8"]}, "output": "", "reads_state": True},
    ]
    rows = [{"group": "g", "arm": "gtr", "seed": 0, "greedy_samples": json.dumps(samples)}]
    md = "\n".join(rp.samples_md(rows, ["gtr"]))
    row = next(line for line in md.splitlines() if line.startswith("| gtr |"))
    assert "<script>" not in md and "&lt;script&gt;" in row and "&lt;b&gt;" in row
    assert row.count("|") == 6  # five cells: the output's pipe is an entity
    assert "cards H6 S2, numbers 6 2" in row and row.endswith("| 1 of 2 |")
    assert rp.samples_md([{"group": "g", "arm": "gtr", "seed": 0}], ["gtr"]) == []


def test_every_variant_makes_a_valid_config_for_every_arm(tmp_path: Path) -> None:
    """A variant of configs/repro/variants.toml must validate for every arm and task, or the
    study would stop at that run's start."""
    import tomllib

    from shared.schemas import RunConfig

    rp = _reproduce()
    variants = tomllib.loads((ROOT / "configs" / "repro" / "variants.toml").read_text())
    arms = tomllib.loads((ROOT / "configs" / "repro" / "arms.toml").read_text())
    assert "clip_per_loss" in variants
    for task in ("ezpoints", "points24", "numberline"):
        for variant in variants:
            for arm in arms:
                cfg = rp.run_config(task, arm, 0, tmp_path, None, variant)
                RunConfig.model_validate(tomllib.loads(rp.to_toml(cfg)))
    cfg = rp.run_config("ezpoints", "gtr", 0, tmp_path, None, "clip_per_loss")
    assert cfg["train"]["clip_per_loss"] is True


def test_the_conclusion_gives_every_arms_thought_drift_not_only_collapsed_or_not() -> None:
    """A fall in probe relevance that has not crossed the collapse line (0.3) is still reported,
    per arm, with the seeds it fell on; an arm that did cross it is named collapsed."""
    rp = _reproduce()
    relevance = {  # arm -> per seed (first update, last update)
        "gtr": [(0.8, 0.9), (0.8, 0.85)],
        "sft_only": [(0.8, 0.8), (0.8, 0.8)],
        "rl4vlm": [(0.8, 0.5), (0.8, 0.75)],
        "grpo": [(0.9, 0.1), (0.9, 0.2)],
    }
    rows = [
        {
            "group": "g",
            "arm": arm,
            "seed": seed,
            "update": update,
            JUDGE: 0.1,
            "probe_relevance": rel,
            "probe_top_thought_share": 0.1,
        }
        for arm, seeds in relevance.items()
        for seed, pair in enumerate(seeds)
        for update, rel in enumerate(pair)
    ]
    text = rp.conclusion_md(rows)
    assert "no collapse contrast: neither collapsed" in text  # RL4VLM ends at 0.62 > 0.3
    assert "gtr 0.80 → 0.88 (fell on 0 of 2)" in text
    assert "rl4vlm 0.80 → 0.62 (fell on 1 of 2)" in text  # 0.8 -> 0.75 is inside the noise
    assert "grpo 0.90 → 0.15 (fell on 2 of 2; collapsed)" in text
    assert text.endswith("Fell on every seed: grpo.")


def test_the_page_lists_every_setting_where_the_study_departs_from_the_papers() -> None:
    """Which fidelity switches the study uses: each key both TOML files set to different values
    has its row, and a key left at a default that differs from the paper's shows too."""
    import tomllib

    rp = _reproduce()
    page = "\n".join(rp.settings_md(["points24", "no-such-task"]))
    assert page.count("**points24**") == 1 and "no-such-task" not in page
    with open(ROOT / "configs/repro/points24.toml", "rb") as f:
        tiny = tomllib.load(f)["train"]
    with open(ROOT / "configs/repro/gpu/points24.toml", "rb") as f:
        gpu = tomllib.load(f)["train"]
    differ = [k for k in tiny.keys() & gpu.keys() if tiny[k] != gpu[k]]
    assert differ  # the tiny study cannot run the 7B settings: some must differ
    for key in differ:
        assert f"| `train.{key}` | <code>" in page, key
    assert "| `train.thought_coef` |" not in page  # equal on both: not listed
    # Set only in the paper's file: the study's default departs from it and is listed too.
    only_gpu = [k for k in gpu.keys() - tiny.keys() if k in ("format_reward", "dagger")]
    for key in only_gpu:
        assert f"| `train.{key}` |" in page, key


def test_report_only_without_a_csv_says_so_and_writes_no_page(tmp_path: Path) -> None:
    """A mistyped --results must not replace the page beside it with an empty study."""
    page = tmp_path / "results.md"
    page.write_text("the page as it was\n")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "reproduce.py"), "--report-only"]
        + ["--results", str(tmp_path / "reslts")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "no " in out.stderr and "updates.csv to rebuild the page from" in out.stderr
    assert "Traceback" not in out.stderr
    assert page.read_text() == "the page as it was\n"
    assert not (tmp_path / "reslts").exists()


def test_a_variant_group_is_judged_against_the_base_runs_of_the_arms_it_leaves_unchanged(
    tmp_path: Path,
) -> None:
    """clip_per_loss changes only GTR (sft_only and rl4vlm have one gradient each): the study
    runs only gtr under it, and the page pairs that with the base group's sft_only and rl4vlm."""
    rp = _reproduce()
    base, variant = "points24 (warm abc)", "points24 [clip_per_loss] (warm abc)"
    finals = {
        (base, "gtr"): [0.0, 0.1],
        (base, "sft_only"): [0.3, 0.2],
        (base, "rl4vlm"): [0.1, 0.0],
        (variant, "gtr"): [0.5, 0.4],
    }
    rows = [
        {
            "group": group,
            "task": "points24",
            "variant": "clip_per_loss" if group == variant else "",
            "warm_start": "abc",
            "arm": arm,
            "seed": seed,
            "update": update,
            JUDGE: final if update else 0.05,
            "success_rate": 0.01,
            "probe_relevance": 0.8,
            "probe_top_thought_share": 0.1,
        }
        for (group, arm), values in finals.items()
        for seed, final in enumerate(values)
        for update in (0, 1)
    ]
    # An early group without a warm-start hash borrows nothing: its base runs' start is unknown.
    rows += [r | {"group": "old [clip_per_loss]", "warm_start": ""} for r in rows[-4:]]
    meta = {"commands": [], "machine": "m", "budget": "b"}
    page = rp.generated_md(rp.with_base_runs(rows), ["gtr", "sft_only", "rl4vlm"], meta)
    line = next(x for x in page.splitlines() if x.startswith(f"- **{variant}**"))
    assert "gtr 0.45, sft_only 0.25, rl4vlm 0.05: the paper's ordering holds" in line
    assert "sft_only, rl4vlm: the base group's runs, which clip_per_loss leaves as they are" in line
    assert f"| {variant} | sft_only (base run) | 2 |" in page
    assert f"| {variant} | gtr vs sft_only | 2 | 0.20 ± 0.00 | 2 / 0 / 0 |" in page
    assert "- **old [clip_per_loss]**: not judged: no run of sft_only, rl4vlm" in page
    assert f"({len(rows)} update rows)" in page  # the raw data is what ran, not the stand-ins
    # The driver starts no run of an unchanged arm under the variant.
    jobs = rp.train_jobs(
        [("points24", 0, "clip_per_loss")], ["gtr", "sft_only", "rl4vlm"], tmp_path, 2
    )
    assert [j.name for j in jobs] == ["points24-gtr-s0-clip_per_loss"]


def test_bad_seeds_a_bad_variant_and_a_bad_unchanged_list_are_clear_errors(tmp_path: Path) -> None:
    """Each stops the driver before any run starts, with a message and no traceback."""
    script = str(ROOT / "bench" / "reproduce.py")
    base = [sys.executable, script, "--tasks", "numberline", "--arms", "gtr"]
    base += ["--out", str(tmp_path / "out"), "--results", str(tmp_path / "results")]
    for extra, message in (
        (["--seeds", "0,one"], "seeds are integers"),
        (["--seeds", "0", "--variant", "nope"], "no variant 'nope'"),
    ):
        out = subprocess.run(base + extra, capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and message in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
        assert not (tmp_path / "out").exists()  # nothing started: no warm start, no run folder
    rp = _reproduce()
    (tmp_path / "variants.toml").write_text('[v]\n"train.lr" = 1e-3\nunchanged = "rl4vlm"\n')
    (tmp_path / "arms.toml").write_text((ROOT / "configs" / "repro" / "arms.toml").read_text())
    rp.CONFIGS = tmp_path
    # a string where the arms' list belongs is refused
    with pytest.raises(SystemExit, match="unchanged = 'rl4vlm' must list arms of"):
        rp.unchanged_arms("v")
