"""Transport on live endpoints: handshake, messages both ways, notices, credits, liveness, bad input, CURVE.
Most tests run over inproc (the in-process twin) and tcp loopback with the same code.
Run: pytest tests/protocol/test_transport.py
"""

import asyncio
import random
import sys
import time
import uuid

import msgpack
import pytest
import torch
import uvloop
import zmq
import zmq.asyncio

from tailrace.protocol import codec
from tailrace.protocol.codec import Limits
from tailrace.protocol.messages import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Event,
    Heartbeat,
    Hello,
    Reject,
    Shutdown,
    Stats,
    WeightsChunk,
    Welcome,
    WorkRequest,
)
from tailrace.protocol.transport import (
    Client,
    ConnectionLost,
    ConnectTimeout,
    PeerEvent,
    Rejected,
    Server,
    generate_keypair,
    run,
)

TRV = b"TR" + bytes((PROTOCOL_VERSION,))  # a header's magic and this protocol version

pytestmark = [pytest.mark.timeout(30), pytest.mark.filterwarnings("ignore:The given buffer is not writable")]

TR = b"TR" + bytes((PROTOCOL_VERSION,))  # a header of this version, less its kind byte
WAIT_S = 5.0  # upper bound for anything that should happen "soon"; tests fail fast instead of hanging


@pytest.fixture
def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture(params=["inproc", "tcp"])
def address(request):
    if request.param == "inproc":
        return f"inproc://test-{uuid.uuid4().hex}"
    return "tcp://127.0.0.1:0"


def stats(i: int = 0) -> Stats:
    return Stats(role="generator", name="g", state="idle", policy_version=i)


class RawPeer:
    """A DEALER that speaks raw frames, to send what a well-behaved Client never would."""

    def __init__(self, ctx, address: str):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    async def send(self, *frames: bytes) -> None:
        await self.sock.send_multipart(list(frames))

    async def send_msg(self, msg) -> None:
        await self.sock.send_multipart(codec.encode(msg))

    async def recv_msg(self, timeout_s: float = WAIT_S):
        return codec.decode(await asyncio.wait_for(self.sock.recv_multipart(), timeout_s))

    async def recv_until(self, kind: type, timeout_s: float = WAIT_S) -> tuple[object, list]:
        """Receive until a message of `kind`; returns it and the messages before it (heartbeats dropped)."""
        before = []
        while True:
            msg = await self.recv_msg(timeout_s)
            if isinstance(msg, kind):
                return msg, before
            if not isinstance(msg, Heartbeat):
                before.append(msg)

    async def hello(self, name: str) -> Welcome:
        await self.send_msg(Hello(role="generator", name=name, protocol_version=PROTOCOL_VERSION,
                                  package_version="test"))
        welcome, _ = await self.recv_until(Welcome)
        return welcome

    def close(self) -> None:
        self.sock.close(linger=0)


async def next_event(server: Server, kind: str, name: str | None = None) -> PeerEvent:
    """Skip inbox items until a PeerEvent of this kind (and peer name)."""
    while True:
        peer, msg = await asyncio.wait_for(server.recv(), WAIT_S)
        if msg is None and peer.event == kind and (name is None or peer.name == name):
            return peer


async def next_message(server: Server):
    while True:
        peer, msg = await asyncio.wait_for(server.recv(), WAIT_S)
        if msg is not None:
            return peer, msg


# ---------------------------------------------------------------------------------------- basics


async def test_roundtrip_messages_and_notices(ctx, address):
    async with Server(address, run_id="run-1", policy_version=lambda: 7, credits=8, context=ctx) as server:
        assert "://" in server.address and not server.address.endswith(":*")
        async with Client(server.address, role="generator", name="gen-0", max_inflight=4,
                          capabilities={"vocab_size": 256}, context=ctx) as client:
            welcome = await client.connect(timeout_s=WAIT_S)
            assert (welcome.run_id, welcome.policy_version, welcome.credits) == ("run-1", 7, 8)
            assert welcome.notice_endpoint == server.notice_address
            joined = await next_event(server, "joined")
            assert (joined.name, joined.role, joined.peer.max_inflight) == ("gen-0", "generator", 4)
            assert joined.peer.hello.capabilities == {"vocab_size": 256}
            assert server.peers[joined.id].name == "gen-0"

            for i in range(20):  # more than the credits: needs Credit messages back to finish
                await client.send(WorkRequest(capacity=i, policy_version=7))
                peer, msg = await next_message(server)
                assert (peer.name, msg) == ("gen-0", WorkRequest(capacity=i, policy_version=7))

            for i in range(3):  # the server side sends without credit; the order is kept
                assert await server.send(joined.id, Error(code=407, text=str(i)))
                assert server.send_nowait(joined.id, stats(i))
            got = [await asyncio.wait_for(client.recv(), WAIT_S) for _ in range(6)]
            assert got == [m for i in range(3) for m in (Error(code=407, text=str(i)), stats(i))]

            await client.subscribe()
            notice = Event(role="trainer", name="trainer", event="hello")
            got = asyncio.create_task(client.recv_notice())
            while not got.done():  # SUB joins asynchronously: publish until it hears one
                await server.publish(notice)
                await asyncio.wait({got}, timeout=0.02)
            assert got.result() == notice
        left = await next_event(server, "left", "gen-0")
        assert left.id not in server.peers
    assert server.counters["bad_input"] == 0


async def test_ipc_address(ctx, tmp_path):
    async with Server(f"ipc://{tmp_path}/trainer", run_id="r", context=ctx) as server:
        async with Client(server.address, role="tool", name="t", context=ctx) as client:
            welcome = await client.connect(timeout_s=WAIT_S)
            assert welcome.notice_endpoint == f"ipc://{tmp_path}/trainer.notice"


async def test_large_tensor_both_ways_zero_copy_frames(ctx):
    weights = torch.randn(1 << 21)  # 8 MB: its own frame, sent without copying
    chunk = WeightsChunk(model="policy", version=1, chunk_index=0, num_chunks=1, tensors={"w": weights})
    async with Server("tcp://127.0.0.1:0", run_id="r", context=ctx) as server:
        async with Client(server.address, role="generator", name="g", context=ctx) as client:
            await client.connect(timeout_s=WAIT_S)
            peer = await next_event(server, "joined")
            await client.send(chunk)
            _, got = await next_message(server)
            assert torch.equal(got.tensors["w"], weights)
            await server.send(peer.id, chunk)
            back = await asyncio.wait_for(client.recv(), WAIT_S)
            assert torch.equal(back.tensors["w"], weights)


async def test_credit_flow_blocks_sender_until_owner_consumes(ctx, address):
    async with Server(address, run_id="r", credits=4, context=ctx) as server:
        async with Client(server.address, role="generator", name="g", context=ctx) as client:
            await client.connect(timeout_s=WAIT_S)
            await next_event(server, "joined")
            sender = asyncio.create_task(client.send_many(stats(i) for i in range(10)))
            while client.credits > 0 or server.num_queued < 4:
                await asyncio.sleep(0)  # let the 4 credited messages through; the 5th must wait
            await asyncio.wait({sender}, timeout=0.05)
            assert not sender.done() and client.credits == 0
            assert not client.send_nowait(stats(99))  # no credit: refused, not queued
            got = [(await next_message(server))[1].policy_version for _ in range(10)]
            await asyncio.wait_for(sender, WAIT_S)
            assert got == list(range(10))
            assert server.counters["dropped/no_credit"] == 0


async def test_shutdown_from_server_then_connection_lost(ctx, address):
    server = await Server(address, run_id="r", context=ctx).start()
    async with Client(server.address, role="generator", name="g", context=ctx) as client:
        await client.connect(timeout_s=WAIT_S)
        await server.close("run finished")
        assert await asyncio.wait_for(client.recv(), WAIT_S) == Shutdown(reason="run finished")
        with pytest.raises(ConnectionLost, match="run finished"):
            await asyncio.wait_for(client.recv(), WAIT_S)
        with pytest.raises(ConnectionLost):
            await client.send(stats())


async def test_rejects_stale_incarnation_trainer_role_and_accept_hook(ctx, address):
    def accept(hello: Hello) -> Reject | None:
        return Reject(code=ErrorCode.UNAUTHORIZED, text="no tools today") if hello.role == "tool" else None

    async with Server(address, run_id="r", accept=accept, context=ctx) as server:
        async with Client(server.address, role="generator", name="dup", context=ctx, incarnation=5) as first:
            await first.connect(timeout_s=WAIT_S)
            for role, name, text in [("generator", "dup", "newer incarnation"), ("trainer", "x", "trainer"),
                                     ("tool", "top", "no tools today"), ("generator", "", "empty")]:
                client = Client(server.address, role=role, name=name, context=ctx, incarnation=4)
                with pytest.raises(Rejected, match=text) as info:
                    await client.connect(timeout_s=WAIT_S)
                assert info.value.code == ErrorCode.UNAUTHORIZED
            assert [p.name for p in server.peers.values()] == ["dup"]


async def test_max_peers_and_sends_to_unknown_peers(ctx, address):
    async with Server(address, run_id="r", max_peers=1, context=ctx) as server:
        async with Client(server.address, role="generator", name="one", context=ctx) as one:
            await one.connect(timeout_s=WAIT_S)
            with pytest.raises(Rejected, match="at most 1 peers"):
                await Client(server.address, role="tool", name="two", context=ctx).connect(timeout_s=WAIT_S)
        await next_event(server, "left", "one")
        assert not server.send_nowait(b"nobody", stats()) and not await server.send(b"nobody", stats())
        assert server.counters["send_failed/unknown_peer"] == 2


def test_run_uses_uvloop():
    async def loop_type():
        return type(asyncio.get_running_loop())

    assert run(loop_type()) is uvloop.Loop


def test_constructor_checks_arguments():
    with pytest.raises(ValueError, match="credits"):
        Server(run_id="r", credits=0)
    with pytest.raises(ValueError, match="address"):
        Server("udp://1.2.3.4:5", run_id="r")
    with pytest.raises(ValueError, match="role"):
        Client("tcp://127.0.0.1:1", role="boss", name="x")


# ---------------------------------------------------------------------------------------- bad input


async def test_bad_input_answered_with_errors_and_server_keeps_serving(ctx, address):
    limits = Limits(max_body_bytes=4096)
    async with Server(address, run_id="r", limits=limits, context=ctx) as server:
        heartbeat = codec.encode(Heartbeat(seq=1))
        cases = [  # (frames, expected reply kind, code, ref_kind)
            ([b""], Error, ErrorCode.BAD_FRAME, 0),  # empty message
            (heartbeat[:1], Error, ErrorCode.BAD_FRAME, 60),  # truncated: header only
            ([TR, heartbeat[1]], Error, ErrorCode.BAD_FRAME, 0),  # truncated header
            ([b"XX\x02\x3c", heartbeat[1]], Error, ErrorCode.BAD_FRAME, 0),  # not our magic
            ([b"TR" + bytes((PROTOCOL_VERSION + 1, 60)), heartbeat[1]], Error, ErrorCode.VERSION_MISMATCH, 60),
            ([TR + b"\xc8", heartbeat[1]], Error, ErrorCode.UNKNOWN_KIND, 200),
            ([heartbeat[0], b"\xc1\xff"], Error, ErrorCode.BAD_FIELD, 60),  # not MessagePack
            ([heartbeat[0], heartbeat[1], b"extra"], Error, ErrorCode.BAD_FRAME, 60),
            ([heartbeat[0], b"\x00" * 5000], Error, ErrorCode.TOO_LARGE, 60),  # over max_body_bytes
            (heartbeat, Error, ErrorCode.NOT_WELCOME, 60),  # valid, but before Hello
            # a Hello of another version, unreadable or not: Reject, in the header's version
            ([b"TR" + bytes((PROTOCOL_VERSION + 1, 1)), b"\x90"], Reject, ErrorCode.VERSION_MISMATCH, 0),
            ([b"TR" + bytes((1, 1)), b"\x90"], Reject, ErrorCode.VERSION_MISMATCH, 0),
            (codec.encode(Hello(role="generator", name="next", protocol_version=PROTOCOL_VERSION + 1,
                                package_version="9")), Reject, ErrorCode.VERSION_MISMATCH, 0),
        ]
        for frames, kind, code, ref_kind in cases:
            raw = RawPeer(ctx, server.address)
            await raw.send(*frames)
            answer = await asyncio.wait_for(raw.sock.recv_multipart(), WAIT_S)
            if kind is Reject:  # framed in the version of the Hello's header (SPEC.md, "Versions")
                version, reply = codec.decode_any_version(answer)
                assert version == frames[0][2], answer
            else:
                reply = codec.decode(answer)
            assert type(reply) is kind and reply.code == code, (frames, reply)
            if kind is Error:
                assert reply.ref_kind == ref_kind, reply
            raw.close()

        # wrong field types and bounds from a welcomed peer
        raw = RawPeer(ctx, server.address)
        await raw.hello("typed")
        for body in ([b"not-an-int"], ["x", 1.0], [-1], [1, 2, 3], {"seq": 1}, [True]):
            await raw.send(heartbeat[0], msgpack.packb(body))
            error, _ = await raw.recv_until(Error)
            assert (error.code, error.ref_kind) == (ErrorCode.BAD_FIELD, Heartbeat.KIND), body
            assert "Heartbeat" in error.text

        # random bytes: whatever comes back is an Error; nothing crashes
        rng = random.Random(0)
        junk = RawPeer(ctx, server.address)
        for _ in range(200):
            frames = [rng.randbytes(rng.choice([0, 1, 3, 4, 5, 40])) for _ in range(rng.randint(1, 4))]
            if rng.random() < 0.5:
                frames[0] = TR + bytes([rng.choice([1, 20, 30, 42, 60, 63, 99])])
            await junk.send(*frames)
        await junk.send_msg(Hello(role="tool", name="after-junk", protocol_version=PROTOCOL_VERSION,
                                  package_version="t"))
        _, before = await junk.recv_until(Welcome)
        assert before and all(isinstance(m, Error) for m in before)
        assert len(before) <= 20  # error replies are rate-limited per peer

        # still serving a well-behaved peer
        async with Client(server.address, role="generator", name="good", context=ctx) as client:
            await client.connect(timeout_s=WAIT_S)
            await client.send(stats(5))
            peer, msg = await next_message(server)
            assert (peer.name, msg) == ("good", stats(5))
        assert server.counters["bad_input"] >= len(cases) - 2 + 6
        assert server.counters["dropped/not_welcome"] == 1
        raw.close()
        junk.close()


async def test_oversized_frame_disconnects_sender_without_reply(ctx):
    limits = Limits(max_frame_bytes=64 << 10)
    async with Server("tcp://127.0.0.1:0", run_id="r", limits=limits, context=ctx) as server:
        raw = RawPeer(ctx, server.address)
        await raw.send(TR + b"\x3c", b"\x00" * (128 << 10))  # ZeroMQ (MAXMSGSIZE) drops the connection
        heartbeat = codec.encode(Heartbeat(seq=1))
        reply = None
        while reply is None:  # the DEALER reconnects; the first reply must answer the Heartbeat
            await raw.send(*heartbeat)
            try:
                reply = await raw.recv_msg(timeout_s=0.2)
            except TimeoutError:
                continue
        assert (reply.code, reply.ref_kind) == (ErrorCode.NOT_WELCOME, Heartbeat.KIND)
        assert server.counters[f"bad_input/{ErrorCode.TOO_LARGE}"] == 0  # never reached the decoder
        raw.close()


def _rss_mb(key: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(key)) / 1024


SEND_BEFORE_HELLO = """
import sys, zmq
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
for _ in range(3):  # one at a time: ZeroMQ would otherwise buffer the next while the last waits
    sock.send_multipart([bytes.fromhex(sys.argv[2]), b"\\x00" * (50 << 20)], copy=False)  # a Hello's header
    print(sock.recv_multipart()[0].hex() if sock.poll(20000) else "none", flush=True)
"""


async def test_large_message_before_hello_is_dropped_uncopied(ctx):
    """A peer without a session may send only a small Hello: 50 MB frames from one (sent by another
    process, so that only the server's memory counts here) are answered with Error 404 by their size
    alone, never copied or parsed. The server's peak RSS grows by ZeroMQ's own buffer of one frame at
    most (a copy and a parse would add as much again each), and does not stay grown."""
    async with Server("tcp://127.0.0.1:0", run_id="r", context=ctx) as server:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # peak RSS := current RSS
        before_mb = _rss_mb("VmRSS")
        child = await asyncio.create_subprocess_exec(sys.executable, "-c", SEND_BEFORE_HELLO, server.address, (TR + b"\x01").hex(),
                                                     stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(child.communicate(), 25)
        assert child.returncode == 0 and "none" not in out.decode() and len(out.split()) == 3, out
        assert server.counters["dropped/too_large_before_hello"] == 3
        assert server.counters["bad_input"] == 0  # never reached the decoder
        peak_growth_mb, growth_mb = _rss_mb("VmHWM") - before_mb, _rss_mb("VmRSS") - before_mb
        assert peak_growth_mb < 75, f"peak RSS grew by {peak_growth_mb:.0f} MB for 50 MB frames"
        assert growth_mb < 20, f"RSS stayed {growth_mb:.0f} MB higher"


async def test_flood_without_credit_is_dropped_and_bounded(ctx, address):
    async with Server(address, run_id="r", credits=4, context=ctx) as server:
        async with Client(server.address, role="generator", name="polite", context=ctx) as polite:
            await polite.connect(timeout_s=WAIT_S)
            flood = RawPeer(ctx, server.address)
            await flood.hello("flood")
            for i in range(500):
                await flood.send_msg(stats(i))
            await polite.send_many(stats(1000 + i) for i in range(4))
            # a new Hello ends the session: every reply before its Welcome answers the flood
            await flood.send_msg(Hello(role="generator", name="flood-2", protocol_version=PROTOCOL_VERSION,
                                       package_version="t"))
            _, before = await flood.recv_until(Welcome)
            assert 1 <= len(before) <= 20 and all(m.code == ErrorCode.NO_CREDIT for m in before)
            assert server.counters["dropped/no_credit"] == 496
            assert server.num_queued <= 4 * 2 + 4  # credits x peers, plus lifecycle events

            delivered: dict[str, list[int]] = {"flood": [], "polite": []}
            while len(delivered["polite"]) < 4:
                peer, msg = await asyncio.wait_for(server.recv(), WAIT_S)
                if msg is not None:
                    delivered[peer.name].append(msg.policy_version)
            assert delivered == {"flood": [0, 1, 2, 3], "polite": [1000, 1001, 1002, 1003]}
            flood.close()


# ---------------------------------------------------------------------------------------- liveness


async def test_silent_peer_declared_dead_within_timeout(ctx, address):
    interval_s, missed = 0.05, 4
    async with Server(address, run_id="r", heartbeat_interval_s=interval_s, missed_heartbeats=missed,
                      context=ctx) as server:
        async with Client(server.address, role="generator", name="alive", context=ctx) as alive:
            await alive.connect(timeout_s=WAIT_S)
            silent = RawPeer(ctx, server.address)
            started = time.monotonic()
            welcome = await silent.hello("silent")  # its last message; it never heartbeats
            assert welcome.peer_timeout_s == pytest.approx(interval_s * missed)
            dead = await next_event(server, "dead", "silent")
            elapsed_s = time.monotonic() - started
            assert interval_s * missed <= elapsed_s + 0.01
            assert elapsed_s <= interval_s * (missed + 1) + 0.3  # + scheduling slack on a busy machine
            assert "missed" in dead.reason or "no message" in dead.reason
            assert [p.name for p in server.peers.values()] == ["alive"]  # its heartbeats kept it
            # the dead peer learns it (DECLARED_DEAD), and anything it sends later finds no session (NOT_WELCOME)
            error, _ = await silent.recv_until(Error)
            assert error.code == ErrorCode.DECLARED_DEAD and "declared dead" in error.text
            await silent.send_msg(Heartbeat(seq=1))
            error, _ = await silent.recv_until(Error)
            assert (error.code, error.ref_kind) == (ErrorCode.NOT_WELCOME, Heartbeat.KIND)
            silent.close()


async def test_a_server_loop_late_on_every_tick_still_declares_a_silent_peer_dead(ctx):
    """A tick more than one interval late is not judged (heartbeats may wait unread after a stall), but never
    two in a row: a loop that is late on every tick (a loaded machine, a long synchronous call each time)
    still judges, and a live peer whose heartbeats the loop reads between stalls stays alive."""
    interval_s, missed, stall_s = 0.05, 8, 0.15  # each tick is due inside a stall and ~0.1 s late

    async def stall_the_loop():
        while True:
            time.sleep(stall_s)  # blocks the event loop, as a long synchronous call would
            await asyncio.sleep(0)

    async with Server("inproc://late-ticks", run_id="r", heartbeat_interval_s=interval_s,
                      missed_heartbeats=missed, context=ctx) as server:
        async with Client(server.address, role="generator", name="alive", context=ctx) as alive:
            await alive.connect(timeout_s=WAIT_S)
            silent = RawPeer(ctx, server.address)
            await silent.hello("silent")  # its last message; it never heartbeats
            staller = asyncio.create_task(stall_the_loop())
            try:
                dead = await asyncio.wait_for(next_event(server, "dead", "silent"), 40 * stall_s)
            finally:
                staller.cancel()
            assert "no message" in dead.reason
            assert [p.name for p in server.peers.values()] == ["alive"]
            silent.close()


async def test_client_detects_silent_server(ctx):
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    try:
        client = Client(router.last_endpoint.decode(), role="generator", name="g", context=ctx)
        connecting = asyncio.create_task(client.connect(timeout_s=WAIT_S))
        ident, *frames = await asyncio.wait_for(router.recv_multipart(), WAIT_S)
        assert isinstance(codec.decode(frames), Hello)
        welcome = Welcome(run_id="r", policy_version=0, credits=4, heartbeat_interval_s=0.05, peer_timeout_s=0.2)
        await router.send_multipart([ident, *codec.encode(welcome)])
        await connecting
        started = time.monotonic()
        with pytest.raises(ConnectionLost, match="no message"):
            await asyncio.wait_for(client.recv(), WAIT_S)
        assert time.monotonic() - started <= 0.2 + 0.05 + 0.3
        await client.close()
    finally:
        router.close(linger=0)


# ---------------------------------------------------------------------------------------- CURVE


async def test_curve_client_without_server_key_cannot_exchange_messages(ctx):
    public, secret = generate_keypair()
    async with Server("tcp://127.0.0.1:0", run_id="r", curve_secret_key=secret, context=ctx) as server:
        assert server.curve_public_key == public
        async with Client(server.address, role="generator", name="keyed", curve_server_key=public,
                          context=ctx) as keyed:
            await keyed.connect(timeout_s=WAIT_S)
            await keyed.send(stats(1))
            peer, msg = await next_message(server)
            assert (peer.name, msg) == ("keyed", stats(1))
            await server.send(peer.id, stats(2))
            assert await asyncio.wait_for(keyed.recv(), WAIT_S) == stats(2)

        other_public, _ = generate_keypair()
        for name, key in [("plain", None), ("wrong-key", other_public)]:
            client = Client(server.address, role="generator", name=name, curve_server_key=key, context=ctx)
            with pytest.raises(ConnectTimeout):
                await client.connect(timeout_s=0.5)
        raw = RawPeer(ctx, server.address)  # plaintext ZMTP: never reaches the decoder either
        await raw.send_msg(Hello(role="generator", name="raw", protocol_version=PROTOCOL_VERSION,
                                 package_version="t"))
        with pytest.raises(TimeoutError):
            await raw.recv_msg(timeout_s=0.3)
        raw.close()
        assert [p.name for p in server.peers.values()] == []
        assert server.counters["bad_input"] == 0 and server.counters["peers/joined"] == 1
