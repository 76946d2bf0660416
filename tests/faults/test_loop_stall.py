"""No single message stalls the trainer's event loop (issue 15 §6): the trainer service runs in-process with
its loop-lag probe (engine/trainer/loop_probe.py); another process sends it the largest messages it accepts
(a WeightsChunk body at the size limit, a 64 MiB tensor frame, Stats with 1024 long counters, a Rollout of
2M tokens), some just over a limit (65,536 small tensors: seconds to decode before the limit) and
MessagePack bombs, one at a time, and the lag around each send is read from the probe.

The lag a loaded machine adds by itself is noise, so each case counts the smallest lag of REPEATS sends:
a message that stalls the loop stalls it every time. Run: pytest tests/faults/test_loop_stall.py
"""

import asyncio
import sys

import pytest

from tailrace.engine.config import load_config
from tailrace.engine.trainer.service import MAX_BODY_BYTES, TrainerService
from tools.benches.faultkit import ROOT, child_env
from tools.benches.fuzzframes import LARGEST

REPEATS = 2
STALL_LIMIT_MS = 50.0
SENDER = "import sys; from tools.benches.fuzzframes import send_largest_on_cue as s; s(sys.argv[1], *map(int, sys.argv[2:]))"


async def _line(stream: asyncio.StreamReader, expected: str, timeout_s: float = 60.0) -> None:
    line = (await asyncio.wait_for(stream.readline(), timeout_s)).decode()
    assert line.startswith(expected), f"the sender said {line!r}, expected {expected!r}"


async def _lags(service: TrainerService) -> dict[str, list[float]]:
    """Max loop lag (ms) seen while each LARGEST case was sent and handled, REPEATS times each."""
    sender = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SENDER, service.server.address, str(MAX_BODY_BYTES), str(REPEATS), cwd=ROOT,
        env=child_env(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    lags: dict[str, list[float]] = {name: [] for name in LARGEST}
    try:
        for name in LARGEST * REPEATS:
            await _line(sender.stdout, f"ready {name}")
            await asyncio.sleep(0.1)  # the session's Hello and Work are handled; measure from here
            service.counters["trainer/loop/max_stall_ms"] = 0.0
            sender.stdin.write(b"go\n")
            await _line(sender.stdout, f"sent {name}")
            await asyncio.sleep(0.3)  # handling it (a decode in a thread, a discard) is over by then
            lags[name].append(service.counters["trainer/loop/max_stall_ms"])
        assert await asyncio.wait_for(sender.wait(), 30) == 0
    finally:
        if sender.returncode is None:
            sender.kill()
            await sender.wait()
    return lags


@pytest.mark.timeout(240)
async def test_the_largest_messages_do_not_stall_the_trainer_loop(tmp_path):
    cfg = load_config(None, ["--train.steps", "1000", "--reward.mode", "builtin", "--trainer.bind", "tcp://127.0.0.1:0",
                             "--trainer.runs_dir", str(tmp_path), "--trainer.run_name", "stall",
                             "--controller.stall_warn_s", "600"])
    service = TrainerService(cfg)
    run = asyncio.create_task(service.run())
    try:
        while service.server is None or service.state == "starting":
            await asyncio.sleep(0.05)
        lags = await _lags(service)
    finally:
        service.request_stop("test over")
        await asyncio.wait_for(run, 60)
    lag = {name: min(ms) for name, ms in lags.items()}
    assert all(ms <= STALL_LIMIT_MS for ms in lag.values()), lag
    counters = service.server.counters
    assert counters["decoded_off_loop"] >= REPEATS * 2  # the chunk at the limit and the 1024 counters
    assert counters["bad_input/404"] >= REPEATS * 2, dict(counters)  # the 65,536 tensors and the 11 MB bomb
    assert service.controller.discarded["bad_rollout"] == REPEATS  # 2M tokens where 256 were handed out
