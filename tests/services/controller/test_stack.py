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


SUPERVISED = """
import os, sys
from pathlib import Path
from services.controller.stack import Supervisor, supervise
parts = {f"part{i}": [sys.executable, "-c", "import time; time.sleep(120)"] for i in range(6)}
supervise(Supervisor(parts, dict(os.environ), Path(sys.argv[1])), lambda: print("up", flush=True))
"""


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_stop_every_part(tmp_path: Path, stop: signal.Signals) -> None:
    """A service manager's SIGTERM, or a closed terminal's SIGHUP, to `gtr up`'s supervising
    process (run_stack's own loop, here over six real processes) stops the six with it: none is
    left running under PID 1 (tests/e2e/test_up.py sends them to a whole `gtr up`)."""
    import subprocess

    up = subprocess.Popen(
        [sys.executable, "-c", SUPERVISED, str(tmp_path)],
        cwd=Path(__file__).resolve().parents[3],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert up.stdout is not None and up.stdout.readline().strip() == "up"
        parts = [
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and _parent(p) == up.pid
        ]
        assert len(parts) == 6
        up.send_signal(stop)
        assert up.wait(timeout=30) == 0  # within the parts' grace period (15 s)
        assert f"stopping ({stop.name})" in up.stdout.read()
        assert not [pid for pid in parts if _running(pid)]
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)


def _parent(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child not yet reaped counts as stopped)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
