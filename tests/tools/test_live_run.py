"""A real short `tailrace run` (trainer, two generators, a reward server as OS processes) watched by
tools/top.py, then drawn by tools/timeline.py and tools/plot.py: top shows every process, exits 0 with "run
finished" when the run ends; timeline.json is valid trace-event JSON whose spans never overlap on a track;
the PNGs are written. Run: pytest tests/tools/test_live_run.py
"""

import asyncio
import collections
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools import plot, timeline, top

ROOT = Path(__file__).resolve().parents[2]
# Long enough that every process publishes (on an idle machine 4 steps end before the second generator
# and the reward server say anything; under load 12 steps once ended before a generator whose first Hello
# went unanswered for ~8 s joined), and a batch of 4 so that both generators get work.
RUN = ["--train.steps", "24", "--train.groups_per_step", "2", "--sampling.group_size", "4",
       "--sampling.max_new_tokens", "24", "--trainer.bind", "tcp://127.0.0.1:0", "--trainer.stats_interval_s", "0.3",
       "--generator.max_batch_size", "4", "--no-progress"]


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _stop(proc):
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _address(run_dir, proc, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not (run_dir / "endpoint.json").is_file():
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
        time.sleep(0.1)
    time.sleep(0.2)  # written in one call, but read it whole
    return json.loads((run_dir / "endpoint.json").read_text())["address"]


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """(run folder, the Board top filled while all four processes ran, top's exit code and output)."""
    tmp = tmp_path_factory.mktemp("live")
    run = subprocess.Popen([sys.executable, "-m", "tailrace.engine.cli", "run", "--trainer.runs_dir", str(tmp),
                            "--trainer.run_name", "live", *RUN], cwd=tmp, env=_env(), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    top_proc = None
    try:
        address = _address(tmp / "live", run)
        top_proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "top.py"), "--connect", address,
                                     "--no-screen"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
        board = top.Board(address)
        asyncio.run(_follow_until(board))
        out, _ = run.communicate(timeout=200)
        assert run.returncode == 0, out
        top_out, _ = top_proc.communicate(timeout=30)
        yield tmp / "live", board, top_proc.returncode, top_out
    finally:
        for proc in (top_proc, run):
            if proc is not None:
                _stop(proc)


def _all_seen(board):
    roles = collections.Counter(p["role"] for p in board.processes.values())
    return roles["trainer"] == 1 and roles["generator"] >= 2 and roles["reward"] >= 1


async def _follow_until(board, timeout_s=120):
    """top.follow until the board has seen all four processes, or the run ends."""
    task = asyncio.ensure_future(top.follow(board, None, lambda: None))
    deadline = time.monotonic() + timeout_s
    while not _all_seen(board) and not task.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.timeout(300)
def test_top_shows_trainer_generators_and_reward_server_and_exits_0_at_the_end(live_run):
    from rich.console import Console

    _, board, top_code, top_out = live_run
    console = Console(record=True, width=180)
    console.print(top.view(board))
    text = console.export_text()
    for name in ("trainer", "gen-0", "gen-1", "reward-0"):
        assert f"│{name}" in text or f"{name} " in text, text
    assert "step " in text and "generator" in text and "reward" in text
    assert top_code == 0 and "run finished" in top_out, top_out


@pytest.mark.timeout(300)
def test_timeline_of_the_run_is_valid_trace_json_and_a_png(live_run, tmp_path):
    run_dir = live_run[0]
    assert timeline.main(["--run", str(run_dir), "--out", str(tmp_path)]) == 0
    trace = json.loads((tmp_path / "timeline.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert spans and all({"ph", "ts", "dur", "pid", "tid", "name"} <= e.keys() and e["dur"] >= 0 for e in spans)
    by_track = collections.defaultdict(list)
    for e in spans:
        by_track[(e["pid"], e["tid"])].append(e)
    for track in by_track.values():
        track.sort(key=lambda e: e["ts"])
        for a, b in itertools.pairwise(track):
            assert b["ts"] >= a["ts"] + a["dur"], (a, b)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert {"trainer", "gen-0", "gen-1", "reward-0"} <= names
    states = {e["name"] for e in spans}
    assert {"decode", "train_step", "scoring"} <= states
    assert any(e["ph"] == "C" for e in trace["traceEvents"])
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
def test_plot_of_the_runs_metrics_is_a_png(live_run, tmp_path):
    metrics = live_run[0] / "metrics.jsonl"
    assert plot.main([str(metrics), str(metrics), "--out", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
