"""`gtr up`'s supervisor on real processes: a killed part comes back, a crash loop stops it."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import click
import pytest

from services.controller.stack import RestartPolicy, Supervisor

SLEEP = [sys.executable, "-c", "import time; time.sleep(120)"]
CRASH = [sys.executable, "-c", "import sys; sys.exit(3)"]
FAST = {"backoff_base_s": 0.1, "backoff_max_s": 0.4}


def _until(ok, timeout_s: float = 20) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_killed_part_is_restarted_and_the_others_keep_running(tmp_path: Path) -> None:
    said: list[str] = []
    stack = Supervisor(
        {"a": SLEEP, "b": SLEEP}, dict(os.environ), tmp_path, RestartPolicy(**FAST), said.append
    )
    stack.start()
    try:
        first, other = stack.procs["a"].pid, stack.procs["b"].pid
        os.kill(first, signal.SIGKILL)

        def back() -> bool:
            stack.check()
            return stack.procs["a"].pid != first and stack.procs["a"].poll() is None

        _until(back)
        assert stack.procs["b"].pid == other and stack.procs["b"].poll() is None
        assert "a exited with code -9; restarting in 0.1 s (restart 1 of 5" in said[0]
        assert said[1].endswith(f"a restarted (pid {stack.procs['a'].pid})")
        assert (tmp_path / "a.log").read_text().splitlines() == said
    finally:
        stack.stop()
    assert all(p.poll() is not None for p in stack.procs.values())


def test_a_crash_loop_stops_the_stack_with_the_reason(tmp_path: Path) -> None:
    said: list[str] = []
    policy = RestartPolicy(max_restarts=3, window_s=60, **FAST)
    stack = Supervisor(
        {"bad": CRASH, "good": SLEEP}, dict(os.environ), tmp_path, policy, said.append
    )
    stack.start()
    try:
        with pytest.raises(click.ClickException) as e:
            stack.watch(poll_s=0.02)
    finally:
        stack.stop()
    assert e.value.message == (
        f"bad exited 4 times within 60 s (last exit code 3); stopping the stack; "
        f"see {tmp_path / 'bad.log'}"
    )
    delays = [
        line.split("restarting in ")[1].split(" s")[0] for line in said if "restarting in" in line
    ]
    assert delays == ["0.1", "0.2", "0.4"]  # doubling, capped at backoff_max_s
    assert stack.procs["good"].poll() is not None  # stop() ended the healthy part too


def test_no_restarts_stops_at_the_first_exit(tmp_path: Path) -> None:
    stack = Supervisor({"bad": CRASH}, dict(os.environ), tmp_path, RestartPolicy(max_restarts=0))
    stack.start()
    try:
        with pytest.raises(
            click.ClickException, match=r"bad exited with code 3 \(restarts are off\); stopping"
        ):
            stack.watch(poll_s=0.02)
    finally:
        stack.stop()
