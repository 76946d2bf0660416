"""The Environment of engine/generator/environment.py over the protocol: episodes run on environment servers
that the trainer brokers (protocol/env_broker.py). reset/step send EnvReset/EnvStep on the generator's
session and wait for the EnvObservation or EnvError with their request_id, which the generator's recv loop
hands to on_message(); close sends EnvClose. Test: pytest tests/engine/generator/test_env_client.py

Every wait has a deadline: env.timeout_s (plus env.wait_for_server_s for a reset, which may wait for a server
to attach) plus GRACE_S, by which the trainer has always answered; past it: EnvironmentError env_timeout. A
session that ends (the trainer lost, or declared us dead) fails every open request at once (fail_all).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from tailrace.engine.generator.environment import EnvironmentError, EpisodeKey, Observation
from tailrace.protocol import messages as m

GRACE_S = 5.0  # past the trainer's own deadline (it answers env_timeout then): the trainer is not answering
MAX_METADATA = 256


def _wire_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """The scalars of `metadata` (what travels; the trainer fills in the prompt's own anyway)."""
    return {k: v for k, v in list(metadata.items())[:MAX_METADATA]
            if type(k) is str and (v is None or type(v) in (bool, int, float, str))}


class ProtocolEnvironment:
    """`send`: the session's Client.send. vocab_size: observation token ids at or above it are refused
    (EnvironmentError env_error), as a prompt's would be."""

    def __init__(self, send: Callable[[Any], Awaitable[None]], *, timeout_s: float, wait_for_server_s: float,
                 vocab_size: int | None = None, grace_s: float = GRACE_S):
        if timeout_s <= 0 or wait_for_server_s < 0 or grace_s < 0:
            raise ValueError(f"need timeout_s > 0, wait_for_server_s >= 0, grace_s >= 0; got {timeout_s}, "
                             f"{wait_for_server_s}, {grace_s}")
        self.send = send
        self.timeout_s, self.wait_for_server_s, self.grace_s = timeout_s, wait_for_server_s, grace_s
        self.vocab_size = vocab_size
        self._ids = itertools.count(1)
        self._episodes: dict[EpisodeKey, int] = {}   # open episode -> its episode_id on the wire
        self._pending: dict[int, asyncio.Future] = {}  # request_id -> the EnvObservation / EnvError to come

    @property
    def num_open(self) -> int:
        return len(self._episodes)

    async def reset(self, episode: EpisodeKey, task: str, prompt: str, metadata: dict[str, Any]) -> Observation:
        if episode in self._episodes:
            await self.close(episode)  # a sample handed out again: its old episode is over
        episode_id = next(self._ids)
        self._episodes[episode] = episode_id
        request_id = next(self._ids)
        msg = m.EnvReset(request_id=request_id, episode_id=episode_id, group_id=episode.group_id,
                         sample_id=episode.sample_id, task=task, prompt=prompt, metadata=_wire_metadata(metadata),
                         timeout_s=self.timeout_s)
        return await self._ask(episode, request_id, msg, self.timeout_s + self.wait_for_server_s)

    async def step(self, episode: EpisodeKey, action: str) -> Observation:
        episode_id = self._episodes.get(episode)
        if episode_id is None:
            raise EnvironmentError("env_error", f"episode {episode} is not open (reset it first)")
        request_id = next(self._ids)
        msg = m.EnvStep(request_id=request_id, episode_id=episode_id, action=action, timeout_s=self.timeout_s)
        return await self._ask(episode, request_id, msg, self.timeout_s)

    async def close(self, episode: EpisodeKey) -> None:
        """Never raises: without a session there is nothing left to close (the trainer closed it)."""
        episode_id = self._episodes.pop(episode, None)
        if episode_id is None:
            return
        try:
            await self.send(m.EnvClose(episode_id=episode_id))
        except EnvironmentError:
            pass

    def on_message(self, msg: m.EnvObservation | m.EnvError) -> None:
        """An answer from the trainer (called by the recv loop); one nobody waits for is dropped."""
        future = self._pending.pop(msg.request_id, None)
        if future is not None and not future.done():
            future.set_result(msg)

    def fail_all(self, reason: str, text: str) -> None:
        """The session ended: every open request fails now, every episode is forgotten."""
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(EnvironmentError(reason, text))
        self._episodes.clear()

    async def _ask(self, episode: EpisodeKey, request_id: int, msg: Any, budget_s: float) -> Observation:
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            await self.send(msg)
            reply = await asyncio.wait_for(future, budget_s + self.grace_s)
        except TimeoutError:
            self._episodes.pop(episode, None)
            raise EnvironmentError("env_timeout", f"no answer from the trainer within {budget_s + self.grace_s:g} s "
                                   f"(env.timeout_s = {self.timeout_s:g})") from None
        finally:
            self._pending.pop(request_id, None)
        if isinstance(reply, m.EnvError):
            self._episodes.pop(episode, None)  # the episode is over on the trainer's side too
            raise EnvironmentError(reply.reason, f"{reply.text} (code {reply.code})")
        if reply.done:
            self._episodes.pop(episode, None)
        return self._observation(reply)

    def _observation(self, reply: m.EnvObservation) -> Observation:
        ids = reply.token_ids
        if ids is not None and self.vocab_size is not None and any(t >= self.vocab_size for t in ids):
            raise EnvironmentError("env_error", f"observation token ids outside [0, {self.vocab_size})")
        return Observation(text=reply.text, token_ids=list(ids) if ids is not None else None, done=reply.done,
                           reward=reply.reward, info=dict(reply.info))
