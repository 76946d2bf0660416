"""Reward-server SDK and RewardRouter on the in-process twin: values, errors, timeouts, concurrency,
retries. Run: pytest tests/protocol/test_reward_sdk.py
"""

import asyncio
import contextlib
import importlib.util
import math
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest
import zmq
import zmq.asyncio

from tailrace.protocol import codec
from tailrace.protocol.messages import (
    PROTOCOL_VERSION,
    ErrorCode,
    Hello,
    Score,
    ScoreError,
    ScoreRequest,
    Welcome,
)
from tailrace.protocol.reward_sdk import RewardRouter, RewardUnavailable, ScoreFailed, serve, to_reply
from tailrace.protocol.transport import Server

pytestmark = pytest.mark.timeout(30)

WAIT_S = 5.0


@pytest.fixture
async def trainer():
    ctx = zmq.asyncio.Context()
    server = await Server(f"inproc://reward-{uuid.uuid4().hex}", run_id="r", context=ctx).start()
    servers: list[asyncio.Task] = []

    async def attach(score_fn, *, name="rs", **kwargs) -> asyncio.Task:
        """Start serve() and return its task once the trainer has welcomed it."""
        welcomed = asyncio.Event()
        task = asyncio.create_task(serve(score_fn, server.address, name=name, context=ctx,
                                         on_welcome=lambda _: welcomed.set(), **kwargs))
        servers.append(task)
        waiting = asyncio.create_task(welcomed.wait())
        await asyncio.wait({waiting, task}, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if task.done():
            task.result()
        assert welcomed.is_set()
        return task

    try:
        yield server, attach
    finally:
        await server.close("test over")  # each serve() returns on the Shutdown
        done, pending = await asyncio.wait(servers, timeout=WAIT_S) if servers else (set(), set())
        assert not pending
        for task in done:
            if not task.cancelled():
                with contextlib.suppress(Exception):
                    task.result()
        ctx.destroy(linger=0)


async def score(router: RewardRouter, completion: str = "abc", task: str = "copy", **kwargs) -> Score:
    return await asyncio.wait_for(router.score(task, "copy: abc", completion, {"answer": "abc"}, **kwargs), WAIT_S)


# ---------------------------------------------------------------------------------------- values


def test_to_reply_accepts_numbers_and_dicts_and_refuses_the_rest():
    assert to_reply(1, 0.5) == Score(request_id=1, reward=0.5)
    assert to_reply(1, True) == Score(request_id=1, reward=1.0)
    assert to_reply(1, np.float32(0.25)) == Score(request_id=1, reward=0.25)
    assert to_reply(1, {"reward": 2, "exact": 1.0, "len": 3}) == Score(request_id=1, reward=2.0,
                                                                      details={"exact": 1.0, "len": 3.0})
    for bad in (math.nan, math.inf, "1.0", None, [1.0], {"score": 1.0}, {"reward": 1.0, "x": "y"},
                {"reward": math.nan}, {"reward": 1.0, "x": math.inf}):
        reply = to_reply(7, bad)
        assert isinstance(reply, ScoreError) and reply.code == ErrorCode.BAD_FIELD, bad
        assert reply.request_id == 7


async def test_sync_async_and_dict_functions(trainer):
    server, attach = trainer
    router = RewardRouter(server)

    def exact(prompt, completion, metadata):
        return float(completion == metadata["answer"])

    async def graded(prompt, completion, metadata):
        await asyncio.sleep(0)
        return {"reward": 0.5, "length": len(completion)}

    await attach(exact, name="exact", tasks=["copy"])
    await attach(graded, name="graded", tasks=["essay"])
    assert router.has_server("copy") and router.has_server("essay") and not router.has_server("math")
    assert (await score(router, "abc")).reward == 1.0
    assert (await score(router, "abd")).reward == 0.0
    graded_score = await score(router, "four", task="essay")
    assert (graded_score.reward, graded_score.details) == (0.5, {"length": 4.0})
    with pytest.raises(RewardUnavailable):
        await score(router, task="math")
    with pytest.raises(ValueError, match="metadata"):
        await router.score("copy", "p", "c", {"nested": {"no": 1}})


async def test_errors_become_score_errors_and_the_server_keeps_serving(trainer):
    server, attach = trainer
    router = RewardRouter(server, retries=0)

    def picky(prompt, completion, metadata):
        if completion == "raise":
            raise RuntimeError("grader exploded")
        if completion == "nan":
            return math.nan
        if completion == "text":
            return "high"
        return 1.0

    await attach(picky)
    for completion, code, text in [("raise", ErrorCode.INTERNAL, "RuntimeError: grader exploded"),
                                   ("nan", ErrorCode.BAD_FIELD, "non-finite"),
                                   ("text", ErrorCode.BAD_FIELD, "str")]:
        with pytest.raises(ScoreFailed, match=text) as info:
            await score(router, completion)
        assert info.value.code == code
    assert (await score(router, "fine")).reward == 1.0


async def test_timeouts_sync_and_async(trainer):
    server, attach = trainer
    router = RewardRouter(server, retries=0)
    release = threading.Event()
    never = asyncio.Event()

    def slow_sync(prompt, completion, metadata):
        release.wait(WAIT_S)
        return 1.0

    async def slow_async(prompt, completion, metadata):
        await never.wait()

    await attach(slow_sync, name="sync", tasks=["sync"], timeout_s=0.1)
    await attach(slow_async, name="async", tasks=["async"], timeout_s=30.0)
    try:
        with pytest.raises(ScoreFailed, match="timed out after 0.1 s") as info:
            await score(router, task="sync")
        assert info.value.code == ErrorCode.TIMEOUT
        # the trainer's timeout travels in the request and is applied by the reward server
        with pytest.raises(ScoreFailed, match="timed out") as info:
            await score(router, task="async", timeout_s=0.1)
        assert info.value.code == ErrorCode.TIMEOUT
    finally:
        release.set()


async def test_concurrency_limit_respected(trainer):
    server, attach = trainer
    router = RewardRouter(server)
    active, peak = 0, 0
    all_in = asyncio.Event()

    async def gated(prompt, completion, metadata):
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        if active == 3:
            all_in.set()
        await all_in.wait()
        await asyncio.sleep(0)
        active -= 1
        return 1.0

    await attach(gated, max_concurrency=3)
    results = await asyncio.gather(*(score(router) for _ in range(10)))
    assert [r.reward for r in results] == [1.0] * 10
    assert peak == 3


async def test_sdk_refuses_requests_beyond_its_limit_and_other_tasks(trainer):
    server, attach = trainer  # no router: the test plays a trainer that ignores max_inflight
    release = asyncio.Event()

    async def blocked(prompt, completion, metadata):
        await release.wait()
        return 1.0

    await attach(blocked, tasks=["copy"], max_concurrency=2)
    peer = next(p for p in server.peers.values() if p.role == "reward")
    for i in range(4):
        await server.send(peer.id, ScoreRequest(request_id=i, task="copy", prompt="p", completion="c"))
    await server.send(peer.id, ScoreRequest(request_id=9, task="math", prompt="p", completion="c"))
    replies = {}
    while len(replies) < 3:
        _, msg = await asyncio.wait_for(server.recv(), WAIT_S)
        if isinstance(msg, ScoreError):
            replies[msg.request_id] = msg.code
    assert replies == {2: ErrorCode.NO_CREDIT, 3: ErrorCode.NO_CREDIT, 9: ErrorCode.UNSUPPORTED}
    release.set()
    scores = set()
    while len(scores) < 2:
        _, msg = await asyncio.wait_for(server.recv(), WAIT_S)
        if isinstance(msg, Score):
            scores.add(msg.request_id)
    assert scores == {0, 1}


# ---------------------------------------------------------------------------------------- router


async def test_router_retries_on_another_server_when_one_leaves(trainer):
    server, attach = trainer
    router = RewardRouter(server, retries=1)
    started = asyncio.Event()

    async def stuck(prompt, completion, metadata):
        started.set()
        await asyncio.Event().wait()

    stuck_server = await attach(stuck, name="stuck")
    pending = asyncio.create_task(score(router))
    await asyncio.wait_for(started.wait(), WAIT_S)
    await attach(lambda p, c, m: 0.75, name="fast")
    stuck_server.cancel()  # serve() closes its client: Shutdown, the trainer sees it leave
    assert (await pending).reward == 0.75
    assert router.counters["retries"] == 1


async def test_router_times_out_and_retries_elsewhere(trainer):
    server, attach = trainer
    router = RewardRouter(server, timeout_s=0.2, retries=1, grace_s=0.0)
    release = asyncio.Event()

    async def stuck(prompt, completion, metadata):
        await release.wait()
        return 0.0

    await attach(stuck, name="stuck", max_concurrency=1, timeout_s=30.0)
    stuck_peer = next(p for p in server.peers.values() if p.name == "stuck")
    await attach(lambda p, c, m: 1.0, name="fast", max_concurrency=1)
    # both idle: least in flight wins, ties broken by order; make sure the first attempt hits "stuck"
    router._peers = dict(sorted(router._peers.items(), key=lambda kv: kv[0] != stuck_peer.id))
    assert (await score(router)).reward == 1.0
    assert router.counters["timeouts"] == 1 and router.counters["retries"] == 1
    # "stuck" applies the same deadline (it travels in the request) and answers 504 late: the router
    # held its slot until then, and frees it now
    while router.counters["replies/late"] < 1:
        await asyncio.sleep(0.01)
    assert router._peers[stuck_peer.id].has_room()
    release.set()


async def test_router_local_timeout_holds_the_slot_until_a_late_reply(trainer):
    server, _ = trainer
    router = RewardRouter(server, retries=0, grace_s=0.0)
    silent = server._context.socket(zmq.DEALER)  # a reward server that takes requests and never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.connect(server.address)
    try:
        await silent.send_multipart(codec.encode(Hello(role="reward", name="silent", package_version="t",
                                                       protocol_version=PROTOCOL_VERSION, tasks=["*"],
                                                       max_inflight=1)))
        assert isinstance(codec.decode(await asyncio.wait_for(silent.recv_multipart(), WAIT_S)), Welcome)
        with pytest.raises(ScoreFailed, match="no reply within 0.1 s") as info:
            await score(router, timeout_s=0.1)
        assert info.value.code == ErrorCode.TIMEOUT
        request = codec.decode(await asyncio.wait_for(silent.recv_multipart(), WAIT_S))
        assert isinstance(request, ScoreRequest) and 0 < request.timeout_s <= 0.1
        (slot,) = router._peers.values()
        assert not slot.has_room()  # given up on, but still counted against max_inflight
        queued = asyncio.create_task(score(router, timeout_s=WAIT_S))
        await silent.send_multipart(codec.encode(Score(request_id=request.request_id, reward=0.0)))
        second = codec.decode(await asyncio.wait_for(silent.recv_multipart(), WAIT_S))
        assert router.counters["replies/late"] == 1
        await silent.send_multipart(codec.encode(Score(request_id=second.request_id, reward=0.5)))
        assert (await queued).reward == 0.5
    finally:
        silent.close(linger=0)


# ---------------------------------------------------------------------------------------- example


def load_example():
    path = Path(__file__).resolve().parents[2] / "examples" / "reward_server.py"
    spec = importlib.util.spec_from_file_location("example_reward_server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_example_reward_server(trainer):
    server, attach = trainer
    example = load_example()
    router = RewardRouter(server, retries=0)
    await attach(example.score, name="example", tasks=["copy"])
    exact = await score(router, " ABC ")
    assert (exact.reward, exact.details["exact"]) == (1.0, 1.0)
    partial = await score(router, "abx")
    assert partial.reward == pytest.approx(0.5 * 2 / 3) and partial.details["exact"] == 0.0
    with pytest.raises(ScoreFailed, match="no 'answer'"):
        await asyncio.wait_for(router.score("copy", "p", "c", {}), WAIT_S)


async def test_a_server_declared_dead_while_alive_joins_again_and_keeps_scoring(trainer):
    """The trainer's dead verdict (Error 410) on a reward server that is alive (it was frozen or starved):
    serve() starts a new session under the same name instead of exiting, and scores again."""
    server, attach = trainer
    task = await attach(lambda p, c, m: 0.5, name="grader")
    (peer,) = [p for p in server.peers.values() if p.name == "grader"]
    peer.last_seen_s = -1e9  # silent for ages: the next liveness pass declares it dead, as after a SIGSTOP
    deadline = asyncio.get_running_loop().time() + 3 * WAIT_S
    while not (server.counters["peers/dead"] == 1 and [p for p in server.peers.values() if p.name == "grader"]):
        assert asyncio.get_running_loop().time() < deadline, "no new session after the dead verdict"
        assert not task.done(), task
        await asyncio.sleep(0.05)
    assert not task.done()
    assert (await score(RewardRouter(server))).reward == 0.5
