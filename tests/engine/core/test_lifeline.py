"""engine/core/lifeline.py with real processes: a child started with TAILRACE_LAUNCHER_PID gets SIGTERM when its
launcher dies by kill -9, says so in its stop reason, and does not hand the variable on; a child whose
launcher was gone before it looked stops at once; a process not started by a launcher is left alone."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# The child: follows its launcher, then waits for a stop signal and writes what it got.
CHILD = """
import os, signal, sys, time
from tailrace.engine.core import lifeline
if sys.argv[2] == "watch":  # the parent-pid thread that stands in for PR_SET_PDEATHSIG off Linux
    lifeline._kernel_signals_death = lambda: False
launcher = lifeline.follow_launcher()
out = sys.argv[1]
def stop(signum, frame):
    with open(out, "w") as f:
        f.write(f"{lifeline.stop_reason(signum)}|{os.environ.get(lifeline.LAUNCHER_PID_ENV, '')}")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(out + ".ready", "w").write(str(launcher))
time.sleep(60)
"""

# The launcher: starts the child as `tailrace run` does (its own session, lifeline.child_env), prints its pid.
LAUNCHER = """
import os, subprocess, sys, time
from tailrace.engine.core import lifeline
child = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]], start_new_session=True,
                         env=lifeline.child_env(dict(os.environ)))
print(child.pid, flush=True)
time.sleep(60)
"""


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TAILRACE_LAUNCHER_PID", None)
    return env


def _wait_for(path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.is_file() or not path.read_text():
        assert time.monotonic() < deadline, f"no {path.name} within {timeout_s} s"
        time.sleep(0.05)
    return path.read_text()


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["kernel", "watch"])
def test_a_child_stops_with_sigterm_when_its_launcher_is_killed_9(tmp_path, how):
    out = tmp_path / "child.out"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, CHILD, str(out), how], env=_env(),
                                stdout=subprocess.PIPE, text=True)
    child_pid = int(launcher.stdout.readline())
    try:
        assert _wait_for(Path(f"{out}.ready"), 30) == str(launcher.pid)
        assert not out.exists()  # nothing asked it to stop while its launcher lives
        launcher.kill()
        launcher.wait()
        reason, _, handed_on = _wait_for(out, 10).partition("|")
        assert reason == f"signal SIGTERM: its launcher (pid {launcher.pid}) died"
        assert handed_on == ""  # taken out of the environment: its own children do not follow it
        assert _gone(child_pid, 10)
    finally:
        if not _gone(child_pid, 0):
            os.kill(child_pid, signal.SIGKILL)


def test_a_child_whose_launcher_is_already_gone_stops_at_once(tmp_path):
    """The launcher died between starting the child and the child's request: the parent pid check sees it,
    before the child got anywhere (here: before it installed a handler, so SIGTERM's default ends it)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "child.out"), "kernel"],
                             env=_env() | {"TAILRACE_LAUNCHER_PID": str(dead.pid)})
    try:
        assert child.wait(timeout=30) == -signal.SIGTERM
        assert not (tmp_path / "child.out.ready").exists()
    finally:
        if child.poll() is None:
            child.kill()


def test_without_a_launcher_nothing_changes(monkeypatch):
    from tailrace.engine.core import lifeline

    monkeypatch.delenv(lifeline.LAUNCHER_PID_ENV, raising=False)
    assert lifeline.follow_launcher() is None
    assert lifeline.stop_reason(signal.SIGTERM) == "signal SIGTERM"
    assert lifeline.stop_reason(signal.SIGHUP) == "signal SIGHUP"
