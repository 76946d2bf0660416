"""engine/core/run_lock.py with real processes: one owner per run folder; the next one is refused with one line
naming the owner's pid and address; the lock goes with its owner (kill -9 included), stays while a child
that inherited it lives, and a fixed port claimed by another running run of the runs folder is refused."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tailrace.engine.core import preflight, run_lock

ROOT = Path(__file__).resolve().parents[2]

# Takes the lock of argv[1], says an address, prints "held", then waits (optionally in a child that
# inherited the descriptor, as `tailrace run`'s children do, argv[2] == "child": the taker exits).
HOLDER = """
import os, subprocess, sys, time
from tailrace.engine.core import run_lock
lock = run_lock.take(__import__("pathlib").Path(sys.argv[1]), bind="tcp://127.0.0.1:5999")
lock.say(address="tcp://127.0.0.1:5999")
if sys.argv[2] == "child":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(lock.fd,))
    print(child.pid, flush=True)
    os._exit(0)
print("held", flush=True)
time.sleep(60)
"""


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop(run_lock.ENV, None)
    return env


def _hold(run_dir: Path, how: str = "self") -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), how], env=_env(), stdout=subprocess.PIPE,
                            text=True)
    return proc, proc.stdout.readline().strip()


def test_a_second_owner_is_refused_naming_the_first_and_the_lock_goes_with_a_killed_owner(tmp_path):
    run_dir = tmp_path / "runs" / "one"
    holder, said = _hold(run_dir)
    try:
        assert said == "held"
        with pytest.raises(ValueError) as refused:
            run_lock.take(run_dir, bind="tcp://127.0.0.1:0")
        text = str(refused.value)
        assert text.startswith(f"trainer.run_name: {run_dir} is in use by another run (pid {holder.pid} on ")
        assert "trainer at tcp://127.0.0.1:5999" in text and "\n" not in text
        holder.kill()  # kill -9: no handler runs, the kernel drops the lock
        holder.wait()
        lock = run_lock.take(run_dir, bind="tcp://127.0.0.1:0")
        assert run_lock.take(run_dir, bind="tcp://127.0.0.1:0") is lock  # this process holds it already
        lock.release()
    finally:
        holder.kill()
        holder.wait()


def test_a_child_that_inherited_the_lock_keeps_the_folder_after_its_launcher_died(tmp_path):
    run_dir = tmp_path / "runs" / "two"
    taker, child_pid = _hold(run_dir, "child")
    child_pid = int(child_pid)
    try:
        taker.wait(timeout=30)
        with pytest.raises(ValueError) as refused:
            run_lock.take(run_dir, bind="tcp://127.0.0.1:0")
        assert (f"(pid {taker.pid} on {socket.gethostname()}, which has exited while a process it started holds "
                f"the folder (`fuser {run_dir.resolve() / 'run.lock'}` names it)") in str(refused.value)
    finally:
        os.kill(child_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:  # the child is gone once init has reaped it
        try:
            run_lock.take(run_dir, bind="tcp://127.0.0.1:0").release()
            break
        except ValueError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_launcher_hands_the_lock_to_its_children_by_environment(tmp_path, monkeypatch):
    run_dir = tmp_path / "runs" / "three"
    run_dir.mkdir(parents=True)
    monkeypatch.setenv(run_lock.ENV, str((run_dir / run_lock.FILE_NAME).resolve()))
    assert run_lock.take(run_dir, bind="tcp://127.0.0.1:0") is None


def test_a_fixed_port_of_another_running_run_is_refused_before_it_is_bound(tmp_path):
    runs = tmp_path / "runs"
    holder, said = _hold(runs / "first")
    try:
        assert said == "held"
        with pytest.raises(ValueError, match=rf"^trainer.bind: tcp://127.0.0.1:5999 is the port of another run, in "
                                             rf"{runs / 'first'} \(pid {holder.pid} on "):
            preflight.check_port_unclaimed(runs, "tcp://127.0.0.1:5999", runs / "second")
        with pytest.raises(ValueError, match="is the port of another run"):
            preflight.check_port_unclaimed(runs, "tcp://*:5999", runs / "second")
        preflight.check_port_unclaimed(runs, "tcp://127.0.0.1:5998", runs / "second")
        preflight.check_port_unclaimed(runs, "tcp://127.0.0.1:0", runs / "second")
        preflight.check_port_unclaimed(runs, "tcp://127.0.0.1:5999", runs / "first")  # its own resume
    finally:
        holder.kill()
        holder.wait()
    preflight.check_port_unclaimed(runs, "tcp://127.0.0.1:5999", runs / "second")  # that run has ended
