"""Restarts under `tailrace run --launch.on_child_crash restart`, with real processes and kill -9: the reward
server, then a generator, are killed; the launcher restarts each once; the restarted process takes over its
session at once (no Reject 408 "name already connected"), scoring and sampling resume, and the run ends with
exact accounting and nothing scored as lost. Each wait has its own deadline; pytest-timeout bounds the rest.

Run: pytest tests/engine/test_restarts.py
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _children(launcher: subprocess.Popen) -> dict[int, str]:
    """pid -> command line of each running child of the launcher."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
    children = {}
    for line in out.splitlines()[1:]:
        pid, ppid, args = (line.split(None, 2) + [""])[:3]
        if int(ppid) == launcher.pid:
            children[int(pid)] = args
    return children


def _child_pid(launcher: subprocess.Popen, name: str) -> int | None:
    """The pid of the launcher's child started with `--name NAME`, if it runs."""
    return next((pid for pid, args in _children(launcher).items() if f"--name {name} " in args + " "), None)


def _wait(what: str, predicate, launcher: subprocess.Popen, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert launcher.poll() is None, f"the run ended while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.2)


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _count(path: Path, text: str) -> int:
    return path.read_text(errors="replace").count(text) if path.is_file() else 0


def _kill_and_see_it_return(launcher, run_dir: Path, name: str, joined_text: str, *, steps_after: int) -> None:
    log = run_dir / "logs" / f"{name}.log"
    pid = _wait(f"a running {name}", lambda: _child_pid(launcher, name), launcher, 60)
    _wait(f"{name} joined", lambda: _count(log, joined_text) >= 1, launcher, 120)
    joined_before = _count(log, joined_text)
    steps_before = _steps(run_dir)
    os.kill(pid, signal.SIGKILL)
    # The launcher restarts it; the new process is welcomed at once (seconds, not after the ~10 s the dead
    # session would take to time out, and never refused).
    new_pid = _wait(f"a restarted {name}", lambda: (p := _child_pid(launcher, name)) not in (None, pid) and p,
                    launcher, 30)
    started = time.monotonic()
    _wait(f"{name} joined again", lambda: _count(log, joined_text) > joined_before, launcher, 60)
    assert _count(log, "rejected") == 0 and _count(log, "trying again") == 0, log.read_text()[-2000:]
    startup_s = time.monotonic() - started
    _wait(f"training after {name} came back", lambda: _steps(run_dir) >= steps_before + steps_after, launcher, 120)
    assert _child_pid(launcher, name) == new_pid, f"{name} was restarted more than once"
    assert startup_s < 60


@pytest.mark.timeout(420)
def test_killed_reward_server_and_generator_are_restarted_and_take_over_their_sessions(tmp_path):
    run_dir = tmp_path / "runs" / "restarts"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "tailrace.engine.cli", "run", "--trainer.runs_dir", str(tmp_path / "runs"),
         "--trainer.run_name", "restarts", "--launch.on_child_crash", "restart", "--launch.num_generators", "1",
         "--train.steps", "1000", "--train.groups_per_step", "2",
         "--sampling.group_size", "4", "--sampling.max_new_tokens", "24", "--trainer.stats_interval_s", "0.3",
         "--no-progress"],
        cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait("the first steps", lambda: _steps(run_dir) >= 2, launcher, 180)
        _kill_and_see_it_return(launcher, run_dir, "reward-0", "serving", steps_after=2)
        _kill_and_see_it_return(launcher, run_dir, "gen-0", "connected to run", steps_after=2)
        launcher.send_signal(signal.SIGINT)
        out, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:  # a failed test: its children first (they run in sessions of their own)
            for pid in _children(launcher):
                os.kill(pid, signal.SIGKILL)
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, out
    assert out.count("crashed") == 2 and "restart 2/" not in out, out  # one restart each, both counted once
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())
    assert "no_reward_fn" not in summary["discarded"], summary["discarded"]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text()
    # Each old session ends once: taken over by its successor, or, when the restarted process needs longer
    # than the heartbeat timeout to say Hello (a loaded machine), declared dead before it comes back.
    for name in ("reward-0", "gen-0"):
        ended = trainer_log.count(f"{name!r} left: taken over by a new session") + trainer_log.count(f"{name!r} dead")
        assert ended == 1, trainer_log[-3000:]
