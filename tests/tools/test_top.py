"""tools/top.py: the text view (one line per process, trainer first, speculation where it runs), the live
view's rows, progress and events, and following a trainer that is killed and comes back.

Run: pytest tests/tools/test_top.py   (a real run with top beside it: tests/tools/test_live_run.py)
"""

import asyncio
import signal
import socket
import subprocess
import sys

import pytest

from tailrace.protocol import messages as m
from tools import top


def test_render_lists_processes_with_their_highlights():
    plain = {"generator/queue/running": 3, "generator/queue/waiting": 1, "generator/throughput/wall_tokens_per_s": 812}
    spec = {**plain, "generator/spec/spec_steps": 40, "generator/spec/mean_accept_len": 3.25,
            "generator/spec/accept_rate": 0.81, "generator/spec/drafter_version": 2}
    trainer = {"trainer/step": 4, "trainer/steps_total": 150, "trainer/reward/last": 0.5}
    snapshot = {"run_id": "r", "address": "tcp://127.0.0.1:1", "processes": {
        "gen-b": {"role": "generator", "state": "generating", "policy_version": 4, "wall_s": 1.0, "counters": spec},
        "gen-a": {"role": "generator", "state": "idle", "policy_version": 3, "wall_s": 1.0, "counters": plain},
        "trainer": {"role": "trainer", "state": "training", "policy_version": 4, "wall_s": 1.0, "counters": trainer}}}
    lines = top.render(snapshot).splitlines()
    assert lines[0] == "run r at tcp://127.0.0.1:1"
    assert [line.split()[0] for line in lines[2:]] == ["trainer", "gen-a", "gen-b"]
    assert "step 4/150" in lines[2] and "reward 0.500" in lines[2]
    assert "812 tok/s" in lines[3] and "spec" not in lines[3]
    assert "spec: 3.25 drafts accepted/step (81%), drafter v2" in lines[4]


def test_reward_and_environment_servers_show_their_requests_after_the_generators():
    def server(role):
        return {"role": role, "state": "idle", "policy_version": 0, "wall_s": 1.0, "counters": {
            f"{role}/requests/answered": 12, f"{role}/requests/in_flight": 2, f"{role}/latency/mean_s": 0.004,
            f"{role}/requests/errors": 1}}
    snapshot = {"run_id": "r", "address": "a", "processes": {
        "env-0": server("env"), "grader": server("reward"),
        "gen-0": {"role": "generator", "state": "idle", "policy_version": 0, "wall_s": 1.0,
                  "counters": {"generator/env/waiting": 5}}}}
    lines = top.render(snapshot).splitlines()[2:]
    assert [line.split()[0] for line in lines] == ["gen-0", "grader", "env-0"]
    assert "waiting 0  on env 5" in lines[0]  # multi-turn rows parked on the environment's answer
    for line in lines[1:]:
        assert "answered 12  in flight 2  latency 4.0 ms  errors 1" in line
        assert line.split()[2:4] == ["idle", "answered"]  # no policy version: the servers hold no model
    cells = top._cells("generator", snapshot["processes"]["gen-0"]["counters"])
    assert cells[0] == "0 waiting / 0 items / on env 5"
    assert [top.version_of(p) for _, p in top._ordered(snapshot["processes"])] == ["0", "", ""]


# ---------------------------------------------------------------------------------------- reconnecting

FAKE_TRAINER = """
import asyncio, sys, time
from tailrace.protocol import messages as m
from tailrace.protocol.transport import Server, run

async def main(address, run_id, finish_after_s):
    async with Server(address, run_id=run_id, heartbeat_interval_s=0.1, missed_heartbeats=5) as server:
        deadline = time.monotonic() + finish_after_s
        while time.monotonic() < deadline:
            await server.publish(m.Stats(role="trainer", name="trainer", state="training", policy_version=1,
                                         counters={"trainer/step": 1, "trainer/reward/last": 0.5}, wall_s=time.time()))
            await asyncio.sleep(0.1)
        await server.close("run finished")  # Shutdown to every peer and subscriber

run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_trainer(address, run_id, finish_after_s):
    return subprocess.Popen([sys.executable, "-c", FAKE_TRAINER, address, run_id, str(finish_after_s)])


@pytest.mark.timeout(90)
def test_follow_reconnects_after_the_trainer_is_killed_and_ends_when_the_run_finishes():
    address = f"tcp://127.0.0.1:{_free_port()}"
    first = _fake_trainer(address, "first", 600)
    second = None
    seen = []
    board = top.Board(address)

    def on_change():
        seen.append((board.run_id, board.status))

    async def scenario():
        nonlocal second
        following = asyncio.ensure_future(top.follow(board, None, on_change))
        while "trainer" not in board.processes:
            await asyncio.sleep(0.05)
        first.send_signal(signal.SIGKILL)  # no Shutdown: top must notice the loss and come back
        first.wait()
        while "reconnecting" not in board.status:
            await asyncio.sleep(0.05)
        second = _fake_trainer(address, "second", 3)
        await asyncio.wait_for(following, timeout=60)

    try:
        asyncio.run(asyncio.wait_for(scenario(), timeout=80))
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert ("first", "connected") in seen and ("second", "connected") in seen
    assert board.finished == "run finished"


def test_live_view_shows_rows_progress_and_events():
    from rich.console import Console

    board = top.Board("tcp://127.0.0.1:1", run_id="r")
    for step, reward in enumerate([0.1, 0.4, 0.3, 0.8], start=1):
        board.on(m.Stats(role="trainer", name="trainer", state="training", policy_version=step, wall_s=1.0,
                         counters={"trainer/step": step, "trainer/steps_total": 10, "trainer/reward/last": reward,
                                   "trainer/loss/last": 0.25, "trainer/replay/saving": 2.5}))
    board.on(m.Stats(role="reward", name="grader", state="scoring", policy_version=0,
                     counters={"reward/requests/answered": 7, "reward/requests/in_flight": 2}))
    board.on(m.Event(role="trainer", name="trainer", event="peer_dead", text="generator gen-9 dead",
                     fields={"peer": "grader"}, wall_s=1.0))
    console = Console(record=True, width=170)
    console.print(top.view(board))
    text = console.export_text()
    assert "step 4/10" in text and "reward 0.800 " + top.sparkline([0.1, 0.4, 0.3, 0.8]) in text
    assert "loss 0.2500" in text and "replay saving 2.50x" in text
    assert "grader" in text and "dead" in text and "generator gen-9 dead" in text
    header = next(line for line in text.splitlines() if "spec acc/depth" in line)
    grader = next(line for line in text.splitlines() if "grader" in line and " reward " in line)
    assert grader.index("7 ans, 0 ms, 0 err") == header.index("scored")  # its own column, not speculation's
    assert not grader[header.index("spec acc/depth"):header.index("drafter")].strip(" │┃|")
    assert top.sparkline([0.0, 1.0]) == "▁█"
