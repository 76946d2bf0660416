"""`tailrace run` as a user runs it: supervised processes, Ctrl-C stops cleanly with a checkpoint and
leaves no process behind, --resume continues the run; the full default run is a `slow` test."""

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


def _run(tmp_path, *args):
    return subprocess.Popen([sys.executable, "-m", "tailrace.engine.cli", "run", "--trainer.runs_dir", str(tmp_path / "runs"),
                             *args], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _processes_mentioning(text):
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if text in line and "ps -eo" not in line]


def _metrics_steps(run_dir):
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _wait_for_steps(proc, run_dir, steps, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while _metrics_steps(run_dir) < steps:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)


@pytest.mark.timeout(280)
def test_ctrl_c_checkpoints_and_resume_continues(tmp_path):
    run_dir = tmp_path / "runs" / "cc"
    common = ["--trainer.run_name", "cc", "--train.groups_per_step", "2", "--sampling.group_size", "4",
              "--launch.num_generators", "1", "--trainer.stats_interval_s", "0.3"]
    proc = _run(tmp_path, *common, "--train.steps", "1000")
    try:
        _wait_for_steps(proc, run_dir, 3)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C does
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped_at = summary["steps"]
    assert 3 <= stopped_at < 1000 and "SIGINT" in summary["stop_reason"]
    assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())
    assert any(p.name.startswith("step_") for p in (run_dir / "checkpoint").iterdir())
    assert _processes_mentioning(str(run_dir)) == []  # trainer, generator and reward server are gone

    resumed = _run(tmp_path, *common, "--train.steps", str(stopped_at + 2), "--resume")
    out, _ = resumed.communicate(timeout=200)
    assert resumed.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == stopped_at + 2 and summary["policy_version"] == stopped_at + 2
    assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())
    assert _processes_mentioning(str(run_dir)) == []


@pytest.mark.timeout(240)
def test_run_with_curve_trains_and_admits_only_its_own_children(tmp_path):
    import zmq

    public, secret = zmq.curve_keypair()
    (tmp_path / "trainer.key").write_bytes(secret)
    run_dir = tmp_path / "runs" / "curve"
    proc = _run(tmp_path, "--trainer.run_name", "curve", "--trainer.curve_secret_key_file", str(tmp_path / "trainer.key"),
                "--train.steps", "3", "--train.groups_per_step", "2", "--sampling.group_size", "4",
                "--launch.num_generators", "1")
    try:
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["scored_by"]["server"] > 0, summary
    assert (run_dir / "keys" / "server.pub").read_bytes() == public
    allowed = (run_dir / "keys" / "clients.allow").read_text()
    assert allowed.count(" generator ") == 1 and allowed.count(" reward ") == 1 and allowed.count(" tool ") == 1
    assert _processes_mentioning(str(run_dir)) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_run_learns_within_five_minutes(tmp_path):
    start = time.monotonic()
    proc = _run(tmp_path, "--trainer.run_name", "default")
    out, _ = proc.communicate(timeout=540)
    wall_s = time.monotonic() - start
    assert proc.returncode == 0, out
    summary = json.loads((tmp_path / "runs" / "default" / "summary.json").read_text())
    assert wall_s < 300, f"tailrace run took {wall_s:.0f} s"
    assert summary["reward_last"] >= summary["reward_first"] + 0.15, summary
    assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())


@pytest.mark.timeout(280)
def test_kill_9_of_the_trainer_then_resume_accounts_exactly(tmp_path):
    """The trainer dies by kill -9 between checkpoints with samples in flight; `--resume` finishes the run
    with handed out == trained + discarded, and metrics.jsonl holds every step exactly once."""
    run_dir = tmp_path / "runs" / "k9"
    common = ["--trainer.run_name", "k9", "--train.groups_per_step", "2", "--sampling.group_size", "4",
              "--launch.num_generators", "1", "--checkpoint.every_steps", "2", "--checkpoint.keep", "5"]
    proc = _run(tmp_path, *common, "--train.steps", "1000")
    try:
        _wait_for_steps(proc, run_dir, 5)
        trainer_pid = json.loads((run_dir / "endpoint.json").read_text())["pid"]
        os.kill(trainer_pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "trainer" in out, out
    assert _processes_mentioning(str(run_dir)) == []
    checkpointed = max(int(p.name.split("_")[1]) for p in (run_dir / "checkpoint").iterdir()
                       if p.name.startswith("step_"))

    total = checkpointed + 3
    resumed = _run(tmp_path, *common, "--train.steps", str(total), "--resume")
    out, _ = resumed.communicate(timeout=200)
    assert resumed.returncode == 0, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == total
    assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, total + 1))
