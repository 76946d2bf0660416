"""Environment-server SDK (protocol/env_sdk.py) against the trainer's EnvBroker (protocol/env_broker.py) on the
in-process twin, a generator's session driven by hand: episodes, sticky least-loaded routing, observation
checks, errors, deadlines (the SDK's and the broker's own), no server, a server or generator leaving.
Run: pytest tests/protocol/test_env_sdk.py
"""

import asyncio
import contextlib
import itertools
import math
import time
import uuid

import msgpack
import pytest
import zmq
import zmq.asyncio

from tailrace.protocol import codec, env_sdk
from tailrace.protocol.env_broker import EnvBroker
from tailrace.protocol.env_sdk import serve, to_observation
from tailrace.protocol.messages import (
    EnvClose,
    EnvError,
    EnvObservation,
    EnvReset,
    EnvStep,
    Error,
    ErrorCode,
    Spans,
    Stats,
)
from tailrace.protocol.transport import Client, Server

pytestmark = pytest.mark.timeout(30)

WAIT_S = 5.0
CLOSED: list[int] = []  # secrets of the Counter episodes whose close() ran


class Counter:
    """Counts the assistant's turns; done at the third, reward 1.0. Sync methods: run in the SDK's pool."""

    tasks = ("count",)

    def reset(self, prompt, metadata):
        self.turns, self.secret = 0, metadata.get("secret", 0)
        return f"start {prompt}"

    def step(self, action):
        self.turns += 1
        if action == "raise":
            raise RuntimeError("the environment broke")
        if action == "nan":
            return {"text": "x", "reward": math.nan}
        if action == "sleep":
            time.sleep(1.5)
        done = self.turns >= 3
        return {"text": f"turn {self.turns}: {action}", "done": done, "reward": 1.0 if done else None,
                "info": {"secret": self.secret}}

    def close(self):
        CLOSED.append(self.secret)


class AsyncEcho:
    async def reset(self, prompt, metadata):
        return {"text": "", "token_ids": [1, 2]}

    async def step(self, action):
        await asyncio.sleep(0)
        return {"text": action.upper(), "done": action == "bye"}


class Generator:
    """A generator's session, by hand: ask() sends EnvReset/EnvStep and waits for the matching answer."""

    def __init__(self, client: Client):
        self.client = client
        self.ids = itertools.count(1)
        self.answers: dict[int, asyncio.Future] = {}
        self.other: list = []
        self.pump = asyncio.create_task(self._pump())

    async def _pump(self):
        while True:
            msg = await self.client.recv()
            if isinstance(msg, EnvObservation | EnvError) and msg.request_id in self.answers:
                self.answers.pop(msg.request_id).set_result(msg)
            else:
                self.other.append(msg)

    async def ask(self, msg_type, episode_id: int, wait_s: float = WAIT_S, **fields):
        request_id = next(self.ids)
        extra = {"group_id": 1, "sample_id": 0, "task": "count", "prompt": "p"} if msg_type is EnvReset else {}
        future = asyncio.get_running_loop().create_future()
        self.answers[request_id] = future
        await self.client.send(msg_type(request_id=request_id, episode_id=episode_id, **(extra | fields)))
        return await asyncio.wait_for(future, wait_s)

    async def reset(self, episode_id: int, **fields):
        return await self.ask(EnvReset, episode_id, **fields)

    async def step(self, episode_id: int, action: str, **fields):
        return await self.ask(EnvStep, episode_id, action=action, **fields)


@pytest.fixture
async def rig():
    """(server, broker, attach(make_env, name) -> its serve task, generator(name) -> Generator)."""
    ctx = zmq.asyncio.Context()
    server = await Server(f"inproc://env-{uuid.uuid4().hex}", run_id="r", context=ctx,
                          heartbeat_interval_s=0.1, missed_heartbeats=5).start()
    broker = EnvBroker(server, timeout_s=1.0, wait_for_server_s=0.5, grace_s=0.2)
    tasks: list[asyncio.Task] = []
    clients: list[Client] = []
    pumps: list[asyncio.Task] = []

    async def attach(make_env, name="env-0", **kwargs) -> asyncio.Task:
        welcomed = asyncio.Event()
        task = asyncio.create_task(serve(make_env, server.address, name=name, context=ctx,
                                         on_welcome=lambda _: welcomed.set(), **kwargs))
        tasks.append(task)
        await asyncio.wait_for(welcomed.wait(), WAIT_S)
        await wait_until(lambda: any(p.name == name for p in server.peers.values()))
        return task

    async def generator(name="gen-0", role="generator", max_inflight=4, tasks=()) -> Generator:
        client = Client(server.address, role=role, name=name, context=ctx, max_inflight=max_inflight, tasks=tasks)
        clients.append(client)
        await client.connect(WAIT_S)
        gen = Generator(client)
        pumps.append(gen.pump)
        return gen

    try:
        yield server, broker, attach, generator
    finally:
        await server.close("test over")
        for client in clients:
            await client.close()
        for task in (*tasks, *pumps):
            task.cancel()
        await asyncio.gather(*tasks, *pumps, return_exceptions=True)
        ctx.destroy(linger=0)


async def wait_until(condition, wait_s: float = WAIT_S):
    deadline = time.monotonic() + wait_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------------------------- observations


def test_to_observation_accepts_texts_dicts_and_objects_and_refuses_the_rest():
    assert to_observation(1, 2, "hi") == EnvObservation(request_id=1, episode_id=2, text="hi")
    ok = to_observation(1, 2, {"text": "a", "token_ids": [3], "done": True, "reward": 1, "info": {"k": 1}})
    assert ok == EnvObservation(request_id=1, episode_id=2, text="a", token_ids=[3], done=True, reward=1.0,
                                info={"k": 1})

    class Obs:
        text, done, reward = "o", False, None

    assert to_observation(1, 2, Obs()) == EnvObservation(request_id=1, episode_id=2, text="o")
    for bad in (3, None, {"reward": math.nan}, {"reward": math.inf}, {"done": 1}, {"token_ids": [-1]},
                {"token_ids": [True]}, {"text": 5}, {"info": {"k": [1]}}, {"score": 1.0}):
        reply = to_observation(1, 2, bad)
        assert isinstance(reply, EnvError) and reply.code == ErrorCode.BAD_FIELD, bad


# ---------------------------------------------------------------------------------------- episodes


async def test_an_episode_runs_to_done_with_the_trainers_prompt_and_a_final_reward(rig):
    server, broker, attach, generator = rig
    broker.prompt_of = {1: ("count", "the real prompt", {"secret": 42})}.get
    await attach(Counter)
    gen = await generator()
    first = await gen.reset(7, prompt="the generator's word", metadata={"secret": 0})
    assert first == EnvObservation(request_id=first.request_id, episode_id=7, text="start the real prompt")
    assert broker.num_episodes == 1
    for turn in (1, 2):
        obs = await gen.step(7, f"a{turn}")
        assert (obs.text, obs.done, obs.reward, obs.info) == (f"turn {turn}: a{turn}", False, None, {"secret": 42})
    last = await gen.step(7, "a3")
    assert (last.done, last.reward, last.episode_id) == (True, 1.0, 7)
    assert broker.num_episodes == 0  # done: the broker and the server forgot it
    await wait_until(lambda: 42 in CLOSED)
    after = await gen.step(7, "a4")
    assert isinstance(after, EnvError) and after.code == ErrorCode.UNSUPPORTED
    unknown = await gen.reset(8, group_id=99)  # a group the trainer never handed out
    assert isinstance(unknown, EnvError) and unknown.code == ErrorCode.UNSUPPORTED


async def test_the_server_sends_stats_and_spans_of_its_requests(rig, monkeypatch):
    """Like a reward server: Stats (role "env": requests received / answered / errors, latency) and Spans
    ("stepping", a track per concurrency slot), what `tailrace top` and the trace show of it."""
    monkeypatch.setattr(env_sdk, "STATS_INTERVAL_S", 0.05)
    server, broker, attach, generator = rig
    seen: list = []
    server.route((Stats, Spans), lambda peer, msg: seen.append(msg))
    await attach(Counter, name="env-stats")
    gen = await generator()
    await gen.reset(3)
    await gen.step(3, "a1")
    assert isinstance(await gen.step(3, "raise"), EnvError)

    def answered() -> dict | None:
        stats = [m for m in seen if isinstance(m, Stats) and m.role == "env" and m.name == "env-stats"]
        return stats[-1].counters if stats and stats[-1].counters.get("env/requests/answered") == 3 else None

    await wait_until(lambda: answered() is not None)
    counters = answered()
    assert counters["env/requests/received"] == 3 and counters["env/requests/errors"] == 1
    assert counters["env/requests/in_flight"] == 0 and counters["env/latency/mean_s"] > 0
    spans = [s for m in seen if isinstance(m, Spans) and m.role == "env" for s in m.spans]
    assert spans and {s.state for s in spans} == {"stepping"} and spans[0].track.startswith("slot-")


async def test_async_environments_and_token_observations(rig):
    server, broker, attach, generator = rig
    await attach(AsyncEcho, tasks=["echo"])
    gen = await generator()
    first = await gen.reset(1, task="echo")
    assert first.token_ids == [1, 2] and first.text == ""
    assert (await gen.step(1, "hi")).text == "HI"
    assert (await gen.step(1, "bye")).done


async def test_episodes_go_to_the_least_loaded_server_and_stay_there(rig):
    server, broker, attach, generator = rig
    await attach(Counter, name="env-a")
    await attach(Counter, name="env-b")
    gen = await generator()
    for episode in range(4):
        assert isinstance(await gen.reset(episode), EnvObservation)
    held = {name: len(s.episodes) for name, s in ((s.peer.name, s) for s in broker._servers.values())}
    assert held == {"env-a": 2, "env-b": 2}
    homes = {e.gen_episode_id: e.server for e in broker._by_id.values()}
    for episode in range(4):
        assert isinstance(await gen.step(episode, "x"), EnvObservation)  # its state is on its own server
    assert {e.gen_episode_id: e.server for e in broker._by_id.values()} == homes


async def test_a_server_never_gets_more_than_its_max_inflight(rig):
    server, broker, attach, generator = rig
    await attach(Counter, max_concurrency=1)
    gen = await generator()
    await asyncio.gather(gen.reset(1), gen.reset(2))
    slow = asyncio.create_task(gen.step(1, "sleep"))
    await wait_until(lambda: any(s.inflight for s in broker._servers.values()))
    quick = asyncio.create_task(gen.step(2, "x"))
    await asyncio.sleep(0.2)
    assert max(len(s.inflight) for s in broker._servers.values()) == 1 and len(broker._queue) == 1
    obs_quick, obs_slow = await asyncio.gather(quick, slow)
    # the queued step waited for the slot, its deadline running: the slow step took 1.5 s of the 1 s budget
    assert isinstance(obs_slow, EnvError) and obs_slow.reason == "env_timeout"
    assert isinstance(obs_quick, EnvObservation | EnvError)


# ---------------------------------------------------------------------------------------- failures


async def test_an_environment_that_raises_or_answers_nonsense_ends_the_episode_with_env_error(rig):
    server, broker, attach, generator = rig
    await attach(Counter)
    gen = await generator()
    await gen.reset(1)
    raised = await gen.step(1, "raise")
    assert (raised.code, raised.reason) == (ErrorCode.INTERNAL, "env_error") and "the environment broke" in raised.text
    assert isinstance(await gen.step(1, "x"), EnvError)  # the episode is over
    await gen.reset(2)
    nan = await gen.step(2, "nan")
    assert (nan.code, nan.reason) == (ErrorCode.BAD_FIELD, "env_error") and "finite" in nan.text
    assert broker.num_episodes == 0


async def test_a_slow_environment_is_answered_env_timeout_by_its_sdk(rig):
    server, broker, attach, generator = rig
    await attach(Counter, timeout_s=0.5)  # the server's own limit, below the broker's 1 s
    gen = await generator()
    await gen.reset(1)
    started = time.monotonic()
    slow = await gen.step(1, "sleep")  # sleeps 1.5 s
    assert (slow.code, slow.reason) == (ErrorCode.TIMEOUT, "env_timeout")
    assert "step timed out after 0.5 s" in slow.text  # the SDK answered, before the broker's deadline
    assert time.monotonic() - started < 1.0
    assert broker.num_episodes == 0


async def test_a_silent_environment_server_is_timed_out_by_the_broker(rig):
    """A server that never answers: the broker's own deadline answers the generator, and the slot stays
    taken (the server gets no second request) until the server goes."""
    server, broker, attach, generator = rig
    silent = await generator(name="silent", role="env", max_inflight=1, tasks=["*"])
    gen = await generator()
    started = time.monotonic()
    reply = await gen.reset(1)
    assert (reply.code, reply.reason) == (ErrorCode.TIMEOUT, "env_timeout")
    assert 1.0 <= time.monotonic() - started < 1.0 + 0.2 + 1.0
    assert "silent" in reply.text
    await wait_until(lambda: any(isinstance(m, EnvClose) for m in silent.other))
    assert [type(m) for m in silent.other if isinstance(m, EnvReset | EnvStep)] == [EnvReset]
    second = await gen.reset(2)  # the only slot is still held by the unanswered request: never sent
    assert second.reason == "env_timeout"
    assert [type(m) for m in silent.other if isinstance(m, EnvReset | EnvStep)] == [EnvReset]


async def test_a_reset_waits_for_a_server_then_gives_up_with_no_env_server(rig):
    server, broker, attach, generator = rig
    gen = await generator()
    started = time.monotonic()
    reply = await gen.reset(1)
    assert (reply.code, reply.reason) == (ErrorCode.UNSUPPORTED, "no_env_server")
    assert 0.5 <= time.monotonic() - started < 0.5 + 0.5
    waiting = asyncio.create_task(gen.reset(2))
    await asyncio.sleep(0.2)
    await attach(Counter)  # attaches within env.wait_for_server_s: the waiting reset is served
    assert isinstance(await waiting, EnvObservation)


async def test_a_server_that_leaves_mid_request_fails_its_episodes_at_once_with_env_dead(rig):
    server, broker, attach, generator = rig
    task = await attach(Counter)
    gen = await generator()
    await gen.reset(1)
    await gen.reset(2)
    pending = asyncio.create_task(gen.step(1, "sleep"))
    await wait_until(lambda: any(s.inflight for s in broker._servers.values()))
    started = time.monotonic()
    task.cancel()  # its session ends with a Shutdown: "left"
    reply = await pending
    assert (reply.code, reply.reason) == (ErrorCode.INTERNAL, "env_dead") and time.monotonic() - started < 0.5
    idle = await gen.step(2, "x")  # the other episode's state went with the server
    assert isinstance(idle, EnvError) and broker.num_episodes == 0


async def test_a_generator_that_leaves_has_its_episodes_closed(rig):
    server, broker, attach, generator = rig
    await attach(Counter)
    gen = await generator()
    await gen.reset(1, metadata={"secret": 77})
    await gen.client.close()
    await wait_until(lambda: broker.num_episodes == 0)
    await wait_until(lambda: 77 in CLOSED)  # EnvClose reached the server, which called close()


async def test_only_generators_run_episodes_and_only_env_servers_answer(rig):
    server, broker, attach, generator = rig
    tool = await generator(name="a-tool", role="tool")
    await tool.client.send(EnvReset(request_id=1, episode_id=1, group_id=1, sample_id=0, task="count", prompt=""))
    await tool.client.send(EnvObservation(request_id=1, episode_id=1))
    await wait_until(lambda: len(tool.other) >= 2)
    assert [(m.code, m.ref_kind) for m in tool.other[:2] if isinstance(m, Error)] == [
        (ErrorCode.UNAUTHORIZED, EnvReset.KIND), (ErrorCode.UNAUTHORIZED, EnvObservation.KIND)]
    with contextlib.suppress(Exception):
        await tool.client.close()


async def test_a_bad_observation_is_answered_error_and_its_request_ends_at_its_deadline(rig):
    """An environment server of another language answers with a NaN reward (or any body that fails the
    codec): it gets Error 401 naming EnvObservation, the episode's request is settled by its deadline
    (env_timeout), and a good answer after that is still served: never a hang."""
    server, broker, attach, generator = rig
    env = await generator(name="bad-env", role="env", max_inflight=2, tasks=["*"])
    gen = await generator()
    pending = asyncio.create_task(gen.reset(1))
    await wait_until(lambda: any(isinstance(x, EnvReset) for x in env.other))
    req = next(x for x in env.other if isinstance(x, EnvReset))
    frames = codec.encode(EnvObservation(request_id=req.request_id, episode_id=req.episode_id, reward=0.5))
    body = msgpack.unpackb(frames[1])
    body[EnvObservation.__struct_fields__.index("reward")] = math.nan
    await env.client._send_frames([frames[0], msgpack.packb(body)])
    await env.client._send_frames([frames[0], b"\xc1garbage"])
    reply = await pending
    assert (reply.code, reply.reason) == (ErrorCode.TIMEOUT, "env_timeout")
    refused = [x for x in env.other if isinstance(x, Error)]
    assert [(x.code, x.ref_kind) for x in refused] == [(ErrorCode.BAD_FIELD, EnvObservation.KIND)] * 2
    assert "reward must be finite" in refused[0].text
    served = asyncio.create_task(gen.reset(2))
    await wait_until(lambda: sum(isinstance(x, EnvReset) for x in env.other) == 2)
    second = [x for x in env.other if isinstance(x, EnvReset)][1]
    await env.client.send(EnvObservation(request_id=second.request_id, episode_id=second.episode_id, text="ok"))
    assert (await served).text == "ok"


async def test_a_step_while_one_is_in_flight_ends_the_episode(rig):
    """An EnvError always ends an episode, also the one a generator's second concurrent step gets: the
    broker forgets it and tells its server, so nothing is left open that the generator would never close."""
    server, broker, attach, generator = rig
    await attach(Counter)
    gen = await generator()
    await gen.reset(1, metadata={"secret": 5})
    first = asyncio.create_task(gen.step(1, "sleep"))
    await wait_until(lambda: any(s.inflight for s in broker._servers.values()))
    second = await gen.step(1, "x")
    assert (second.code, second.reason) == (ErrorCode.BAD_FIELD, "env_error") and broker.num_episodes == 0
    await wait_until(lambda: 5 in CLOSED)  # EnvClose reached the server
    closed = await first  # answered at once: nobody waits for the deadline of a closed episode's request
    assert (closed.reason, closed.text) == ("env_error", "the episode was closed")
