"""EnvBroker: the trainer's side of multi-turn episodes. Generators send EnvReset / EnvStep / EnvClose to the
trainer over their session; the broker sends each episode, stickily, to one environment server (role "env")
of its task and answers the generator with EnvObservation or EnvError. Wire rules: protocol/SPEC.md,
"Environment servers". Test: pytest tests/protocol/test_env_sdk.py tests/faults/test_env_faults.py

    generator --EnvReset/EnvStep/EnvClose--> broker (Server.route: called in the receive loop, never blocks)
        reset: a server of the task with room (inflight < Hello.max_inflight), fewest open episodes;
               none attached: waits up to wait_for_server_s (then EnvError no_env_server); none with room:
               waits in the queue, its deadline running
        step:  the episode's server (sticky); its server gone: EnvError env_dead at once
    env server --EnvObservation/EnvError--> broker --> the generator, with the generator's own ids
    deadlines: one timer per request, timeout_s (+ grace) from its arrival: EnvError env_timeout; the slot
               stays taken until the late answer comes or the server goes (as RewardRouter's)
    peer events: an env server that leaves or dies fails its requests (env_dead) and its episodes at once;
               a generator that goes has its episodes closed (EnvClose to their servers)
Bounds: open episodes per generator <= max(64, 4 x its Hello.max_inflight) (beyond: EnvError 406); requests
in flight per env server <= its max_inflight; the queue holds at most one request per open episode.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from tailrace.protocol.messages import EnvClose, EnvError, EnvObservation, EnvReset, EnvStep, Error, ErrorCode
from tailrace.protocol.transport import Peer, PeerEvent, Server

__all__ = ["EnvBroker"]

log = logging.getLogger("tailrace.env")

MAX_TEXT = 4096
MIN_EPISODES_PER_GENERATOR = 64


def _tasks_match(tasks: list[str], task: str) -> bool:
    return "*" in tasks or task in tasks


@dataclasses.dataclass(eq=False)
class _Episode:
    generator: bytes           # the generator's peer id
    gen_episode_id: int        # its name for the episode
    episode_id: int            # ours, toward the env server (unique in this trainer process)
    task: str
    server: bytes | None = None  # the env server holding its state, once its reset was sent
    busy: bool = False           # a request of it is queued or in flight


@dataclasses.dataclass(eq=False)
class _Request:
    episode: _Episode
    gen_request_id: int
    msg: EnvReset | EnvStep     # as the generator sent it; ids rewritten when forwarded
    deadline_s: float = 0.0     # 0: not started (a reset waiting for any server of its task to attach)
    timer: asyncio.TimerHandle | None = None
    request_id: int = -1        # ours, once sent
    server: bytes | None = None
    answered: bool = False      # the generator got its EnvObservation or EnvError


@dataclasses.dataclass(eq=False)
class _EnvServer:
    peer: Peer
    episodes: set[int] = dataclasses.field(default_factory=set)  # our episode ids it holds
    inflight: dict[int, _Request | None] = dataclasses.field(default_factory=dict)
    """request_id -> request; None when given up on (deadline): the slot stays taken until its answer."""

    def serves(self, task: str) -> bool:
        return _tasks_match(self.peer.tasks, task)

    def has_room(self) -> bool:
        return len(self.inflight) < self.peer.max_inflight


PromptLookup = Callable[[int], "tuple[str, str, dict[str, Any]] | None"]
"""group_id -> (task, prompt text, metadata) of the prompt handed out under it, or None when unknown."""


class EnvBroker:
    """Routes generators' episodes to environment servers attached to `server`. timeout_s: per reset /
    step (env.timeout_s); wait_for_server_s: how long a reset waits for a server of its task to attach.
    prompt_of: the trainer's prompts by group id; a reset then carries the task, text and metadata of the
    prompt handed out (a reset of a group it does not know is EnvError 407), not the generator's."""

    def __init__(self, server: Server, *, timeout_s: float = 30.0, wait_for_server_s: float = 60.0,
                 grace_s: float = 1.0, prompt_of: PromptLookup | None = None):
        if timeout_s <= 0 or wait_for_server_s < 0 or grace_s < 0:
            raise ValueError(f"need timeout_s > 0, wait_for_server_s >= 0, grace_s >= 0; got {timeout_s}, "
                             f"{wait_for_server_s}, {grace_s}")
        self.server = server
        self.prompt_of = prompt_of
        self.timeout_s, self.wait_for_server_s, self.grace_s = timeout_s, wait_for_server_s, grace_s
        self.counters: collections.Counter[str] = collections.Counter()
        self._servers: dict[bytes, _EnvServer] = {}
        self._episodes: dict[tuple[bytes, int], _Episode] = {}  # (generator, its episode id) -> episode
        self._by_id: dict[int, _Episode] = {}                   # our episode id -> episode
        self._queue: collections.deque[_Request] = collections.deque()
        self._ids = itertools.count(1)
        server.route((EnvReset, EnvStep, EnvClose, EnvObservation, EnvError), self._on_message)
        server.add_listener(self._on_peer_event)
        for peer in server.peers.values():
            if peer.role == "env":
                self._servers[peer.id] = _EnvServer(peer)

    def has_server(self, task: str) -> bool:
        return any(s.serves(task) for s in self._servers.values())

    @property
    def num_episodes(self) -> int:
        return len(self._by_id)

    def stats(self) -> dict[str, float]:
        return {"trainer/env/servers": len(self._servers), "trainer/env/episodes": len(self._by_id),
                "trainer/env/queued": len(self._queue),
                **{f"trainer/env/{k}": float(v) for k, v in self.counters.items()}}

    # ---------------------------------------------------------------------------------- from generators

    def _on_message(self, peer: Peer, msg: Any) -> None:
        if isinstance(msg, EnvObservation | EnvError):
            if peer.role != "env":
                self._refuse(peer, msg, "only environment servers answer episodes")
            else:
                self._on_answer(peer, msg)
        elif peer.role != "generator":
            self._refuse(peer, msg, "only generators run episodes")
        elif isinstance(msg, EnvReset):
            self._on_reset(peer, msg)
        elif isinstance(msg, EnvStep):
            self._on_step(peer, msg)
        else:
            self._on_close(peer, msg)

    def _refuse(self, peer: Peer, msg: Any, text: str) -> None:
        self.counters["refused/role"] += 1
        self.server.send_nowait(peer.id, Error(code=ErrorCode.UNAUTHORIZED, text=text, ref_kind=msg.KIND))

    def _on_reset(self, peer: Peer, msg: EnvReset) -> None:
        if self.prompt_of is not None:
            prompt = self.prompt_of(msg.group_id)
            if prompt is None:
                return self._answer_error(peer.id, msg, ErrorCode.UNSUPPORTED,
                                          f"group {msg.group_id} is not handed out (cancelled, or never)")
            task, text, metadata = prompt
            msg = EnvReset(request_id=msg.request_id, episode_id=msg.episode_id, group_id=msg.group_id,
                           sample_id=msg.sample_id, task=task, prompt=text, metadata=metadata, timeout_s=msg.timeout_s)
        key = (peer.id, msg.episode_id)
        if key in self._episodes:
            return self._answer_error(peer.id, msg, ErrorCode.BAD_FIELD, f"episode {msg.episode_id} is already open")
        limit = max(MIN_EPISODES_PER_GENERATOR, 4 * peer.max_inflight)
        if sum(1 for g, _ in self._episodes if g == peer.id) >= limit:
            return self._answer_error(peer.id, msg, ErrorCode.NO_CREDIT, f"{limit} episodes already open")
        episode = _Episode(generator=peer.id, gen_episode_id=msg.episode_id, episode_id=next(self._ids), task=msg.task)
        self._episodes[key] = self._by_id[episode.episode_id] = episode
        req = _Request(episode=episode, gen_request_id=msg.request_id, msg=msg)
        self.counters["resets"] += 1
        if self.has_server(msg.task):
            self._start_clock(req)
        else:  # no server of the task yet: wait for one to attach, then the request's own clock starts
            req.timer = asyncio.get_running_loop().call_later(self.wait_for_server_s, self._on_no_server, req)
        self._enqueue(req)

    def _on_step(self, peer: Peer, msg: EnvStep) -> None:
        episode = self._episodes.get((peer.id, msg.episode_id))
        if episode is None or episode.server is None:
            return self._answer_error(peer.id, msg, ErrorCode.UNSUPPORTED, f"episode {msg.episode_id} is not "
                                      "open (reset first; an episode ends with done or an EnvError)")
        if episode.busy:  # a generator's bug: the episode ends (an EnvError always ends it)
            self._answer_error(peer.id, msg, ErrorCode.BAD_FIELD, f"episode {msg.episode_id} has a request in "
                               "flight already")
            return self._close(episode, tell_server=True)
        self.counters["steps"] += 1
        req = _Request(episode=episode, gen_request_id=msg.request_id, msg=msg)
        self._start_clock(req)
        self._enqueue(req)

    def _on_close(self, peer: Peer, msg: EnvClose) -> None:
        episode = self._episodes.get((peer.id, msg.episode_id))
        if episode is not None:
            self._close(episode, tell_server=True)

    # ---------------------------------------------------------------------------------- to env servers

    def _start_clock(self, req: _Request) -> None:
        if req.timer is not None:
            req.timer.cancel()
        req.deadline_s = time.monotonic() + self.timeout_s
        req.timer = asyncio.get_running_loop().call_later(self.timeout_s + self.grace_s, self._on_deadline, req)

    def _enqueue(self, req: _Request) -> None:
        req.episode.busy = True
        self._queue.append(req)
        self._dispatch()

    def _dispatch(self) -> None:
        waiting: collections.deque[_Request] = collections.deque()
        while self._queue:
            req = self._queue.popleft()
            target = self._target(req)
            if target is None:
                waiting.append(req)
                continue
            request_id = next(self._ids)
            timeout_s = min(86400.0, max(0.001, req.deadline_s - time.monotonic()))
            if isinstance(req.msg, EnvReset):
                out: Any = EnvReset(request_id=request_id, episode_id=req.episode.episode_id,
                                    group_id=req.msg.group_id, sample_id=req.msg.sample_id, task=req.msg.task,
                                    prompt=req.msg.prompt, metadata=req.msg.metadata, timeout_s=timeout_s)
            else:
                out = EnvStep(request_id=request_id, episode_id=req.episode.episode_id, action=req.msg.action,
                              timeout_s=timeout_s)
            if not self.server.send_nowait(target.peer.id, out):
                self.counters["send_failed"] += 1
                waiting.append(req)  # its pipe is full: tried again on the next event, within the deadline
                continue
            req.request_id, req.server = request_id, target.peer.id
            target.inflight[request_id] = req
            if req.episode.server is None:
                req.episode.server = target.peer.id
                target.episodes.add(req.episode.episode_id)
            self.counters["sent"] += 1
        self._queue = waiting

    def _target(self, req: _Request) -> _EnvServer | None:
        if req.deadline_s == 0.0:  # still waiting for any server of its task to attach
            if not self.has_server(req.episode.task):
                return None
            self._start_clock(req)
        if req.episode.server is not None:
            target = self._servers.get(req.episode.server)
            return target if target is not None and target.has_room() else None
        candidates = [s for s in self._servers.values() if s.serves(req.episode.task) and s.has_room()]
        return min(candidates, key=lambda s: (len(s.episodes), len(s.inflight))) if candidates else None

    # ---------------------------------------------------------------------------------- answers

    def _on_answer(self, peer: Peer, msg: EnvObservation | EnvError) -> None:
        env = self._servers.get(peer.id)
        if env is None or msg.request_id not in env.inflight:
            self.counters["answers/unknown"] += 1
            return
        req = env.inflight.pop(msg.request_id)
        if req is None:
            self.counters["answers/late"] += 1
        else:
            self._settle(req)
            episode, gen_msg = req.episode, req.msg
            episode.busy = False
            if isinstance(msg, EnvObservation):
                req.answered = True
                self.counters["answers/observation"] += 1
                self._send(episode.generator, EnvObservation(
                    request_id=gen_msg.request_id, episode_id=gen_msg.episode_id, text=msg.text,
                    token_ids=msg.token_ids, done=msg.done, reward=msg.reward, info=msg.info))
                if msg.done:
                    self._close(episode, tell_server=False)  # the server forgot it with its done
            else:
                self.counters[f"answers/error_{msg.code}"] += 1
                reason = "env_timeout" if msg.code == ErrorCode.TIMEOUT else "env_error"
                self._fail(req, msg.code, f"{peer.name}: {msg.text}", reason, tell_server=False)
        self._dispatch()

    def _on_deadline(self, req: _Request) -> None:
        req.timer = None
        self.counters["timeouts"] += 1
        env = self._servers.get(req.server) if req.server is not None else None
        if env is not None and env.inflight.get(req.request_id) is req:
            env.inflight[req.request_id] = None  # the slot stays taken until the late answer
        where = f"environment server {env.peer.name!r}" if env is not None else "any environment server"
        self._fail(req, ErrorCode.TIMEOUT, f"no answer from {where} within env.timeout_s = {self.timeout_s:g} s",
                   "env_timeout", tell_server=True)
        self._dispatch()

    def _on_no_server(self, req: _Request) -> None:
        req.timer = None
        self.counters["no_server"] += 1
        self._fail(req, ErrorCode.UNSUPPORTED, f"task {req.episode.task!r}: no environment server attached within "
                   f"env.wait_for_server_s = {self.wait_for_server_s:g} s", "no_env_server", tell_server=False)

    # ---------------------------------------------------------------------------------- peer events

    def _on_peer_event(self, event: PeerEvent) -> None:
        if event.role == "env":
            if event.event == "joined":
                self._servers[event.id] = _EnvServer(event.peer)
            else:
                self._server_gone(event)
        elif event.role == "generator" and event.event != "joined":
            for episode in [e for e in self._by_id.values() if e.generator == event.id]:
                self._close(episode, tell_server=True)
        self._dispatch()

    def _server_gone(self, event: PeerEvent) -> None:
        env = self._servers.pop(event.id, None)
        if env is None:
            return
        text = f"environment server {event.name!r} {event.event} mid-episode: {event.reason}"
        for req in [r for r in env.inflight.values() if r is not None]:
            self._fail(req, ErrorCode.INTERNAL, text, "env_dead", tell_server=False)
        for req in [r for r in self._queue if r.episode.server == event.id]:
            self._fail(req, ErrorCode.INTERNAL, text, "env_dead", tell_server=False)
        for episode_id in list(env.episodes):  # idle episodes: their next step fails at once
            episode = self._by_id.get(episode_id)
            if episode is not None:
                self._close(episode, tell_server=False)
        if env.episodes or env.inflight:
            log.warning("%s", text)

    # ---------------------------------------------------------------------------------- endings

    def _fail(self, req: _Request, code: int, text: str, reason: str, *, tell_server: bool) -> None:
        self._forget_request(req)
        self.counters[f"failed/{reason}"] += 1
        if not req.answered:
            req.answered = True
            self._answer_error(req.episode.generator, req.msg, code, text, reason)
        self._close(req.episode, tell_server=tell_server)

    def _answer_error(self, generator: bytes, msg: EnvReset | EnvStep, code: int, text: str,
                      reason: str = "env_error") -> None:
        self._send(generator, EnvError(request_id=msg.request_id, episode_id=msg.episode_id, code=code,
                                       text=text[:MAX_TEXT], reason=reason))

    def _close(self, episode: _Episode, *, tell_server: bool) -> None:
        """Forget an episode (its queued request too); EnvClose to its server when it may still hold it."""
        if self._by_id.pop(episode.episode_id, None) is None:
            return
        self._episodes.pop((episode.generator, episode.gen_episode_id), None)
        pending = [r for r in self._queue if r.episode is episode]
        for req in pending:
            self._forget_request(req)
        for env in self._servers.values():
            for request_id, req in env.inflight.items():
                if req is not None and req.episode is episode:
                    self._settle(req)
                    env.inflight[request_id] = None  # answered late or never: its slot waits for that
                    pending.append(req)
        for req in pending:  # nobody waits for an answer that will not come
            if not req.answered:
                req.answered = True
                self._answer_error(episode.generator, req.msg, ErrorCode.INTERNAL, "the episode was closed",
                                   "env_error")
        env = self._servers.get(episode.server) if episode.server is not None else None
        if env is not None:
            env.episodes.discard(episode.episode_id)
            if tell_server:
                self._send(env.peer.id, EnvClose(episode_id=episode.episode_id))
        self.counters["episodes_closed"] += 1

    def _forget_request(self, req: _Request) -> None:
        self._settle(req)
        if req in self._queue:
            self._queue.remove(req)

    def _settle(self, req: _Request) -> None:
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None

    def _send(self, peer_id: bytes, msg: Any) -> None:
        if not self.server.send_nowait(peer_id, msg):
            self.counters["send_failed"] += 1

    def close(self) -> None:
        """Fail every open request (env_dead: the trainer is stopping) and close every episode."""
        pending = [*self._queue, *(r for env in self._servers.values() for r in env.inflight.values() if r is not None)]
        for req in pending:
            self._fail(req, ErrorCode.INTERNAL, "the trainer is stopping", "env_dead", tell_server=True)
        for episode in list(self._by_id.values()):
            self._close(episode, tell_server=True)
