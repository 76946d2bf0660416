"""Conformance: a reward server written here from protocol/SPEC.md alone — pyzmq, msgpack and the standard
library, nothing from protocol/ or engine/ — joins our trainer side (transport.Server + reward.RewardRouter)
over tcp and is served and answered correctly: handshake, heartbeats both ways, credits, replies out of
order, score errors, Shutdown; a restarted one takes its session over and the old one is told to exit
(Error 409); one written from version 2 of SPEC.md is refused with a Reject it reads.
Run: pytest tests/protocol/test_conformance.py
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

# ------------------------------------------------------------- the reward server, from SPEC.md only

VERSION = 5  # Frames: "TR", the protocol version, then the kind byte
KINDS = {"Hello": 1, "Welcome": 2, "Reject": 3, "ScoreRequest": 30, "Score": 31, "ScoreError": 32,
         "Heartbeat": 60, "Shutdown": 61, "Error": 62, "Credit": 63}


class SpecRewardServer(threading.Thread):
    """Scores task "copy": 1.0 when the completion equals metadata["answer"], else 0.0, with the
    completion's length as a detail; metadata["explode"] makes it answer ScoreError 500. It holds up to
    max_inflight requests and answers them newest first, to check that replies are matched by id."""

    def __init__(self, address, name="spec-grader", tasks=("copy",), max_inflight=3, version=VERSION,
                 incarnation=None):
        super().__init__(daemon=True, name=name)
        self.address, self.name, self.tasks, self.max_inflight = address, name, list(tasks), max_inflight
        self.header = b"TR" + bytes([version])
        self.version, self.incarnation = version, incarnation
        self.rejected = None  # [code, text] of a Reject
        self.ended = None  # [code, text, ref_kind] of the Error that ended the session
        self.stop = threading.Event()
        self.welcomed = threading.Event()
        self.heard_heartbeats = threading.Event()  # 5 heartbeats from the trainer
        self.welcome = None
        self.shutdown_reason = None
        self.failure = None
        self.errors = []
        self.max_outstanding = 0
        self.credit_received = 0
        self.answered = 0

    def run(self):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.ROUTING_ID, b"spec-" + os.urandom(8).hex().encode())
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

    def receive(self, sock):
        frames = sock.recv_multipart()
        if len(frames) != 2 or len(frames[0]) != 4 or frames[0][:3] != self.header:
            raise AssertionError(f"not a version {self.version} message without tensors: {frames!r}")
        return frames[0][3], msgpack.unpackb(frames[1], raw=False)

    def serve(self, sock):
        hello = ["reward", self.name, self.version, "spec-1.0", self.tasks, self.max_inflight]
        if self.incarnation is not None:
            hello += [{}, self.incarnation]
        self.send(sock, "Hello", hello)
        if not sock.poll(5000):
            raise AssertionError("no answer to Hello")
        kind, body = self.receive(sock)
        if kind == KINDS["Reject"]:
            self.rejected = body
            return
        if kind != KINDS["Welcome"]:
            raise AssertionError(f"Hello answered with kind {kind}: {body}")
        self.welcome = body
        credits, interval_s, timeout_s = body[2], body[3], body[4]
        self.welcomed.set()
        held = []  # ScoreRequests not answered yet
        outbox = collections.deque()  # answers waiting for credit
        heartbeats_heard = seq = 0
        last_heard = next_beat = time.monotonic()
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= next_beat:
                self.send(sock, "Heartbeat", [seq, time.time()])  # takes no credit
                seq += 1
                next_beat += interval_s
            if now - last_heard > timeout_s:
                raise AssertionError(f"trainer silent for {now - last_heard:.2f} s")
            while outbox and credits > 0:
                kind_name, fields = outbox.popleft()
                self.send(sock, kind_name, fields)
                credits -= 1
                self.answered += 1
            wait_ms = max(0.0, min(next_beat - time.monotonic(), 0.01)) * 1000
            if not sock.poll(wait_ms):
                outbox.extend(self.score(r) for r in reversed(held))  # quiet moment: answer, newest first
                held.clear()
                continue
            kind, body = self.receive(sock)
            last_heard = time.monotonic()
            if kind == KINDS["ScoreRequest"]:
                held.append(body)
                self.max_outstanding = max(self.max_outstanding, len(held) + len(outbox))
                if len(held) >= self.max_inflight:
                    outbox.extend(self.score(r) for r in reversed(held))
                    held.clear()
            elif kind == KINDS["Credit"]:
                credits += body[0]
                self.credit_received += body[0]
            elif kind == KINDS["Heartbeat"]:
                heartbeats_heard += 1
                if heartbeats_heard >= 5:
                    self.heard_heartbeats.set()
            elif kind == KINDS["Shutdown"]:
                self.shutdown_reason = body[0] if body else ""
                return
            elif kind == KINDS["Error"] and body[0] in (405, 409, 410):  # the session is over
                self.ended = body
                return
            elif kind == KINDS["Error"]:
                self.errors.append(body)

    def score(self, request):
        request_id, task, prompt, completion = request[:4]
        metadata = request[4] if len(request) > 4 else {}
        if task not in self.tasks:
            return "ScoreError", [request_id, 407, f"task {task!r} not served"]
        if metadata.get("explode"):
            return "ScoreError", [request_id, 500, "the grader exploded"]
        reward = 1.0 if completion == metadata.get("answer") else 0.0
        return "Score", [request_id, reward, {"length": float(len(completion))}]


def test_spec_reward_server_uses_nothing_of_ours():
    """Every global name SpecRewardServer uses comes from pyzmq, msgpack or the standard library."""
    allowed = {"zmq", "msgpack", "threading", "collections", "time", "os", "VERSION", "KINDS"}
    tree = ast.parse(inspect.getsource(SpecRewardServer))
    local = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    local |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args}
    local |= {n.name for n in ast.walk(tree) if isinstance(n, ast.ExceptHandler) and n.name}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert used - local - set(dir(builtins)) - allowed == set()


# ------------------------------------------------------------- our trainer side


async def wait_for(event: threading.Event, what: str) -> None:
    assert await asyncio.to_thread(event.wait, 5.0), f"timed out waiting for {what}"


async def test_spec_reward_server_is_served_and_answered():
    from tailrace.protocol.reward_sdk import RewardRouter, RewardUnavailable, ScoreFailed
    from tailrace.protocol.transport import Server

    server = await Server("tcp://127.0.0.1:0", run_id="conformance", credits=4, heartbeat_interval_s=0.05,
                          missed_heartbeats=40).start()
    spec = SpecRewardServer(server.address, max_inflight=3)
    try:
        router = RewardRouter(server, retries=0, timeout_s=5.0)
        spec.start()
        await wait_for(spec.welcomed, "the Welcome")
        assert spec.welcome[0] == "conformance" and spec.welcome[2] == 4
        assert router.has_server("copy") and not router.has_server("math")

        completions = [("abc" if i % 3 else f"wrong{i}") for i in range(24)]
        scores = await asyncio.wait_for(asyncio.gather(
            *(router.score("copy", f"copy: abc #{i}", c, {"answer": "abc"}) for i, c in enumerate(completions))),
            10.0)
        assert [s.reward for s in scores] == [1.0 if c == "abc" else 0.0 for c in completions]
        assert [s.details for s in scores] == [{"length": float(len(c))} for c in completions]
        assert spec.max_outstanding == 3  # the router filled the server's window and never overfilled it
        assert spec.credit_received >= spec.answered - 4  # 24 answers on 4 credits: Credit messages flowed

        with pytest.raises(ScoreFailed, match="exploded") as info:
            await asyncio.wait_for(router.score("copy", "p", "c", {"answer": "c", "explode": True}), 5.0)
        assert info.value.code == 500
        with pytest.raises(RewardUnavailable):
            await router.score("math", "p", "c", {})

        await wait_for(spec.heard_heartbeats, "5 heartbeats from the trainer")
        (peer,) = server.peers.values()
        assert (peer.role, peer.name, peer.tasks, peer.max_inflight) == ("reward", "spec-grader", ["copy"], 3)
        assert time.monotonic() - peer.last_seen_s < server.peer_timeout_s  # its heartbeats arrive
        assert spec.failure is None and spec.errors == []
        assert server.counters["bad_input"] == 0 and server.counters["dropped/no_credit"] == 0
    finally:
        await server.close("conformance done")  # the spec server stops on this Shutdown...
        await asyncio.to_thread(spec.join, 5.0)
        spec.stop.set()  # ...or, if it missed it, on this
        await asyncio.to_thread(spec.join, 5.0)
    assert not spec.is_alive()
    assert spec.failure is None
    assert spec.shutdown_reason == "conformance done"


async def test_a_restarted_spec_reward_server_takes_its_session_over():
    """Under the same name with a larger incarnation, the new process is welcomed at once; the old one is
    told Error 409 (taken over) and stops, as SPEC.md says it must."""
    from tailrace.protocol.transport import Server

    async with Server("tcp://127.0.0.1:0", run_id="conformance", heartbeat_interval_s=0.05,
                      missed_heartbeats=40) as server:
        old = SpecRewardServer(server.address, incarnation=1)
        new = SpecRewardServer(server.address, incarnation=2)
        try:
            old.start()
            await wait_for(old.welcomed, "the first Welcome")
            new.start()
            await wait_for(new.welcomed, "the second Welcome")
            await asyncio.to_thread(old.join, 5.0)
            assert not old.is_alive() and old.failure is None
            assert old.ended is not None and old.ended[0] == 409 and "taken over" in old.ended[1]
            (peer,) = server.peers.values()
            assert peer.hello.incarnation == 2
        finally:
            old.stop.set()
            new.stop.set()
            await asyncio.to_thread(new.join, 5.0)


async def test_a_reward_server_of_version_2_reads_why_it_is_refused():
    """Written from version 2 of SPEC.md (header byte 2, `protocol_version` 2): its Hello is answered with a
    Reject in version 2's framing, which it decodes, instead of frames it cannot read."""
    from tailrace.protocol.transport import Server

    async with Server("tcp://127.0.0.1:0", run_id="conformance") as server:
        old = SpecRewardServer(server.address, version=2)
        old.start()
        await asyncio.to_thread(old.join, 5.0)
        assert not old.is_alive() and old.failure is None
        assert old.rejected == [403, f"protocol version 2 not supported; this trainer speaks {VERSION}"]
        assert not server.peers
