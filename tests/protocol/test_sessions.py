"""Sessions and takeover (protocol/SPEC.md, "Sessions and takeover"): a Hello under a connected name takes
that session over at once (the old one is told, Error 409, and ends; its in-flight score requests go to the
new one), a stale incarnation or another key cannot, and a client whose handshake is refused or unanswered
tries again with backoff and says why. Peers of other protocol versions ("Versions"): a real version-1 and
version-2 Hello get a Reject they can read, and the server logs one line; our Client reads an older
trainer's Reject; each Error that ends a session ends our Client's with its code.
Processes killed for real: tests/engine/test_restarts.py.

Run: pytest tests/protocol/test_sessions.py
"""

import asyncio
import logging
import time

import msgpack
import pytest
import zmq.asyncio
from wire_examples import V1_HELLO, V2_HELLO

from tailrace.protocol import codec
from tailrace.protocol.messages import PROTOCOL_VERSION, Error, ErrorCode, Hello, Score, ScoreRequest, Welcome
from tailrace.protocol.reward_sdk import RewardRouter
from tailrace.protocol.transport import Client, ConnectionLost, ConnectTimeout, Rejected, Server

pytestmark = pytest.mark.timeout(30)

WAIT_S = 5.0


@pytest.fixture
def ctx():
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def recv_kind(client: Client, kind: type):
    while True:
        msg = await asyncio.wait_for(client.recv(), WAIT_S)
        if isinstance(msg, kind):
            return msg


async def test_a_new_hello_under_a_connected_name_takes_the_session_over(ctx):
    async with Server("tcp://127.0.0.1:0", run_id="r", context=ctx) as server:
        old = Client(server.address, role="generator", name="gen-0", context=ctx, incarnation=1)
        new = Client(server.address, role="generator", name="gen-0", context=ctx, incarnation=2)
        async with old, new:
            await old.connect(timeout_s=WAIT_S)
            old_id = next(iter(server.peers))
            started = time.monotonic()
            await new.connect(timeout_s=WAIT_S)  # accepted at once, not after the old session times out
            assert time.monotonic() - started < 1.0
            events = []
            while len(events) < 3:
                peer, msg = await asyncio.wait_for(server.recv(), WAIT_S)
                events.append((peer.event, peer.id == old_id, peer.reason))
            assert [e[:2] for e in events] == [("joined", True), ("joined", False), ("left", True)]
            assert "taken over" in events[2][2]
            assert [p.name for p in server.peers.values()] == ["gen-0"] and old_id not in server.peers
            with pytest.raises(ConnectionLost, match="taken over") as lost:
                await asyncio.wait_for(old.recv(), WAIT_S)
            assert lost.value.code == ErrorCode.TAKEN_OVER
            assert not lost.value.declared_dead  # its successor holds the name: it must not rejoin
        assert server.counters["peers/taken_over"] == 1


async def test_a_peer_declared_dead_while_alive_is_told_so_and_may_rejoin_as_a_new_session(ctx):
    async with Server("tcp://127.0.0.1:0", run_id="r", heartbeat_interval_s=0.05, missed_heartbeats=4,
                      context=ctx) as server:
        async with Client(server.address, role="generator", name="gen-0", context=ctx) as frozen:
            await frozen.connect(timeout_s=WAIT_S)
            for task in list(frozen._tasks):  # its heartbeats stop, as in a frozen process
                if task.get_name() == "client-heartbeat":
                    task.cancel()
            with pytest.raises(ConnectionLost, match="declared dead") as lost:
                await asyncio.wait_for(frozen.recv(), WAIT_S)
            assert lost.value.declared_dead and lost.value.code == ErrorCode.DECLARED_DEAD
        async with Client(server.address, role="generator", name="gen-0", context=ctx) as again:
            await again.connect(timeout_s=WAIT_S)
            assert [p.name for p in server.peers.values()] == ["gen-0"]
        assert server.counters["peers/dead"] == 1 and server.counters["peers/taken_over"] == 0


async def test_takeover_hands_in_flight_score_requests_to_the_new_session(ctx):
    async with Server("tcp://127.0.0.1:0", run_id="r", context=ctx) as server:
        router = RewardRouter(server, timeout_s=20.0, retries=1)
        async with Client(server.address, role="reward", name="grader", tasks=["*"], max_inflight=4,
                          context=ctx) as old:
            await old.connect(timeout_s=WAIT_S)
            scoring = asyncio.create_task(router.score("copy", "p", "c"))
            first = await recv_kind(old, ScoreRequest)  # the old server never answers: it "died"
            async with Client(server.address, role="reward", name="grader", tasks=["*"], max_inflight=4,
                              context=ctx) as new:
                await new.connect(timeout_s=WAIT_S)
                again = await recv_kind(new, ScoreRequest)  # at once, long before the 20 s timeout
                assert (again.prompt, again.completion) == (first.prompt, first.completion)
                await new.send(Score(request_id=again.request_id, reward=0.5))
                assert (await asyncio.wait_for(scoring, WAIT_S)).reward == 0.5
        assert router.counters["retries"] == 1 and router.counters["timeouts"] == 0


async def test_a_refused_handshake_is_retried_with_backoff_and_logged(ctx, caplog):
    async with Server("tcp://127.0.0.1:0", run_id="r", context=ctx, max_peers=1) as server:
        holder = Client(server.address, role="tool", name="holder", context=ctx)
        await holder.connect(timeout_s=WAIT_S)
        asyncio.get_running_loop().call_later(1.2, lambda: asyncio.ensure_future(holder.close()))
        waiting = Client(server.address, role="generator", name="waiting", context=ctx)
        with caplog.at_level(logging.WARNING, logger="tailrace.transport"):
            async with waiting:
                welcome = await waiting.connect(timeout_s=WAIT_S, retry_for_s=10.0)
        assert welcome.run_id == "r"
        retries = [r.getMessage() for r in caplog.records if "trying again" in r.getMessage()]
        assert retries and all("at most 1 peers" in text for text in retries)
        assert server.counters["peers/rejected"] == len(retries)

        # A version mismatch is never retried; without retry_for_s nothing is.
        with pytest.raises(Rejected) as info:
            async with Client(server.address, role="generator", name="x", context=ctx) as stale:
                stale.hello = Hello(role="generator", name="x", protocol_version=9, package_version="test")
                await stale.connect(timeout_s=WAIT_S, retry_for_s=10.0)
        assert info.value.code == ErrorCode.VERSION_MISMATCH


async def test_an_unanswered_handshake_is_retried_until_its_deadline(ctx, caplog):
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="tailrace.transport"):
        async with Client("tcp://127.0.0.1:9", role="generator", name="lonely", context=ctx) as client:
            with pytest.raises(ConnectTimeout):
                await client.connect(timeout_s=0.3, retry_for_s=1.5)
    assert 1.5 <= time.monotonic() - started < 5.0
    assert sum("no Welcome" in r.getMessage() for r in caplog.records) >= 2


@pytest.mark.parametrize("hello", [V1_HELLO, V2_HELLO], ids=["v1", "v2"])
async def test_a_peer_of_an_older_version_reads_why_it_is_refused(ctx, caplog, hello):
    """A Hello as a version-1 or version-2 reward server sent it: the Reject comes in that version's
    framing, a body any MessagePack library reads, and the server logs one line naming the peer and both
    versions (before version 3 such a peer got frames it could not decode, timed out, and nothing was said)."""
    version = hello[0][2]
    async with Server("tcp://127.0.0.1:0", run_id="r", context=ctx) as server:
        old = ctx.socket(zmq.DEALER)
        old.setsockopt(zmq.LINGER, 0)
        old.connect(server.address)
        try:
            with caplog.at_level(logging.WARNING, logger="tailrace.transport"):
                await old.send_multipart(hello)
                reply = await asyncio.wait_for(old.recv_multipart(), WAIT_S)
        finally:
            old.close()
        assert reply[0] == bytes((0x54, 0x52, version, 3))  # Reject, under the peer's own version
        assert msgpack.unpackb(reply[1]) == [403, f"protocol version {version} not supported; this trainer "
                                                  f"speaks {PROTOCOL_VERSION}"]
        said = [r.getMessage() for r in caplog.records if r.name == "tailrace.transport"]
        assert len(said) == 1 and said[0].startswith("refused reward 'grader-1' (routing id ") and \
            said[0].endswith(f"it speaks protocol version {version}, this trainer speaks {PROTOCOL_VERSION}")
        assert not server.peers and server.counters["peers/rejected"] == 1


async def test_a_hello_body_of_another_version_is_refused_and_logged(ctx, caplog):
    async with Server("tcp://127.0.0.1:0", run_id="r", context=ctx) as server:
        client = Client(server.address, role="generator", name="odd", context=ctx)
        client.hello = Hello(role="generator", name="odd", protocol_version=PROTOCOL_VERSION + 1, package_version="t")
        with caplog.at_level(logging.WARNING, logger="tailrace.transport"), pytest.raises(Rejected) as info:
            async with client:
                await client.connect(timeout_s=WAIT_S, retry_for_s=10.0)  # a 403 is never retried
        assert info.value.code == ErrorCode.VERSION_MISMATCH
        said = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(said) == 1 and "refused generator 'odd'" in said[0] and \
            f"protocol version {PROTOCOL_VERSION + 1}, this trainer speaks {PROTOCOL_VERSION}" in said[0]
        assert server.counters["peers/rejected"] == 1


async def test_our_client_reads_the_reject_of_an_older_trainer(ctx):
    """A version-2 trainer answers any Hello in its own framing: our Client decodes that Reject and stops at
    once, instead of timing out; the reason names both versions."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    try:
        client = Client(router.last_endpoint.decode(), role="reward", name="new", context=ctx)
        connecting = asyncio.create_task(client.connect(timeout_s=WAIT_S, retry_for_s=30.0))
        ident, *frames = await asyncio.wait_for(router.recv_multipart(), WAIT_S)
        assert frames[0] == bytes((0x54, 0x52, PROTOCOL_VERSION, 1))
        old_trainer = [bytes.fromhex("54 52 02 03"),  # as version 2's codec encoded it
                       msgpack.packb([403, f"protocol version {PROTOCOL_VERSION} not supported; this trainer speaks 2"])]
        started = time.monotonic()
        await router.send_multipart([ident, *old_trainer])
        with pytest.raises(Rejected) as info:
            await asyncio.wait_for(connecting, WAIT_S)
        assert time.monotonic() - started < 1.0  # read, not timed out
        assert info.value.code == ErrorCode.VERSION_MISMATCH
        assert f"the trainer speaks protocol version 2, this peer {PROTOCOL_VERSION}" in info.value.text
    finally:
        router.close(linger=0)


@pytest.mark.parametrize("code, says", [(ErrorCode.NOT_WELCOME, "does not know"), (ErrorCode.TAKEN_OVER, "taken over"),
                                        (ErrorCode.DECLARED_DEAD, "declared this session dead")])
async def test_each_session_ending_error_ends_our_clients_session(ctx, code, says):
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    try:
        async with Client(router.last_endpoint.decode(), role="reward", name="r", context=ctx) as client:
            connecting = asyncio.create_task(client.connect(timeout_s=WAIT_S))
            ident, *_ = await asyncio.wait_for(router.recv_multipart(), WAIT_S)
            welcome = Welcome(run_id="r", policy_version=0, credits=4, heartbeat_interval_s=1.0, peer_timeout_s=30.0)
            await router.send_multipart([ident, *codec.encode(welcome)])
            await connecting
            await router.send_multipart([ident, *codec.encode(Error(code=ErrorCode.UNSUPPORTED, text="not served"))])
            assert (await asyncio.wait_for(client.recv(), WAIT_S)).code == ErrorCode.UNSUPPORTED  # the session goes on
            await router.send_multipart([ident, *codec.encode(Error(code=code, text="bye"))])
            with pytest.raises(ConnectionLost, match=says) as info:
                await asyncio.wait_for(client.recv(), WAIT_S)
            assert info.value.code == code
    finally:
        router.close(linger=0)
