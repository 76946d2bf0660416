"""tools/timeline.py from a scripted fake process on a live socket (--connect): each span lands in its
process's lane and track, two runs get separate processes, the PNG is written; tools/plot.py overlays runs.
A real run's timeline: tests/tools/test_live_run.py. Run: pytest tests/tools/test_timeline.py
"""

import json
import socket
import subprocess
import sys

import pytest

from tools import plot, timeline

SCRIPTED = """
import asyncio, sys, time
from tailrace.protocol import messages as m
from tailrace.protocol.transport import Server, run

async def main(address):
    async with Server(address, run_id="scripted", heartbeat_interval_s=0.1) as server:
        t = time.time()
        spans = {("gen-x", "generator"): [("prefill", 0.0, 0.1, "main", 0), ("decode", 0.1, 0.5, "main", 8),
                                          ("idle_parked", 0.5, 0.9, "main", 0)],
                 ("trainer", "trainer"): [("wait_data", 0.0, 0.6, "main", 0), ("train_step", 0.6, 0.9, "main", 2),
                                          ("serve_weights", 0.2, 0.3, "net", 0)]}
        while True:
            for (name, role), rows in spans.items():
                await server.publish(m.Spans(role=role, name=name, spans=[
                    m.Span(state=s, start_wall_s=t + a, duration_s=b - a, track=track, value=v)
                    for s, a, b, track, v in rows]))
            await server.publish(m.Stats(role="generator", name="gen-x", state="generating", policy_version=1,
                                         counters={"generator/queue/running": 8}, wall_s=t + 0.2))
            t += 1.0
            await asyncio.sleep(0.2)

run(main(sys.argv[1]))
"""


@pytest.fixture
def scripted_address():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    proc = subprocess.Popen([sys.executable, "-c", SCRIPTED, address])
    try:
        yield address
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(60)
def test_spans_of_a_scripted_process_land_in_their_lanes(scripted_address, tmp_path):
    assert timeline.main(["--connect", scripted_address, "--seconds", "2", "--out", str(tmp_path)]) == 0
    trace = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    process = {e["pid"]: e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    lanes = {(process[e["pid"]], thread[(e["pid"], e["tid"])], e["name"]) for e in trace if e["ph"] == "X"}
    assert lanes == {("gen-x", "main", "prefill"), ("gen-x", "main", "decode"), ("gen-x", "main", "idle_parked"),
                     ("trainer", "main", "wait_data"), ("trainer", "main", "train_step"),
                     ("trainer", "net", "serve_weights")}
    assert [e for e in trace if e["ph"] == "X" and e["name"] == "decode"][0]["args"] == {"value": 8}
    assert any(e["ph"] == "C" and e["name"] == "generator/queue/running" for e in trace)
    assert list(process.values()) == ["trainer", "gen-x"]  # the trainer's lane first
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def _records(name, start):
    return [{"kind": "span", "role": "generator", "name": name, "track": "main", "state": "decode",
             "start_wall_s": start, "duration_s": 1.0, "value": 4}]


def test_two_runs_side_by_side_keep_their_processes_apart(tmp_path):
    runs = [("sync", _records("gen-0", 100.0)), ("stream", _records("gen-0", 500.0))]
    json_path, png_path = timeline.write(runs, tmp_path)
    trace = json.loads(json_path.read_text())["traceEvents"]
    names = [e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "process_name"]
    assert names == ["sync: gen-0", "stream: gen-0"]
    assert [e["ts"] for e in trace if e["ph"] == "X"] == [0, 0]  # each run's time starts at its first span
    assert png_path.is_file()


def test_plot_overlays_runs_and_skips_panels_nobody_logged(tmp_path):
    for name, offset in (("a", 0.0), ("b", 0.2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(
            {"step": s, "trainer/reward/mean": offset + s / 10, "trainer/reward/std": 0.1,
             "trainer/loss/total": 1 / s, "eval/accuracy": s / 5}) + "\n" for s in range(1, 6)))
    runs = [(n, plot.load(tmp_path / n / "metrics.jsonl")) for n in ("a", "b")]
    assert [title for title, _ in plot._panels(runs)] == ["reward", "loss", "eval/accuracy"]
    assert plot.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_plot_draws_completion_length_and_groups_without_signal_against_wall_clock(tmp_path, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "trainer/reward/mean": 0.0, "trainer/reward/frac_zero_std": 1.0,
         "trainer/completion/mean_tokens": 3.0 + s, "trainer/completion/max_tokens": 9 + s,
         "trainer/time/elapsed_s": 2.5 * s}) + "\n" for s in range(1, 6)))
    runs = [("r", plot.load(tmp_path / "r" / "metrics.jsonl"))]
    titles = [title for title, _ in plot._panels(runs)]
    assert titles == ["reward", "groups without signal (reward std 0)", "completion tokens"]
    mean_tokens = dict(plot.PANELS)["completion tokens"][0][1]
    assert plot.points_of(runs[0][1], mean_tokens, plot.X_AXES["elapsed"][0])[:2] == [(2.5, 4.0), (5.0, 5.0)]
    assert plot.main([str(tmp_path / "r"), "--x", "elapsed", "--out", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 1000
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text(json.dumps({"step": 1, "trainer/reward/mean": 0.5}) + "\n")
    assert plot.main([str(tmp_path / "old"), "--x", "elapsed", "--out", str(tmp_path / "o.png")]) == 1
    assert "old: no trainer/time/elapsed_s in its metrics to put on the x axis (use --x step)" in capsys.readouterr().err
