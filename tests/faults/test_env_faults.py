"""Environment servers under faults, with real processes: the trainer's side (transport.Server + EnvBroker) here,
the environment server a subprocess (`python -m tailrace.protocol.env_sdk slow_env:SlowEnv`). Killed with -9
while it holds a step: the step fails with env_dead as soon as the trainer declares it dead (a heartbeat
timeout, far below env.timeout_s), and so does the next step of its other episode. Frozen (SIGSTOP) past the
heartbeat timeout, then thawed: its requests failed with env_dead meanwhile; it joins again as a new session
(Error 410) and serves new episodes. Run: pytest tests/faults/test_env_faults.py
"""

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tailrace.protocol.env_broker import EnvBroker
from tailrace.protocol.messages import EnvError, EnvObservation, EnvReset, EnvStep
from tailrace.protocol.transport import Client, Server

pytestmark = pytest.mark.timeout(90)

HERE = Path(__file__).resolve().parent
HEARTBEAT_S, MISSED = 0.2, 5  # declared dead after 1 s of silence
ENV_TIMEOUT_S = 30.0  # env.timeout_s: far longer than the heartbeat timeout, so a fast answer is the death's


class Gen:
    def __init__(self, client: Client):
        self.client, self.ids, self.answers = client, itertools.count(1), {}
        self.pump = asyncio.create_task(self._pump())

    async def _pump(self):
        while True:
            msg = await self.client.recv()
            if isinstance(msg, EnvObservation | EnvError) and msg.request_id in self.answers:
                self.answers.pop(msg.request_id).set_result(msg)

    async def ask(self, msg):
        future = asyncio.get_running_loop().create_future()
        self.answers[msg.request_id] = future
        await self.client.send(msg)
        return await asyncio.wait_for(future, ENV_TIMEOUT_S + 5)

    async def reset(self, episode_id):
        return await self.ask(EnvReset(request_id=next(self.ids), episode_id=episode_id, group_id=1, sample_id=episode_id,
                                       task="slow", prompt="p", timeout_s=ENV_TIMEOUT_S))

    async def step(self, episode_id, action):
        return await self.ask(EnvStep(request_id=next(self.ids), episode_id=episode_id, action=action,
                                      timeout_s=ENV_TIMEOUT_S))


async def wait_for(what, condition, wait_s=30.0):
    deadline = time.monotonic() + wait_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def start(tmp_path):
    server = await Server("tcp://127.0.0.1:0", run_id="faults", heartbeat_interval_s=HEARTBEAT_S,
                          missed_heartbeats=MISSED).start()
    broker = EnvBroker(server, timeout_s=ENV_TIMEOUT_S, wait_for_server_s=2.0)
    log = open(tmp_path / "env.log", "w")  # noqa: SIM115  (closed by the test's finally)
    proc = subprocess.Popen([sys.executable, "-m", "tailrace.protocol.env_sdk", "slow_env:SlowEnv", "--connect",
                             server.address, "--name", "env-0", "--connect-timeout-s", "30"],
                            cwd=HERE, stdout=log, stderr=subprocess.STDOUT)
    client = Client(server.address, role="generator", name="gen-0", max_inflight=4)
    await client.connect(10.0)
    return server, broker, proc, log, Gen(client)


async def stop(server, proc, log, gen):
    gen.pump.cancel()
    await gen.client.close()
    await server.close("test over")
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    log.close()


async def test_an_env_server_killed_mid_episode_fails_its_requests_with_env_dead(tmp_path):
    server, broker, proc, log, gen = await start(tmp_path)
    try:
        await wait_for("the environment server", lambda: broker.has_server("slow"))
        assert isinstance(await gen.reset(1), EnvObservation) and isinstance(await gen.reset(2), EnvObservation)
        pending = asyncio.create_task(gen.step(1, "sleep 60"))
        await wait_for("the step to reach the server", lambda: any(s.inflight for s in broker._servers.values()))
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        reply = await pending
        took_s = time.monotonic() - killed
        assert isinstance(reply, EnvError) and reply.reason == "env_dead", reply
        assert took_s < HEARTBEAT_S * MISSED + 2.0, f"env_dead after {took_s:.1f} s"
        other = await gen.step(2, "x")  # its state died with the server: failed at once
        assert isinstance(other, EnvError) and broker.num_episodes == 0
        late = await gen.reset(3)  # no server left: waits env.wait_for_server_s (2 s) for one
        assert late.reason == "no_env_server"
    finally:
        await stop(server, proc, log, gen)


async def test_a_frozen_env_server_is_declared_dead_then_serves_again_as_a_new_session(tmp_path):
    server, broker, proc, log, gen = await start(tmp_path)
    try:
        await wait_for("the environment server", lambda: broker.has_server("slow"))
        assert isinstance(await gen.reset(1), EnvObservation)
        pending = asyncio.create_task(gen.step(1, "x"))
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            reply = await pending
            if isinstance(reply, EnvObservation):  # answered before the freeze: freeze during the next one
                pending = asyncio.create_task(gen.step(1, "y"))
                reply = await pending
            assert isinstance(reply, EnvError) and reply.reason == "env_dead", reply
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        await wait_for("the thawed server to join again", lambda: broker.has_server("slow"))
        assert isinstance(await gen.reset(2), EnvObservation)
        done = await gen.step(2, "stop")
        assert done.done and done.reward == 1.0
        assert "joining again as a new session" in (tmp_path / "env.log").read_text()
    finally:
        await stop(server, proc, log, gen)
