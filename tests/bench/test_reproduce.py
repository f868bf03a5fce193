"""bench/reproduce.py is a thin client of the studies feature: its study file is the paper's
comparison with the reproduction's arms, and the CSV history it once wrote stays readable."""

from __future__ import annotations

import csv
import subprocess
import sys
import tomllib
from collections import Counter
from pathlib import Path

from bench.reproduce import STUDY, command
from services.study.schemas import Cell, StudyConfig

ROOT = Path(__file__).resolve().parents[2]


def test_plan_lists_every_run_of_the_paper_study() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "reproduce.py"), "--plan"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split("\t") for line in out.stdout.splitlines()]
    cells = Counter((task, arm) for task, arm, _, _ in rows)
    assert set(cells) == {
        (t, a)
        for t in ("ezpoints", "points24", "numberline")
        for a in ("gtr", "rl4vlm", "sft_only", "gtr_noise")
    }
    assert set(cells.values()) == {8}  # eight seeds per cell


def test_the_paper_study_makes_the_reproductions_arms() -> None:
    """Each arm changes what configs/repro/arms.toml says it changes, and nothing else."""
    cfg = StudyConfig.from_toml(STUDY)
    with open(ROOT / "configs" / "repro" / "arms.toml", "rb") as f:
        arms = tomllib.load(f)
    for task in cfg.tasks:
        base = cfg.run_config(Cell(task, "gtr", 0)).model_dump()
        for arm in cfg.arms:
            run = cfg.run_config(Cell(task, arm, 0)).model_dump()
            changed = {
                f"{section}.{key}"
                for section, values in run.items()
                if isinstance(values, dict)
                for key, value in values.items()
                if base[section][key] != value
            } | {k for k, v in run.items() if not isinstance(v, dict) and base[k] != v}
            expected = {k for k in arms[arm] if k != "description"} - {"algorithm"}
            assert changed - {"name", "algorithm"} <= expected, (task, arm, changed)
            assert run["algorithm"] == arms[arm]["algorithm"]
        assert cfg.run_config(Cell(task, "gtr", 0)).init.kind == "warm_start"


def test_the_csv_history_stays_readable() -> None:
    for path in (ROOT / "docs/results/updates.csv", ROOT / "docs/results/v1/updates.csv"):
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        assert rows, path
        assert {"task", "arm", "seed", "update", "success_rate"} <= set(rows[0])
        assert {"gtr", "rl4vlm", "sft_only"} <= {r["arm"] for r in rows}
        judged = "eval/success_rate" if "eval/success_rate" in rows[0] else "success_rate"
        values = [float(r[judged]) for r in rows if r[judged]]
        assert values and all(0.0 <= x <= 1.0 for x in values)


def test_the_client_calls_gtr_study() -> None:
    assert command(STUDY, 3, None, None)[-4:] == ["run", str(STUDY), "--jobs", "3"]
    remote = command(STUDY, 3, "http://h:8000", "tok")
    assert remote[-6:] == ["create", str(STUDY), "--url", "http://h:8000", "--token", "tok"]
