"""The GTR paper's comparison at the tiny scale, as a study (configs/studies/paper.toml).

    .venv/bin/python bench/reproduce.py --jobs 2                 # embedded: gtr study run
    .venv/bin/python bench/reproduce.py --url URL --token TOKEN  # full stack: gtr study create
    .venv/bin/python bench/reproduce.py --plan                   # the runs it would make

A thin client of the studies feature (docs/studies.md): the platform schedules the runs (one warm
start per task and seed, shared by the arms), resumes an interrupted study, stores every
evaluation deal, and judges the arms by the primary metric the study file declares. The script
it replaced wrote docs/results/updates.csv (kept as it was: read it with any CSV reader) and a
generated block of docs/results.md; both that block and the script are in git history.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STUDY = ROOT / "configs" / "studies" / "paper.toml"


def plan(study: Path) -> list[str]:
    """One line per run of the study: task, arm, seed and env steps."""
    sys.path.insert(0, str(ROOT))
    from services.study.schemas import StudyConfig

    cfg = StudyConfig.from_toml(study)
    return [
        f"{c.task}\t{c.arm}\tseed {c.seed}\t{cfg.run_config(c).total_env_steps} env steps"
        for c in cfg.cells()
    ]


def command(study: Path, jobs: int, url: str | None, token: str | None) -> list[str]:
    gtr = [sys.executable, "-m", "services.cli", "study"]
    if url:
        return [*gtr, "create", str(study), "--url", url, *(["--token", token] if token else [])]
    return [*gtr, "run", str(study), "--jobs", str(jobs)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--study", type=Path, default=STUDY, help="study file (default: the paper's)")
    p.add_argument("--jobs", type=int, default=2, help="training processes (embedded)")
    p.add_argument("--url", help="API of a full stack: create the study there instead")
    p.add_argument("--token", help="API token (or GTR_TOKEN)")
    p.add_argument("--plan", action="store_true", help="print the runs and exit")
    args = p.parse_args(argv)
    if args.plan:
        print("\n".join(plan(args.study)))
        return 0
    return subprocess.call(
        command(args.study, args.jobs, args.url, args.token), cwd=ROOT, env=os.environ
    )


if __name__ == "__main__":
    sys.exit(main())
