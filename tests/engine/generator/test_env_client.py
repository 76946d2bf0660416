"""The generator's Environment over the protocol (engine/generator/env_client.py): against the real chain
(transport.Server + EnvBroker + an env_sdk server, in process) an episode runs to its reward; an EnvError
becomes EnvironmentError with its reason; a trainer that never answers is a deadline (env_timeout), a
session that ends fails open requests at once (env_dead); a generator's Rollout takes an episode's fields
from its Finished. Run: pytest tests/engine/generator/test_env_client.py
"""

import asyncio
import time
import types
import uuid

import pytest
import torch
import zmq.asyncio

from tailrace.engine.generator.env_client import ProtocolEnvironment
from tailrace.engine.generator.environment import Environment, EnvironmentError, EpisodeKey
from tailrace.engine.generator.service import GeneratorService
from tailrace.protocol import messages as m
from tailrace.protocol.env_broker import EnvBroker
from tailrace.protocol.env_sdk import serve
from tailrace.protocol.transport import Client, Server

pytestmark = pytest.mark.timeout(30)


class Guess:
    """Guess the number in metadata["secret"]: "higher" / "lower" until found; reward 1 / guesses."""

    def reset(self, prompt, metadata):
        self.secret, self.guesses = int(metadata["secret"]), 0
        return "guess a number from 1 to 100"

    async def step(self, action):
        self.guesses += 1
        guess = int(action)
        if guess == self.secret:
            return {"text": "right", "done": True, "reward": 1.0 / self.guesses}
        if action == "13":
            raise ValueError("unlucky")
        return "higher" if guess < self.secret else "lower"


async def test_an_episode_over_the_real_chain_bisects_to_its_reward():
    ctx = zmq.asyncio.Context()
    server = await Server(f"inproc://envc-{uuid.uuid4().hex}", run_id="r", context=ctx).start()
    EnvBroker(server, timeout_s=5.0, wait_for_server_s=5.0, prompt_of={3: ("guess", "p", {"secret": 37})}.get)
    env_task = asyncio.create_task(serve(Guess, server.address, name="env-0", context=ctx))
    client = Client(server.address, role="generator", name="gen-0", context=ctx, max_inflight=4)
    await client.connect(5.0)
    env = ProtocolEnvironment(client.send, timeout_s=5.0, wait_for_server_s=5.0, vocab_size=100)
    assert isinstance(env, Environment)

    async def pump():
        while True:
            msg = await client.recv()
            if isinstance(msg, m.EnvObservation | m.EnvError):
                env.on_message(msg)

    pumping = asyncio.create_task(pump())
    try:
        key = EpisodeKey(group_id=3, sample_id=0)
        first = await env.reset(key, "guess", "prompt text", {"secret": 0})  # the trainer's metadata wins
        assert first.text == "guess a number from 1 to 100" and env.num_open == 1
        low, high, guesses = 1, 100, 0
        while True:
            guess = (low + high) // 2
            guesses += 1
            obs = await env.step(key, str(guess))
            if obs.done:
                break
            low, high = (guess + 1, high) if obs.text == "higher" else (low, guess - 1)
        assert guess == 37 and obs.reward == pytest.approx(1.0 / guesses) and env.num_open == 0
        await env.close(key)  # closing a finished episode is harmless
        other = EpisodeKey(group_id=3, sample_id=1)
        await env.reset(other, "guess", "", {})
        with pytest.raises(EnvironmentError) as failed:
            await env.step(other, "13")
        assert failed.value.reason == "env_error" and "unlucky" in failed.value.text and env.num_open == 0
        with pytest.raises(EnvironmentError) as unknown:
            await env.step(other, "50")
        assert unknown.value.reason == "env_error"
    finally:
        pumping.cancel()
        await client.close()
        await server.close("test over")
        await asyncio.gather(env_task, pumping, return_exceptions=True)
        ctx.destroy(linger=0)


async def test_a_silent_trainer_is_a_deadline_and_a_lost_session_fails_requests_at_once():
    sent = []

    async def send(msg):
        sent.append(msg)

    env = ProtocolEnvironment(send, timeout_s=0.2, wait_for_server_s=0.1, grace_s=0.1)
    key = EpisodeKey(1, 0)
    started = time.monotonic()
    with pytest.raises(EnvironmentError) as timed_out:
        await env.reset(key, "t", "p", {"ok": 1, "dropped": [1, 2]})
    assert timed_out.value.reason == "env_timeout" and 0.4 <= time.monotonic() - started < 1.0
    assert isinstance(sent[0], m.EnvReset) and sent[0].metadata == {"ok": 1} and env.num_open == 0
    pending = asyncio.create_task(env.reset(key, "t", "p", {}))
    await asyncio.sleep(0.01)
    env.fail_all("env_dead", "the session with the trainer ended")
    with pytest.raises(EnvironmentError) as dead:
        await pending
    assert dead.value.reason == "env_dead"

    async def lost(msg):
        raise EnvironmentError("env_dead", "no session with the trainer")

    env.send = lost
    env._episodes[key] = 99
    await env.close(key)  # nothing to close without a session: no error for the episode loop's cleanup
    assert env.num_open == 0


async def test_answers_map_to_observations_and_reasons():
    queue: asyncio.Queue = asyncio.Queue()

    async def send(msg):
        await queue.put(msg)

    env = ProtocolEnvironment(send, timeout_s=5.0, wait_for_server_s=0.0, vocab_size=10)
    key = EpisodeKey(2, 1)

    async def answer(make):
        msg = await queue.get()
        env.on_message(make(msg))

    reply = asyncio.create_task(answer(lambda r: m.EnvObservation(request_id=r.request_id, episode_id=r.episode_id,
                                                                  token_ids=[1, 2], reward=0.5, info={"a": 1})))
    obs = await env.reset(key, "t", "p", {})
    await reply
    assert (obs.token_ids, obs.reward, obs.info, obs.done) == ([1, 2], 0.5, {"a": 1}, False)
    reply = asyncio.create_task(answer(lambda r: m.EnvObservation(request_id=r.request_id, episode_id=r.episode_id,
                                                                  token_ids=[10])))
    with pytest.raises(EnvironmentError) as outside:
        await env.step(key, "x")
    await reply
    assert outside.value.reason == "env_error" and "outside [0, 10)" in outside.value.text
    for reason in ("env_dead", "no_env_server", "env_timeout"):
        reply = asyncio.create_task(answer(lambda r, why=reason: m.EnvError(
            request_id=r.request_id, episode_id=r.episode_id, code=500, text="t", reason=why)))
        with pytest.raises(EnvironmentError) as failed:
            await env.reset(EpisodeKey(9, 0), "t", "p", {})
        await reply
        assert failed.value.reason == reason


def test_a_rollout_carries_the_episode_fields_of_its_finished():
    fake = types.SimpleNamespace(torch=torch)
    single = types.SimpleNamespace()
    assert GeneratorService.episode_fields(fake, single) == {}
    episode = types.SimpleNamespace(loss_mask=torch.tensor([True, False, True]), env_reward=2, num_turns=2)
    fields = GeneratorService.episode_fields(fake, episode)
    assert fields["loss_mask"].dtype == torch.uint8 and fields["loss_mask"].tolist() == [1, 0, 1]
    assert (fields["env_reward"], fields["num_turns"]) == (2.0, 2)
