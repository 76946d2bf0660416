"""Reward servers: the SDK that turns `score(prompt, completion, metadata) -> float | dict` into a reward
server, and RewardRouter, the trainer's client of reward servers. Wire rules: protocol/SPEC.md.

Run one: python examples/reward_server.py --connect tcp://127.0.0.1:5555
Test: pytest tests/protocol/test_reward_sdk.py tests/protocol/test_conformance.py

    serve()       recv loop: ScoreRequest -> one task each (<= max_concurrency, beyond: ScoreError 406);
                  the task runs score_fn (sync: thread pool; async: awaited) under the per-request
                  timeout and sends Score or ScoreError (waits for credit). Ends on Shutdown.
                  Every STATS_INTERVAL_S it sends Stats (requests, in flight, latency, errors) and Spans.
    RewardRouter  score() queues a request; _dispatch() sends it to the reward peer whose tasks match
                  with the fewest requests in flight below its Hello.max_inflight; Score/ScoreError come
                  back through Server.route(); peer events come through Server.add_listener(). A timeout,
                  a dead peer or ScoreError 406/407/504 retries on another peer while retries are left.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import importlib
import inspect
import itertools
import logging
import math
import numbers
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from tailrace.protocol.messages import ErrorCode, Score, ScoreError, ScoreRequest, Shutdown, Welcome
from tailrace.protocol.telemetry import RewardTelemetry, ServerTelemetry, publish_every
from tailrace.protocol.transport import Client, ConnectionLost, Peer, PeerEvent, Server, run

__all__ = ["RewardRouter", "RewardUnavailable", "ScoreFailed", "main", "run_server", "serve", "to_reply"]

log = logging.getLogger("tailrace.reward")

ScoreFn = Callable[[str, str, dict[str, Any]], "float | dict | Awaitable[float | dict]"]
MAX_TEXT = 4096
STATS_INTERVAL_S = 1.0  # Stats and Spans of a reward server, like every role's default trainer.stats_interval_s
MAX_DETAILS = 256
RETRY_CODES = (ErrorCode.NO_CREDIT, ErrorCode.UNSUPPORTED, ErrorCode.TIMEOUT)
"""ScoreError codes that another reward server may not give: over capacity, task refused, timed out."""


class ScoreFailed(Exception):
    """A completion could not be scored: `code` (ErrorCode: 504 timeout, 500 the function raised, 401 a
    bad return value, ...) and `text` from the last attempt."""

    def __init__(self, code: int, text: str):
        super().__init__(f"score failed ({code}): {text}")
        self.code = code
        self.text = text


class RewardUnavailable(Exception):
    """No reward server that scores this task is connected."""


def _tasks_match(tasks: Iterable[str], task: str) -> bool:
    return "*" in tasks or task in tasks


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real)  # bool, int, float, numpy scalars


def to_reply(request_id: int, value: Any) -> Score | ScoreError:
    """Check a score function's return value: a finite number, or a dict with a finite number under
    "reward" and other finite numbers (the details). Anything else is ScoreError 401."""
    def bad(text: str) -> ScoreError:
        return ScoreError(request_id=request_id, code=ErrorCode.BAD_FIELD, text=text[:MAX_TEXT])

    details: dict[str, float] = {}
    if isinstance(value, dict):
        if "reward" not in value:
            return bad(f"score function returned a dict without 'reward' (keys: {sorted(map(str, value))[:8]})")
        if len(value) - 1 > MAX_DETAILS:
            return bad(f"score function returned {len(value) - 1} details; at most {MAX_DETAILS}")
        for key, x in value.items():
            if key == "reward":
                continue
            if type(key) is not str or len(key) > 1024:
                return bad(f"detail key {key!r} must be a str of at most 1024 characters")
            if not _is_number(x) or not math.isfinite(float(x)):
                return bad(f"detail {key!r} must be a finite number, got {x!r}")
            details[key] = float(x)
        value = value["reward"]
    if not _is_number(value):
        return bad(f"score function returned {type(value).__name__}; expected a number or a dict with 'reward'")
    reward = float(value)
    if not math.isfinite(reward):
        return bad(f"score function returned a non-finite reward ({reward})")
    return Score(request_id=request_id, reward=reward, details=details)


# ============================================================================================ SDK


class _Scorer:
    """Runs the user's function: a coroutine function is awaited, anything else runs in a thread pool.
    A sync function that overruns its timeout keeps its thread until it returns (threads cannot be
    killed); its reply is already sent as 504."""

    def __init__(self, score_fn: ScoreFn, max_concurrency: int, timeout_s: float):
        self.fn = score_fn
        self.timeout_s = timeout_s
        call = type(score_fn).__call__ if not inspect.isroutine(score_fn) else None  # callable objects
        self.is_async = inspect.iscoroutinefunction(score_fn) or inspect.iscoroutinefunction(call)
        self.pool = None if self.is_async else concurrent.futures.ThreadPoolExecutor(
            max_workers=max_concurrency, thread_name_prefix="reward")

    async def score(self, req: ScoreRequest) -> Score | ScoreError:
        limit_s = self.timeout_s if req.timeout_s <= 0 else min(self.timeout_s, req.timeout_s)
        metadata = dict(req.metadata)
        try:
            if self.is_async:
                pending = self.fn(req.prompt, req.completion, metadata)
            else:
                pending = asyncio.get_running_loop().run_in_executor(
                    self.pool, self.fn, req.prompt, req.completion, metadata)
            value = await asyncio.wait_for(pending, limit_s)
        except TimeoutError:
            return ScoreError(request_id=req.request_id, code=ErrorCode.TIMEOUT,
                              text=f"score function timed out after {limit_s:g} s")
        except Exception as exc:  # the user's function failed: that is a ScoreError, not our crash
            log.warning("score function failed on request %d: %r", req.request_id, exc)
            return ScoreError(request_id=req.request_id, code=ErrorCode.INTERNAL,
                              text=f"{type(exc).__name__}: {exc}"[:MAX_TEXT])
        return to_reply(req.request_id, value)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


async def serve(score_fn: ScoreFn, address: str, *, tasks: Iterable[str] = ("*",), name: str | None = None,
                max_concurrency: int = 16, timeout_s: float = 60.0, curve_server_key: bytes | None = None,
                curve_secret_key: bytes | None = None, context: Any = None, connect_timeout_s: float = 60.0,
                on_welcome: Callable[[Welcome], None] | None = None, waiting_every_s: float = 10.0) -> str:
    """Connect to the trainer at `address` as a reward server for `tasks` ("*" = any) and answer
    ScoreRequests until the trainer says Shutdown (returns its reason). A refused or unanswered Hello is
    retried with backoff for `connect_timeout_s` (math.inf: until a trainer answers), saying "waiting for a
    trainer at ADDR" every `waiting_every_s` meanwhile (0: silent). A session the trainer declared dead while
    this process was alive (frozen, starved: Error 410) is followed by a new one under the same name, its
    unanswered requests dropped (the trainer sends them elsewhere). Raises transport.ConnectionLost when the
    trainer disappears or a successor takes the name over (409), Rejected / ConnectTimeout when it cannot join."""
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    tasks = tuple(tasks)
    scorer = _Scorer(score_fn, max_concurrency, timeout_s)
    name = name or f"reward-{socket.gethostname()}-{os.getpid()}"
    telemetry = RewardTelemetry(name, max_concurrency)
    try:
        while True:
            client = Client(address, role="reward", name=name, tasks=tasks, max_inflight=max_concurrency,
                            curve_server_key=curve_server_key, curve_secret_key=curve_secret_key, context=context)
            try:
                return await _session(client, scorer, telemetry, tasks, connect_timeout_s, waiting_every_s,
                                      on_welcome)
            except ConnectionLost as exc:
                if not exc.declared_dead:
                    raise
                log.warning("reward server %s: %s; joining again as a new session", name, exc)
    finally:
        scorer.close()


async def _session(client: Client, scorer: _Scorer, telemetry: ServerTelemetry, tasks: tuple[str, ...],
                   connect_timeout_s: float, waiting_every_s: float,
                   on_welcome: Callable[[Welcome], None] | None) -> str:
    """One session of serve(): Hello, then requests until Shutdown (its reason) or ConnectionLost."""
    max_concurrency = client.hello.max_inflight
    active: set[asyncio.Task] = set()
    failed: asyncio.Future = asyncio.get_running_loop().create_future()

    def done(task: asyncio.Task) -> None:
        active.discard(task)
        if not task.cancelled() and task.exception() is not None and not failed.done():
            failed.set_exception(task.exception())

    async def send(msg: Any) -> None:
        try:
            await client.send(msg)
        except ConnectionLost:
            if client.shutdown_reason is None:  # a reply racing the trainer's Shutdown is not an error
                raise

    async def answer(req: ScoreRequest) -> None:
        ticket = telemetry.start()
        reply = await scorer.score(req)
        telemetry.finish(ticket, failed=isinstance(reply, ScoreError))
        await send(reply)

    stats = None
    try:
        welcome = await client.connect(min(10.0, connect_timeout_s), retry_for_s=connect_timeout_s,
                                       waiting_every_s=waiting_every_s)
        log.info("reward server %s serving %s for run %s", client.hello.name, list(tasks), welcome.run_id)
        if on_welcome is not None:
            on_welcome(welcome)
        stats = asyncio.create_task(publish_every(telemetry, send, STATS_INTERVAL_S), name="reward-stats")
        stats.add_done_callback(done)  # a failure surfaces like a request task's
        while True:
            msg = await _next_message(client, failed)
            if isinstance(msg, ScoreRequest):
                if not _tasks_match(tasks, msg.task):
                    await client.send(ScoreError(request_id=msg.request_id, code=ErrorCode.UNSUPPORTED,
                                                 text=f"task {msg.task!r} is not one of {list(tasks)}"))
                elif len(active) >= max_concurrency:
                    await client.send(ScoreError(request_id=msg.request_id, code=ErrorCode.NO_CREDIT,
                                                 text=f"{max_concurrency} requests already in flight"))
                else:
                    task = asyncio.create_task(answer(msg), name=f"score-{msg.request_id}")
                    active.add(task)
                    task.add_done_callback(done)
            elif isinstance(msg, Shutdown):
                log.info("trainer shut down: %s", msg.reason)
                return msg.reason
            else:
                log.info("ignored %s from the trainer: %s", type(msg).__name__, msg)
    finally:
        for task in (*active, *([stats] if stats else [])):
            task.cancel()
        await asyncio.gather(*active, *([stats] if stats else []), return_exceptions=True)
        await client.close()


async def _next_message(client: Client, failed: asyncio.Future) -> Any:
    """client.recv(), unless a request task failed first (then its error is raised)."""
    recv = asyncio.ensure_future(client.recv())
    try:
        await asyncio.wait((recv, failed), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not recv.done():
            recv.cancel()
    if failed.done():
        failed.result()
    return recv.result()


def run_server(score_fn: ScoreFn, address: str, **kwargs: Any) -> str:
    """Blocking serve() on uvloop (when installed). Returns the trainer's Shutdown reason."""
    return run(serve(score_fn, address, **kwargs))


def main(score_fn: ScoreFn | None = None, argv: list[str] | None = None) -> int:
    """Command line of a reward server: --connect ADDR [--fn module:function] [--tasks a,b] [--name N]
    [--max-concurrency N] [--timeout-s S] [--curve-server-key FILE]. Returns the exit status."""
    parser = argparse.ArgumentParser(description="Serve a reward function to a tailrace trainer.")
    parser.add_argument("--connect", required=True, help="trainer address, e.g. tcp://127.0.0.1:5555")
    if score_fn is None:
        parser.add_argument("--fn", required=True, help="module:function to serve")
    parser.add_argument("--tasks", default="*", help="comma-separated task names it scores (default: all)")
    parser.add_argument("--name", default=None, help="unique name in the run (default: reward-<host>-<pid>)")
    parser.add_argument("--max-concurrency", type=int, default=16, help="requests scored at once")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per-request time limit in seconds")
    parser.add_argument("--curve-server-key", default="", help="file holding the trainer's CURVE public key")
    parser.add_argument("--curve-key", default="", help="file holding this server's CURVE secret key")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reward %(levelname)s %(message)s")
    if score_fn is None:
        module, _, attr = args.fn.partition(":")
        if not attr:
            parser.error("--fn must look like module:function")
        score_fn = getattr(importlib.import_module(module), attr)
    from tailrace.protocol.transport import TransportError, read_key

    try:
        reason = run_server(score_fn, args.connect, tasks=[t for t in args.tasks.split(",") if t],
                            name=args.name, max_concurrency=args.max_concurrency, timeout_s=args.timeout_s,
                            curve_server_key=read_key(args.curve_server_key, "--curve-server-key"),
                            curve_secret_key=read_key(args.curve_key, "--curve-key"))
    except TransportError as exc:
        print(f"reward server: {exc}", flush=True)
        return 1
    except KeyboardInterrupt:
        return 130
    log.info("stopped: %s", reason)
    return 0


# ============================================================================================ router


@dataclasses.dataclass(eq=False)
class _Request:
    task: str
    prompt: str
    completion: str
    metadata: dict[str, Any]
    timeout_s: float
    retries_left: int
    future: asyncio.Future
    deadline_s: float = 0.0
    request_id: int = -1
    peer_id: bytes | None = None
    timer: asyncio.TimerHandle | None = None
    tried: set = dataclasses.field(default_factory=set)


@dataclasses.dataclass(eq=False)
class _RewardPeer:
    peer: Peer
    inflight: dict[int, _Request | None] = dataclasses.field(default_factory=dict)
    """request_id -> request; None when the request was given up on (timed out): the slot stays taken
    until the reply arrives or the peer goes, so a stalled server never gets more than max_inflight."""

    def serves(self, task: str) -> bool:
        return _tasks_match(self.peer.tasks, task)

    def has_room(self) -> bool:
        return len(self.inflight) < self.peer.max_inflight


class RewardRouter:
    """The trainer's client of reward servers attached to `server`. `await score(...)` returns a Score or
    raises ScoreFailed / RewardUnavailable. Score and ScoreError never reach the server's recv()."""

    def __init__(self, server: Server, *, timeout_s: float = 60.0, retries: int = 1, grace_s: float = 1.0):
        if timeout_s <= 0 or retries < 0 or grace_s < 0:
            raise ValueError(f"need timeout_s > 0, retries >= 0, grace_s >= 0; got {timeout_s}, {retries}, {grace_s}")
        self.server = server
        self.timeout_s, self.retries, self.grace_s = timeout_s, retries, grace_s
        self.counters: collections.Counter[str] = collections.Counter()
        self._peers: dict[bytes, _RewardPeer] = {}
        self._pending: collections.deque[_Request] = collections.deque()
        self._ids = itertools.count(1)
        server.route((Score, ScoreError), self._on_reply)
        server.add_listener(self._on_peer_event)
        for peer in server.peers.values():
            if peer.role == "reward":
                self._peers[peer.id] = _RewardPeer(peer)

    def has_server(self, task: str) -> bool:
        return any(p.serves(task) for p in self._peers.values())

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def score(self, task: str, prompt: str, completion: str, metadata: dict[str, Any] | None = None, *,
                    timeout_s: float | None = None, retries: int | None = None) -> Score:
        """Score one completion on a reward server for `task`. Each attempt (queueing for a free slot
        included) has `timeout_s`; a timeout, a lost server, or ScoreError 406/407/504 is retried on
        another server up to `retries` times."""
        metadata = dict(metadata or {})
        for key, value in metadata.items():
            if type(key) is not str or not (value is None or type(value) in (bool, int, float, str)):
                raise ValueError(f"metadata[{key!r}]: only str keys and nil/bool/int/float/str values travel")
        if not self.has_server(task):
            raise RewardUnavailable(f"no reward server for task {task!r} is connected")
        req = _Request(task=task, prompt=prompt, completion=completion, metadata=metadata,
                       timeout_s=self.timeout_s if timeout_s is None else timeout_s,
                       retries_left=self.retries if retries is None else retries,
                       future=asyncio.get_running_loop().create_future())
        self._enqueue(req)
        self._dispatch()
        try:
            return await req.future
        finally:
            if not req.future.done() or req.future.cancelled():  # the caller gave up: free what it holds
                req.future.cancel()
                self._forget(req)

    def close(self) -> None:
        for req in list(self._pending):
            self._fail(req, RewardUnavailable("reward router closed"))
        for rp in self._peers.values():
            for req in list(rp.inflight.values()):
                if req is not None:
                    self._fail(req, RewardUnavailable("reward router closed"))

    # ---------------------------------------------------------------------------------- internals

    def _enqueue(self, req: _Request, front: bool = False) -> None:
        req.request_id, req.peer_id = -1, None
        req.deadline_s = time.monotonic() + req.timeout_s
        req.timer = asyncio.get_running_loop().call_later(req.timeout_s + self.grace_s, self._on_timeout, req)
        (self._pending.appendleft if front else self._pending.append)(req)

    def _dispatch(self) -> None:
        if not self._pending:
            return
        waiting: collections.deque[_Request] = collections.deque()
        unusable: set[bytes] = set()
        while self._pending:
            req = self._pending.popleft()
            candidates = [p for p in self._peers.values()
                          if p.peer.id not in unusable and p.has_room() and p.serves(req.task)]
            if not candidates:
                waiting.append(req)
                continue
            rp = min(candidates, key=lambda p: (p.peer.id in req.tried, len(p.inflight)))
            request_id = next(self._ids)
            msg = ScoreRequest(request_id=request_id, task=req.task, prompt=req.prompt, completion=req.completion,
                               metadata=req.metadata,
                               timeout_s=min(86400.0, max(0.001, req.deadline_s - time.monotonic())))
            if not self.server.send_nowait(rp.peer.id, msg):
                self.counters["send_failed"] += 1
                unusable.add(rp.peer.id)
                self._pending.appendleft(req)
                continue
            req.request_id, req.peer_id = request_id, rp.peer.id
            req.tried.add(rp.peer.id)
            rp.inflight[request_id] = req
            self.counters["sent"] += 1
        self._pending = waiting

    def _on_reply(self, peer: Peer, msg: Score | ScoreError) -> None:
        rp = self._peers.get(peer.id)
        if rp is None or msg.request_id not in rp.inflight:
            self.counters["replies/unknown"] += 1
            return
        req = rp.inflight.pop(msg.request_id)
        if req is None:
            self.counters["replies/late"] += 1
        elif isinstance(msg, Score):
            self.counters["replies/score"] += 1
            self._settle(req)
            req.future.set_result(msg)
        else:
            self.counters[f"replies/error_{msg.code}"] += 1
            self._retry_or_fail(req, msg.code, f"{peer.name}: {msg.text}", retry=msg.code in RETRY_CODES)
        self._dispatch()

    def _on_peer_event(self, event: PeerEvent) -> None:
        if event.role != "reward":
            return
        if event.event == "joined":
            self._peers[event.id] = _RewardPeer(event.peer)
        else:
            rp = self._peers.pop(event.id, None)
            if rp is not None:
                for req in rp.inflight.values():
                    if req is not None:
                        self._retry_or_fail(req, ErrorCode.INTERNAL,
                                            f"reward server {event.name} {event.event}: {event.reason}", retry=True)
            for req in [r for r in self._pending if not self.has_server(r.task)]:
                self._pending.remove(req)
                self._fail(req, RewardUnavailable(f"no reward server for task {req.task!r} is connected"))
        self._dispatch()

    def _on_timeout(self, req: _Request) -> None:
        req.timer = None
        if req.future.done():
            return
        self.counters["timeouts"] += 1
        self._forget(req)
        self._retry_or_fail(req, ErrorCode.TIMEOUT, f"no reply within {req.timeout_s:g} s", retry=True)
        self._dispatch()

    def _retry_or_fail(self, req: _Request, code: int, text: str, retry: bool) -> None:
        self._settle(req)
        if req.future.done():
            return
        if retry and req.retries_left > 0 and self.has_server(req.task):
            req.retries_left -= 1
            self.counters["retries"] += 1
            self._enqueue(req, front=True)
        elif retry and not self.has_server(req.task):
            self._fail(req, RewardUnavailable(f"no reward server for task {req.task!r} is connected ({text})"))
        else:
            self._fail(req, ScoreFailed(code, text))

    def _settle(self, req: _Request) -> None:
        if req.timer is not None:
            req.timer.cancel()
            req.timer = None

    def _fail(self, req: _Request, exc: Exception) -> None:
        self._settle(req)
        self._forget(req)
        if not req.future.done():
            req.future.set_exception(exc)

    def _forget(self, req: _Request) -> None:
        """Take a request out of the queue; a sent one leaves its slot marked as given up."""
        self._settle(req)
        if req.peer_id is None:
            if req in self._pending:
                self._pending.remove(req)
            return
        rp = self._peers.get(req.peer_id)
        if rp is not None and rp.inflight.get(req.request_id) is req:
            rp.inflight[req.request_id] = None
        req.request_id, req.peer_id = -1, None
