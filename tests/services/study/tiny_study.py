"""A tiny study the platform really runs, for the report and study-page tests: created and
scheduled by services/study/service.py, each run trained in process by the controller's
`drive` on the embedded default (the call `gtr study run` makes in its child processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.api.auth import create_token
from services.controller.loop import drive
from services.study import service
from services.study.markdown import END_MARKER
from services.study.schemas import StudyConfig
from shared.db.models import Study
from shared.db.session import session_scope
from shared.settings import get_settings
from tests.e2e.helpers import ROOT, tiny_run

# The `[tasks.numberline]` section of a study file whose runs are the smallest that train: no
# warm start, short episodes (an untrained policy's are all truncations: 3 steps of 24 tokens
# keep its evaluations short), 8 env steps an update in one minibatch and one epoch.
TINY_NUMBERLINE = """
[tasks.numberline]
config = "{base}"
[tasks.numberline.base.init]
kind = "none"
[tasks.numberline.base.env]
max_episode_steps = 3
[tasks.numberline.base.generation]
max_new_tokens = 24
[tasks.numberline.base.train]
num_envs = 2
num_steps = 4
minibatch_size = 8
ppo_epochs = 1
[tasks.numberline.base.metrics]
probe_states = {probe_states}
eval_every = {eval_every}
"""


def tiny_numberline(probe_states: int, eval_every: int) -> str:
    """TINY_NUMBERLINE on configs/numberline-tiny.toml, probing and evaluating as given."""
    base = ROOT / "configs" / "numberline-tiny.toml"
    return TINY_NUMBERLINE.format(base=base, probe_states=probe_states, eval_every=eval_every)


# Hostile names: each reaches run names, tables, the page, the CSV and the terminal.
HOSTILE_ARM = "<script>alert('arm')</script>"
QUOTED_ARM = "gtr \"quoted\" & 'single' <b>bold</b>"
HOSTILE_STUDY = "study <img src=x onerror=alert(1)> \"q\" 'r'"


@dataclass
class TinyStudy:
    study_id: int
    team: str
    read_token: str
    other_team_token: str
    arms: tuple[str, str]
    seeds: tuple[int, ...]


def run_tiny_study(
    team: str,
    seeds: tuple[int, ...] = (1, 2),
    variants: dict[str, dict[str, Any]] | None = None,
    shared_rl4vlm: bool = False,
    extra: dict[str, Any] | None = None,
    init: dict[str, Any] | None = None,
) -> TinyStudy:
    """Two arms (GTR, RL4VLM) x `seeds` on NumberLine: the session's default tiny model, no
    warm start, episodes of at most 3 steps, 1 update of 2 envs x 4 steps, evaluated on 4 deals
    after it; the probe collapse metrics (2 probe states) are recorded too. ``variants`` and
    ``shared_rl4vlm`` (the RL4VLM arm in `shared_arms`) as a study file gives them; ``extra``: more
    study-file fields (e.g. `axis`, `trends`); ``init``: the runs' [init] (default: none)."""
    base = tiny_run(Path("unused"), envs=2, steps=4, updates=1)
    base["init"] = init or {"kind": "none"}
    # Episodes of an untrained policy run to truncation: 3 steps keep its evaluation short.
    base["env"] = {**base.get("env", {}), "max_episode_steps": 3}
    if init is None:  # an untrained policy writes nothing well-formed: keep its outputs short
        base["generation"] = {**base.get("generation", {}), "max_new_tokens": 24}
    base["metrics"] = {**base.get("metrics", {}), "eval_every": 1, "probe_states": 2}
    cfg = StudyConfig.model_validate(
        {
            "name": f"{HOSTILE_STUDY} {team}",
            "tasks": {"numberline": {"base": base}},
            "arms": {QUOTED_ARM: {"algorithm": "gtr"}, HOSTILE_ARM: {"algorithm": "rl4vlm"}},
            "seeds": list(seeds),
            "eval_episodes": 4,
            "concurrency": 4,
            "secondary": [{"metric": "eval/episode_return"}],
            "variants": variants or {},
            "shared_arms": [HOSTILE_ARM] if shared_rl4vlm else [],
            **(extra or {}),
        }
    )
    with session_scope() as s:
        study_id = service.create_study(s, cfg, team).id
        read = create_token(s, f"{team}-read", "read", team)[1]
        other = create_token(s, f"{team}-other", "read", f"{team}-other")[1]
    # The embedded default, as `gtr study run` trains: no Redis, every part in process.
    embedded = get_settings().model_copy(
        update={"redis_url": None, "env_service_url": None, "policy_service_url": None}
    )
    for _ in range(10):
        with session_scope() as s:
            study = s.get(Study, study_id)
            assert study is not None
            queued = [r.id for r in service.advance(s, study)]
            if service.finished(study):
                break
        for run_id in queued:
            assert drive(run_id, settings=embedded) == "completed"
    return TinyStudy(study_id, team, read, other, (QUOTED_ARM, HOSTILE_ARM), seeds)


def gtr_cli(
    *args: str, env: dict[str, str | None] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`gtr ARGS` in a process of its own; a None in ``env`` removes that variable."""
    full = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=ROOT,
        env={k: v for k, v in full.items() if v is not None},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def page_section(page: Path, bundle: str, study_id: int = 1, brief: bool = False) -> str:
    """The part of a results page (docs/results.md, docs/results-v3.md) that it says is `gtr
    study report ID --markdown` (with ``brief``, `--markdown --brief`) on ``bundle`` (a path
    under the repository), between its two markers: what a test compares with the report it
    builds from that bundle."""
    text = page.read_text()
    kind = "--markdown --brief" if brief else "--markdown"
    begin = f"<!-- begin: gtr study report {study_id} {kind}, from {bundle} -->"
    start = text.index(begin) + len(begin) + 1
    return text[start : text.index(END_MARKER, start)]  # its own end: a page may hold two
