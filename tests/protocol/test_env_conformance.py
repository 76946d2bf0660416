"""Conformance: an environment server written here from protocol/SPEC.md ("Environment servers") alone —
pyzmq, msgpack and the standard library, nothing from protocol/ or engine/ — joins our trainer side
(transport.Server + EnvBroker) over tcp and runs a generator's episodes to their reward: handshake,
heartbeats, credits, EnvReset / EnvStep / EnvClose answered by request_id, EnvError for what it cannot do,
Shutdown. Run: pytest tests/protocol/test_env_conformance.py
"""

import ast
import asyncio
import builtins
import collections
import inspect
import os
import threading
import time

import msgpack
import pytest
import zmq

pytestmark = pytest.mark.timeout(30)

# ------------------------------------------------------------- the environment server, from SPEC.md only

VERSION = 5
KINDS = {"Hello": 1, "Welcome": 2, "Reject": 3, "EnvReset": 70, "EnvStep": 71, "EnvObservation": 72,
         "EnvError": 73, "EnvClose": 74, "Heartbeat": 60, "Shutdown": 61, "Error": 62, "Credit": 63}


class SpecEnvServer(threading.Thread):
    """Task "count": an episode is done at the third step, reward = the number of steps whose action was
    "+1"; the first observation repeats the prompt and metadata["start"]. Action "boom" is EnvError 500."""

    def __init__(self, address, name="spec-env", tasks=("count",), max_inflight=4):
        super().__init__(daemon=True, name=name)
        self.address, self.name, self.tasks, self.max_inflight = address, name, list(tasks), max_inflight
        self.header = b"TR" + bytes([VERSION])
        self.stop = threading.Event()
        self.welcomed = threading.Event()
        self.episodes = {}  # episode_id -> [steps, score]
        self.closed = []
        self.shutdown_reason = None
        self.failure = None

    def run(self):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.ROUTING_ID, b"spec-env-" + os.urandom(8).hex().encode())
        sock.connect(self.address)
        try:
            self.serve(sock)
        except BaseException as exc:  # reported to the test, which fails on it
            self.failure = exc
        finally:
            sock.close()
            ctx.term()

    def send(self, sock, kind, fields):
        sock.send_multipart([self.header + bytes([KINDS[kind]]), msgpack.packb(fields, use_bin_type=True)])

    def serve(self, sock):
        self.send(sock, "Hello", ["env", self.name, VERSION, "spec-1.0", self.tasks, self.max_inflight])
        if not sock.poll(5000):
            raise AssertionError("no answer to Hello")
        frames = sock.recv_multipart()
        if frames[0][3] != KINDS["Welcome"]:
            raise AssertionError(f"Hello answered with kind {frames[0][3]}")
        body = msgpack.unpackb(frames[1], raw=False)
        credits, interval_s = body[2], body[3]
        self.welcomed.set()
        outbox = collections.deque()
        seq, next_beat = 0, time.monotonic()
        while not self.stop.is_set():
            if time.monotonic() >= next_beat:
                self.send(sock, "Heartbeat", [seq, time.time()])
                seq += 1
                next_beat += interval_s
            while outbox and credits > 0:
                self.send(sock, *outbox.popleft())
                credits -= 1
            if not sock.poll(10):
                continue
            frames = sock.recv_multipart()
            kind, body = frames[0][3], msgpack.unpackb(frames[1], raw=False)
            if kind == KINDS["EnvReset"]:
                outbox.append(self.reset(body))
            elif kind == KINDS["EnvStep"]:
                outbox.append(self.step(body))
            elif kind == KINDS["EnvClose"]:
                self.closed.append(body[0])
                self.episodes.pop(body[0], None)
            elif kind == KINDS["Credit"]:
                credits += body[0]
            elif kind == KINDS["Shutdown"]:
                self.shutdown_reason = body[0] if body else ""
                return
            elif kind == KINDS["Error"] and body[0] in (405, 409, 410):
                return

    def reset(self, body):
        request_id, episode_id, group_id, sample_id, task, prompt = body[:6]
        metadata = body[6] if len(body) > 6 else {}
        if task not in self.tasks:
            return "EnvError", [request_id, episode_id, 407, f"task {task!r} not served", "env_error"]
        self.episodes[episode_id] = [0, 0]
        return "EnvObservation", [request_id, episode_id, f"{prompt} from {metadata.get('start')}", None, False,
                                  None, {"group": group_id, "sample": sample_id}]

    def step(self, body):
        request_id, episode_id, action = body[:3]
        state = self.episodes.get(episode_id)
        if state is None:
            return "EnvError", [request_id, episode_id, 407, f"no episode {episode_id}", "env_error"]
        if action == "boom":
            del self.episodes[episode_id]
            return "EnvError", [request_id, episode_id, 500, "boom", "env_error"]
        state[0] += 1
        state[1] += action == "+1"
        if state[0] == 3:
            del self.episodes[episode_id]
            return "EnvObservation", [request_id, episode_id, "", None, True, float(state[1]), {}]
        return "EnvObservation", [request_id, episode_id, f"step {state[0]}", None, False, None, {}]


def test_spec_env_server_uses_nothing_of_ours():
    """Every global name SpecEnvServer uses comes from pyzmq, msgpack or the standard library."""
    allowed = {"zmq", "msgpack", "threading", "collections", "time", "os", "VERSION", "KINDS"}
    tree = ast.parse(inspect.getsource(SpecEnvServer))
    local = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    local |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args}
    local |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler) and n.name}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert used - local - set(dir(builtins)) - allowed == set()


# ------------------------------------------------------------- our trainer side


async def test_spec_env_server_runs_episodes_through_the_broker():
    from tailrace.protocol.env_broker import EnvBroker
    from tailrace.protocol.messages import EnvClose, EnvError, EnvObservation, EnvReset, EnvStep
    from tailrace.protocol.transport import Client, Server

    server = await Server("tcp://127.0.0.1:0", run_id="conformance", credits=4, heartbeat_interval_s=0.05,
                          missed_heartbeats=40).start()
    spec = SpecEnvServer(server.address)
    broker = EnvBroker(server, timeout_s=5.0, wait_for_server_s=5.0,
                       prompt_of=lambda group: ("count", f"count #{group}", {"start": group * 10}))
    gen = Client(server.address, role="generator", name="gen", max_inflight=8)
    try:
        spec.start()
        assert await asyncio.to_thread(spec.welcomed.wait, 5.0)
        await gen.connect(5.0)
        waiting: dict[int, asyncio.Future] = {}

        async def pump():
            while True:
                msg = await gen.recv()
                if isinstance(msg, EnvObservation | EnvError):
                    waiting.pop(msg.request_id).set_result(msg)

        async def ask(msg):
            waiting[msg.request_id] = asyncio.get_running_loop().create_future()
            await gen.send(msg)
            return await asyncio.wait_for(waiting[msg.request_id], 5.0)

        pumping = asyncio.create_task(pump())
        ids = iter(range(1, 1000))

        async def episode(n):  # 6 episodes at once on 4 credits: Credit messages must flow both ways
            first = await ask(EnvReset(request_id=next(ids), episode_id=n, group_id=n, sample_id=0, task="", prompt=""))
            assert (first.text, first.info) == (f"count #{n} from {n * 10}", {"group": n, "sample": 0})
            rewards = []
            for action in ("+1", "0", "+1" if n % 2 else "0"):
                obs = await ask(EnvStep(request_id=next(ids), episode_id=n, action=action))
                rewards.append(obs.reward)
            assert obs.done and rewards == [None, None, 2.0 if n % 2 else 1.0]

        await asyncio.gather(*(episode(n) for n in range(6)))
        assert broker.num_episodes == 0
        await ask(EnvReset(request_id=next(ids), episode_id=9, group_id=9, sample_id=0, task="", prompt=""))
        boom = await ask(EnvStep(request_id=next(ids), episode_id=9, action="boom"))
        assert (boom.code, boom.reason, boom.text) == (500, "env_error", "spec-env: boom")
        await ask(EnvReset(request_id=next(ids), episode_id=10, group_id=10, sample_id=0, task="", prompt=""))
        await gen.send(EnvClose(episode_id=10))
        await asyncio.to_thread(lambda: [time.sleep(0.01) for _ in range(300) if not spec.closed])
        assert len(spec.closed) == 1 and broker.num_episodes == 0
        pumping.cancel()
    finally:
        await gen.close()
        await server.close("test over")
        await asyncio.to_thread(spec.join, 5.0)  # it ends on the Shutdown; stop is the backstop
        spec.stop.set()
        await asyncio.to_thread(spec.join, 5.0)
    assert spec.failure is None
    assert spec.shutdown_reason == "test over"
