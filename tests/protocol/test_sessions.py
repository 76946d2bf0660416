"""Sessions and takeover (protocol/SPEC.md, "Sessions and takeover"): a Hello under a connected name takes
that session over at once (the old one is told and ends, its in-flight score requests go to the new one),
a stale incarnation or another key cannot, and a client whose handshake is refused or unanswered tries
again with backoff and says why. Processes killed for real: tests/engine/test_restarts.py.

Run: pytest tests/protocol/test_sessions.py
"""

import asyncio
import logging
import time

import pytest
import zmq.asyncio

from tailrace.protocol.messages import ErrorCode, Hello, Score, ScoreRequest
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
            assert lost.value.declared_dead and lost.value.code == ErrorCode.NOT_WELCOME
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
