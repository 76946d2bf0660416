"""Asyncio ZeroMQ transport: the trainer's Server binds, every other process is a Client that connects.

One address is all a client needs: tcp://host:port, ipc://path, or inproc://name with a shared ZeroMQ
context (e.g. one zmq.asyncio.Context: the in-process twin used by tests). Sockets are driven by the
asyncio loop through their ZMQ_FD (_Wire); run() uses uvloop. Conversation rules (handshake, heartbeats,
credits, CURVE, size limits): protocol/SPEC.md. Test: pytest tests/protocol/test_transport.py

  Server = ROUTER (sessions) + PUB (notices)              Client = DEALER [+ SUB after subscribe()]
  task server-recv: waits for ROUTER readable; <= BATCH    task client-recv: waits for DEALER readable;
     messages per wakeup. Hello -> Welcome | Reject;          Heartbeat: alive; Credit: wakes send();
     Heartbeat, Credit, Shutdown handled here; routed         Shutdown, the rest -> inbox (<= max_queue)
     kinds -> handler; the rest take 1 credit -> inbox     send(): waits while credits == 0 or the
  recv() (owner): pops the inbox; each credits/2 messages     socket is full; unblocked by Credit
     popped from a peer -> Credit(n) to that peer          task client-heartbeat: every interval sends
  task server-heartbeat: every interval a Heartbeat to        Heartbeat; silent server -> ConnectionLost
     each peer; a peer silent > peer_timeout_s is dead
Bounds: the inbox holds <= credits x max_peers messages (+ lifecycle events); a message beyond its peer's
credit is dropped and counted. ZeroMQ high-water marks are never waited on: a send that would block fails
and is counted (server) or waits for room (client).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import Any

import zmq
import zmq.backend

from protocol import codec
from protocol.codec import Limits, ProtocolError
from protocol.messages import (
    PROTOCOL_VERSION,
    ROLES,
    Credit,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Reject,
    Shutdown,
    Welcome,
)

__all__ = ["Client", "ConnectTimeout", "ConnectionLost", "Peer", "PeerEvent", "Rejected", "Server",
           "TransportError", "generate_keypair", "run"]

log = logging.getLogger("tailrace.transport")

BATCH = 256  # messages handled per wakeup before yielding to other tasks
FREE_KINDS = (Hello, Heartbeat, Credit, Shutdown)  # messages that consume no credit
LINGER_MS = 200  # how long a closed socket keeps trying to deliver its last messages (Shutdown)
MAX_TEXT = 4096  # Error/Reject text bound on the wire


def run(coro: Any) -> Any:
    """Run a coroutine to completion on uvloop when it is installed, else on the default asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def generate_keypair() -> tuple[bytes, bytes]:
    """A new CURVE key pair (public, secret), each 40 bytes of Z85 text."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    return zmq.curve_keypair()


class TransportError(Exception):
    """The connection cannot be used (closed, failed, or lost)."""


class ConnectionLost(TransportError):
    """The other side went away: missed heartbeats, Shutdown, forgot us (Error 405), or closed."""


class Rejected(TransportError):
    """The trainer answered Hello with Reject (or Error): code and text say why."""

    def __init__(self, code: int, text: str):
        super().__init__(f"rejected ({code}): {text}")
        self.code = code
        self.text = text


class ConnectTimeout(TransportError, TimeoutError):
    """No Welcome within the connect timeout."""


@dataclasses.dataclass(eq=False)
class Peer:
    """A welcomed peer as the server sees it. `credits`: messages it may still send (server's view);
    `consumed`: messages the owner took since the last Credit. Times are time.monotonic() seconds."""

    id: bytes
    hello: Hello
    joined_s: float
    last_seen_s: float
    credits: int
    consumed: int = 0
    alive: bool = True

    @property
    def role(self) -> str:
        return self.hello.role

    @property
    def name(self) -> str:
        return self.hello.name

    @property
    def tasks(self) -> list[str]:
        return self.hello.tasks

    @property
    def max_inflight(self) -> int:
        return self.hello.max_inflight


@dataclasses.dataclass(frozen=True)
class PeerEvent:
    """A peer's lifecycle, delivered by Server.recv() as (PeerEvent, None), in order with its messages.
    event: "joined", "left" (Shutdown, new Hello, or server closing) or "dead" (missed heartbeats)."""

    event: str
    peer: Peer
    reason: str = ""

    @property
    def id(self) -> bytes:
        return self.peer.id

    @property
    def role(self) -> str:
        return self.peer.role

    @property
    def name(self) -> str:
        return self.peer.name


def _scheme(address: str) -> tuple[str, str]:
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise ValueError(f"address {address!r}: expected tcp://host:port, ipc://path or inproc://name")
    return scheme, rest


def _bind_address(address: str) -> str:
    scheme, rest = _scheme(address)
    if scheme != "tcp":
        return address
    host, colon, port = rest.rpartition(":")
    if not colon or not port:
        raise ValueError(f"address {address!r}: tcp needs host:port (port 0 picks a free one)")
    return f"tcp://{host or '127.0.0.1'}:{'*' if port == '0' else port}"


def _notice_bind_address(bound: str) -> str:
    scheme, rest = _scheme(bound)
    if scheme == "tcp":
        return f"tcp://{rest.rpartition(':')[0]}:*"
    return bound if rest == "*" else f"{bound}.notice"


def _notice_connect_address(notice_endpoint: str, connect_address: str) -> str:
    """tcp notice endpoints name the server's bind host; a client reaches it at its own connect host."""
    if notice_endpoint.startswith("tcp://") and connect_address.startswith("tcp://"):
        host = connect_address[len("tcp://"):].rpartition(":")[0]
        return f"tcp://{host}:{notice_endpoint.rpartition(':')[2]}"
    return notice_endpoint


class _Ticks:
    """Heartbeat clock. next() sleeps to the next tick and says whether silence may be judged now: not
    right after the event loop stalled, when heartbeats that did arrive may still wait unread."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._next_s = time.monotonic()

    async def next(self) -> bool:
        self._next_s += self.interval_s
        await asyncio.sleep(max(0.0, self._next_s - time.monotonic()))
        late_s = time.monotonic() - self._next_s
        if late_s > self.interval_s:
            self._next_s = time.monotonic()
            return False
        return True


class _RateLimiter:
    """Token bucket per key (a peer identity), with a bounded number of keys."""

    def __init__(self, rate_per_s: float, burst: float, max_keys: int = 4096):
        self.rate_per_s, self.burst, self.max_keys = rate_per_s, burst, max_keys
        self._buckets: collections.OrderedDict[bytes, tuple[float, float]] = collections.OrderedDict()

    def allow(self, key: bytes) -> bool:
        now = time.monotonic()
        tokens, stamp = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - stamp) * self.rate_per_s)
        allowed = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return allowed


_EVENTS, _POLLIN, _POLLOUT = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.POLLOUT)
_NOBLOCK, _NOBLOCK_MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
# pyzmq's Cython methods: its Python layer (enums, options) costs several us per message
_base_send, _base_recv, _base_get = zmq.backend.Socket.send, zmq.backend.Socket.recv, zmq.backend.Socket.get
ZERO_COPY_MIN_BYTES = 64 << 10
"""Frames at least this large are handed to ZeroMQ without a copy (pyzmq keeps the buffer alive until
ZeroMQ is done with it); smaller ones are copied, which is cheaper than tracking them."""


def _recv_multipart(sock: zmq.Socket, num_copied: int) -> list:
    """One message, or zmq.Again. The first `num_copied` frames (envelope, header, body) come as
    bytes, which is cheapest for small frames; tensor frames after them as zero-copy zmq.Frames."""
    frames = [_base_recv(sock, _NOBLOCK, True)]
    while _base_get(sock, _RCVMORE):
        frames.append(_base_recv(sock, _NOBLOCK, len(frames) < num_copied))
    return frames


def _send_multipart(sock: zmq.Socket, frames: list) -> None:
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
        _base_send(sock, frame, _NOBLOCK_MORE if i < last else _NOBLOCK, size < ZERO_COPY_MIN_BYTES)


class _Wire:
    """One ZeroMQ socket driven by the asyncio loop. Its ZMQ_FD is edge-triggered and any send or
    receive may consume the edge, so: the receive loop sleeps only after a receive said EAGAIN, and every
    send schedules one ZMQ_EVENTS check (at most one per loop iteration) that wakes waiters. This is
    what zmq.asyncio does per call; doing it per loop iteration is several times cheaper at high rates."""

    def __init__(self, sock: zmq.Socket, num_copied: int):
        self.sock = sock
        self.num_copied = num_copied
        self._loop = asyncio.get_running_loop()
        self._fd = sock.getsockopt(zmq.FD)
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._check_scheduled = False
        self._loop.add_reader(self._fd, self._check)

    def _check(self) -> None:
        self._check_scheduled = False
        if self.sock.closed:
            return
        events = self.sock.getsockopt(_EVENTS)
        if events & _POLLIN:
            self._readable.set()
        if events & _POLLOUT:
            self._writable.set()

    def _schedule_check(self) -> None:
        if not self._check_scheduled:
            self._check_scheduled = True
            self._loop.call_soon(self._check)

    def send_nowait(self, frames: list) -> bool:
        """False when the socket has no room (EAGAIN); other ZeroMQ errors are raised."""
        try:
            _send_multipart(self.sock, frames)
            return True
        except zmq.Again:
            return False
        finally:
            self._schedule_check()

    async def send(self, frames: list) -> None:
        if not self._send_lock.locked() and self.send_nowait(frames):
            return
        async with self._send_lock:  # senders that had to wait go in order
            while True:
                if self.sock.closed:
                    raise TransportError("the socket was closed while a send waited for room")
                if self.send_nowait(frames):
                    return
                self._writable.clear()
                self._check()
                await self._writable.wait()

    async def drain_forever(self, handle: Callable[[list], None]) -> None:
        sock, num_copied = self.sock, self.num_copied
        while True:
            for _ in range(BATCH):
                try:
                    frames = _recv_multipart(sock, num_copied)
                except zmq.Again:
                    break
                handle(frames)
            else:
                await asyncio.sleep(0)  # a full batch: let the owner run before draining more
                continue
            self._readable.clear()
            await self._readable.wait()

    def recv_nowait(self) -> list | None:
        try:
            return _recv_multipart(self.sock, self.num_copied)
        except zmq.Again:
            return None

    async def wait_readable(self) -> None:
        """Call after recv_nowait() returned None. Also returns on wake()."""
        self._readable.clear()
        await self._readable.wait()

    def wake(self) -> None:
        self._readable.set()
        self._writable.set()

    def close(self) -> None:
        if not self.sock.closed:
            self._loop.remove_reader(self._fd)
            self.sock.close(linger=LINGER_MS)
        self.wake()


class _Endpoint:
    """What Server and Client share: supervised background tasks, an inbox, counters, sockets."""

    def __init__(self, limits: Limits, context: zmq.Context | None):
        self.limits = limits
        self.counters: collections.Counter[str] = collections.Counter()
        self._context = context
        self._wires: list[_Wire] = []
        self._tasks: set[asyncio.Task] = set()
        self._inbox: collections.deque = collections.deque()
        self._ready = asyncio.Event()
        self._error: BaseException | None = None  # set when the endpoint can no longer be used
        self._closed = False
        self._errors = _RateLimiter(rate_per_s=10.0, burst=10.0)

    def _socket(self, kind: int, curve_server_secret: bytes | None = None,
                curve_server_public: bytes | None = None) -> _Wire:
        ctx = self._context or zmq.Context.instance()
        sock = ctx.socket(kind, socket_class=zmq.Socket)
        try:
            sock.setsockopt(zmq.LINGER, LINGER_MS)
            sock.setsockopt(zmq.MAXMSGSIZE, self.limits.max_frame_bytes)
            if curve_server_secret is not None:
                sock.curve_server = True
                sock.curve_secretkey = curve_server_secret
            elif curve_server_public is not None:
                public, secret = self._client_keys
                sock.curve_serverkey = curve_server_public
                sock.curve_publickey = public
                sock.curve_secretkey = secret
            wire = _Wire(sock, num_copied=3 if kind == zmq.ROUTER else 2)  # ROUTER: + routing id
        except BaseException:
            sock.close(linger=0)
            raise
        self._wires.append(wire)
        return wire

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self._closed:
            return
        exc = task.exception()
        if exc is not None:
            log.error("transport task %s failed", task.get_name(), exc_info=exc)
            self._stop(TransportError(f"transport task {task.get_name()} failed: {exc!r}"), cause=exc)

    def _stop(self, error: BaseException, cause: BaseException | None = None) -> None:
        if self._error is None:
            error.__cause__ = cause
            self._error = error
        self._ready.set()

    async def _wait_inbox(self) -> None:
        while not self._inbox:
            if self._error is not None:
                raise self._error
            self._ready.clear()
            await self._ready.wait()

    def _send_nowait(self, wire: _Wire, frames: list) -> bool:
        """Hand frames to ZeroMQ without waiting. False (counted) when the pipe is full or the peer is
        not connected (ROUTER_MANDATORY)."""
        try:
            if wire.send_nowait(frames):
                return True
            self.counters["send_failed/full"] += 1
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self.counters["send_failed/unroutable"] += 1
        return False

    async def _close_all(self) -> None:
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # failures were reported by _task_done
        for wire in self._wires:
            wire.close()
        self._wires.clear()
        self._stop(TransportError("closed"))


# ============================================================================================ server


class Server(_Endpoint):
    """The binding side (the trainer). `await start()` or `async with Server(...)`, then loop on
    `peer, msg = await recv()`: msg is a message, or None when `peer` is a PeerEvent (joined, left,
    dead). `accept(hello)` may return a Reject to refuse a peer. The event loop must stay responsive
    (heavy compute in threads), or peers miss heartbeats."""

    def __init__(self, address: str = "tcp://127.0.0.1:0", *, run_id: str,
                 policy_version: int | Callable[[], int] = 0, drafter_version: int | Callable[[], int] = 0,
                 credits: int = 64, heartbeat_interval_s: float = 1.0, missed_heartbeats: int = 5,
                 limits: Limits = codec.DEFAULT_LIMITS, curve_secret_key: bytes | None = None,
                 curve_public_key: bytes | None = None, context: zmq.Context | None = None,
                 accept: Callable[[Hello], Reject | None] | None = None, max_peers: int = 1024):
        if not 1 <= credits <= 1 << 20:
            raise ValueError(f"credits must be in 1..2^20, got {credits}")
        if not 0.001 <= heartbeat_interval_s <= 3600:
            raise ValueError(f"heartbeat_interval_s must be in 0.001..3600, got {heartbeat_interval_s}")
        if missed_heartbeats < 1:
            raise ValueError(f"missed_heartbeats must be >= 1, got {missed_heartbeats}")
        if max_peers < 1:
            raise ValueError(f"max_peers must be >= 1, got {max_peers}")
        super().__init__(limits, context)
        self.address = _bind_address(address)  # the resolved endpoint once started
        self.notice_address = ""
        self.run_id = run_id
        self.credits = credits
        self.heartbeat_interval_s = heartbeat_interval_s
        self.peer_timeout_s = heartbeat_interval_s * missed_heartbeats
        self.max_peers = max_peers
        self._policy_version, self._drafter_version = policy_version, drafter_version
        self._curve_secret = curve_secret_key
        if curve_secret_key is not None and curve_public_key is None:
            curve_public_key = zmq.curve_public(curve_secret_key)
        self.curve_public_key = curve_public_key
        self._accept = accept
        self._grant_at = max(1, credits // 2)
        self._peers: dict[bytes, Peer] = {}
        self._names: dict[str, bytes] = {}
        self.peers = MappingProxyType(self._peers)
        self._routes: dict[type, Callable[[Peer, Any], None]] = {}
        self._listeners: list[Callable[[PeerEvent], None]] = []
        self._router: Any = None
        self._pub: Any = None

    @property
    def policy_version(self) -> int:
        v = self._policy_version
        return v() if callable(v) else v

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self._policy_version = value

    @property
    def drafter_version(self) -> int:
        v = self._drafter_version
        return v() if callable(v) else v

    @drafter_version.setter
    def drafter_version(self, value: int) -> None:
        self._drafter_version = value

    async def start(self) -> Server:
        if self._router is not None or self._closed:
            raise RuntimeError("start() was already called")
        try:
            self._router = self._socket(zmq.ROUTER, curve_server_secret=self._curve_secret)
            router = self._router.sock
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable sends fail loudly, never block
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting peer keeps its session
            router.bind(self.address)
            self.address = router.last_endpoint.decode()
            self._pub = self._socket(zmq.PUB, curve_server_secret=self._curve_secret)
            self._pub.sock.bind(_notice_bind_address(self.address))
            self.notice_address = self._pub.sock.last_endpoint.decode()
        except BaseException:
            await self._close_all()
            raise
        if self.address.startswith("tcp://") and self._curve_secret is None and not any(
                h in self.address for h in ("//127.", "//localhost", "//[::1]")):
            log.warning("listening on %s without CURVE: anyone who can reach it can join", self.address)
        self._spawn(self._router.drain_forever(self._on_frames), "server-recv")
        self._spawn(self._heartbeat_loop(), "server-heartbeat")
        return self

    async def __aenter__(self) -> Server:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # ---------------------------------------------------------------------------------- owner API

    async def recv(self) -> tuple[Any, Any]:
        """Next (Peer, message), or (PeerEvent, None) for a lifecycle event, in arrival order."""
        if not self._inbox:
            await self._wait_inbox()
        return self._take()

    def recv_nowait(self) -> tuple[Any, Any] | None:
        return self._take() if self._inbox else None

    @property
    def num_queued(self) -> int:
        """Items waiting for recv() (bounded by credits x peers, plus lifecycle events)."""
        return len(self._inbox)

    def _take(self) -> tuple[Any, Any]:
        peer, msg = self._inbox.popleft()
        if msg is not None and peer.alive:
            peer.consumed += 1
            if peer.consumed >= self._grant_at:
                self._grant(peer)
        return peer, msg

    async def send(self, peer_id: bytes, msg: Any) -> bool:
        """Send to one peer. False (and counted) when it is gone or its pipe is full: ZeroMQ never
        blocks the server; the owner bounds what it sends (e.g. by the peer's max_inflight)."""
        return self.send_nowait(peer_id, msg)

    def send_nowait(self, peer_id: bytes, msg: Any) -> bool:
        if peer_id not in self._peers:
            self.counters["send_failed/unknown_peer"] += 1
            return False
        return self._send_nowait(self._router, [peer_id, *codec.encode(msg)])

    async def publish(self, msg: Any) -> None:
        """Send a notice to every subscriber (PUB: a slow subscriber loses notices, never blocks us)."""
        self._send_nowait(self._pub, codec.encode(msg))

    def route(self, kinds: Iterable[type], handler: Callable[[Peer, Any], None]) -> None:
        """Hand messages of these kinds to `handler(peer, msg)` (called in the receive loop, must not
        block) instead of the inbox. They count as consumed at once. Used by protocol.reward.RewardRouter."""
        for kind in kinds:
            self._routes[kind] = handler

    def add_listener(self, listener: Callable[[PeerEvent], None]) -> None:
        """Call `listener(event)` for every PeerEvent, as it happens (the inbox still gets it too)."""
        self._listeners.append(listener)

    async def close(self, reason: str = "server closing") -> None:
        """Send Shutdown to every peer and subscriber, then stop the loops and close the sockets."""
        if self._closed:
            return
        try:
            if self._router is not None and self._error is None:
                bye = codec.encode(Shutdown(reason=reason))
                for peer_id in list(self._peers):
                    self._send_nowait(self._router, [peer_id, *bye])
                self._send_nowait(self._pub, bye)
        finally:
            await self._close_all()

    # ---------------------------------------------------------------------------------- receive

    def _on_frames(self, frames: list) -> None:
        ident = frames[0]
        peer = self._peers.get(ident)
        if peer is not None:
            peer.last_seen_s = time.monotonic()
        try:
            msg = codec.decode(frames[1:], self.limits)
        except ProtocolError as exc:
            self._bad_input(ident, frames[1:], exc)
            return
        except Exception as exc:  # the codec promises ProtocolError; no input may stop this loop anyway
            log.exception("decoding a message from %r failed", ident)
            self._bad_input(ident, frames[1:], ProtocolError(f"{type(exc).__name__}: {exc}",
                                                             code=ErrorCode.INTERNAL))
            return
        kind = type(msg)
        if peer is None:
            if kind is Hello:
                self._on_hello(ident, msg)
            elif kind is Shutdown or kind is Error:  # never answer an Error with an Error
                self.counters["ignored/not_welcome"] += 1
            else:
                self.counters["dropped/not_welcome"] += 1
                self._reply_error(ident, ErrorCode.NOT_WELCOME, "send Hello and wait for Welcome first", kind.KIND)
            return
        if kind in FREE_KINDS:
            if kind is Hello:
                self._end(peer, "left", "sent a new Hello")
                self._on_hello(ident, msg)
            elif kind is Shutdown:
                self._end(peer, "left", msg.reason or "peer shut down")
            elif kind is Credit:
                self.counters["ignored/credit"] += 1
            return
        if kind is Welcome or kind is Reject:
            self._reply_error(ident, ErrorCode.UNSUPPORTED, f"peers do not send {kind.__name__}", kind.KIND)
            return
        if peer.credits <= 0:
            self.counters["dropped/no_credit"] += 1
            self._reply_error(ident, ErrorCode.NO_CREDIT, "message sent without credit was dropped", kind.KIND)
            return
        peer.credits -= 1
        self.counters["received"] += 1
        handler = self._routes.get(kind)
        if handler is None:
            self._put((peer, msg))
            return
        peer.consumed += 1
        if peer.consumed >= self._grant_at:
            self._grant(peer)
        try:
            handler(peer, msg)
        except Exception:  # a routed handler's bug must not stop the receive loop
            self.counters["errors/route_handler"] += 1
            log.exception("route handler for %s failed", kind.__name__)

    def _bad_input(self, ident: bytes, frames: list, exc: ProtocolError) -> None:
        self.counters["bad_input"] += 1
        self.counters[f"bad_input/{exc.code}"] += 1
        try:
            kind = codec.peek_header(frames[0])[1] if frames else 0
        except ProtocolError:
            kind = 0
        if kind == Hello.KIND and exc.code == ErrorCode.VERSION_MISMATCH and ident not in self._peers:
            self._reply(ident, Reject(code=exc.code, text=str(exc)[:MAX_TEXT]), limited=True)
            return
        self._reply_error(ident, exc.code, str(exc), kind)

    def _reply_error(self, ident: bytes, code: int, text: str, ref_kind: int = 0) -> None:
        self._reply(ident, Error(code=code, text=text[:MAX_TEXT], ref_kind=ref_kind), limited=True)

    def _reply(self, ident: bytes, msg: Any, limited: bool = False) -> bool:
        if limited and not self._errors.allow(ident):
            self.counters["errors/rate_limited"] += 1
            return False
        if limited:
            self.counters["errors/sent"] += 1
        return self._send_nowait(self._router, [ident, *codec.encode(msg)])

    def _on_hello(self, ident: bytes, hello: Hello) -> None:
        reject = self._check_hello(hello)
        if reject is not None:
            self.counters["peers/rejected"] += 1
            log.info("rejected %s %r: %s", hello.role, hello.name, reject.text)
            self._reply(ident, reject, limited=True)
            return
        now = time.monotonic()
        peer = Peer(id=ident, hello=hello, joined_s=now, last_seen_s=now, credits=self.credits)
        welcome = Welcome(run_id=self.run_id, policy_version=self.policy_version, credits=self.credits,
                          heartbeat_interval_s=self.heartbeat_interval_s, peer_timeout_s=self.peer_timeout_s,
                          notice_endpoint=self.notice_address, max_message_bytes=self.limits.max_message_bytes,
                          drafter_version=self.drafter_version)
        self._peers[ident] = peer
        self._names[hello.name] = ident
        self._reply(ident, welcome)
        self.counters["peers/joined"] += 1
        log.info("%s %r joined", hello.role, hello.name)
        self._event(PeerEvent("joined", peer))

    def _check_hello(self, hello: Hello) -> Reject | None:
        if hello.protocol_version != PROTOCOL_VERSION:
            return Reject(code=ErrorCode.VERSION_MISMATCH, text=(
                f"protocol version {hello.protocol_version} not supported; this trainer speaks {PROTOCOL_VERSION}"))
        if hello.role == "trainer":
            return Reject(code=ErrorCode.UNAUTHORIZED, text="role 'trainer' is this endpoint's own")
        if not hello.name:
            return Reject(code=ErrorCode.UNAUTHORIZED, text="name must not be empty")
        if hello.name in self._names:
            return Reject(code=ErrorCode.UNAUTHORIZED, text=f"name {hello.name!r} is already connected")
        if len(self._peers) >= self.max_peers:
            return Reject(code=ErrorCode.UNAUTHORIZED, text=f"this trainer serves at most {self.max_peers} peers")
        if self._accept is None:
            return None
        try:
            return self._accept(hello)
        except Exception as exc:  # the owner's hook failing must not stop the receive loop
            log.exception("accept hook failed for %r", hello.name)
            return Reject(code=ErrorCode.INTERNAL, text=f"accept hook failed: {type(exc).__name__}")

    def _end(self, peer: Peer, event: str, reason: str) -> None:
        del self._peers[peer.id]
        del self._names[peer.name]
        peer.alive = False
        self.counters[f"peers/{event}"] += 1
        (log.warning if event == "dead" else log.info)("%s %r %s: %s", peer.role, peer.name, event, reason)
        self._event(PeerEvent(event, peer, reason))

    def _event(self, event: PeerEvent) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # a listener's bug must not stop the receive loop
                self.counters["errors/listener"] += 1
                log.exception("peer listener failed on %s", event.event)
        self._put((event, None))

    def _put(self, item: tuple) -> None:
        self._inbox.append(item)
        self._ready.set()

    def _grant(self, peer: Peer) -> None:
        if self._send_nowait(self._router, [peer.id, *codec.encode(Credit(credits=peer.consumed))]):
            peer.credits += peer.consumed
            peer.consumed = 0  # else kept, and granted again at the next heartbeat

    async def _heartbeat_loop(self) -> None:
        seq = 0
        ticks = _Ticks(self.heartbeat_interval_s)
        while True:
            reap = await ticks.next()
            now = time.monotonic()
            beat = codec.encode(Heartbeat(seq=seq, wall_s=time.time()))
            seq += 1
            for peer in list(self._peers.values()):
                silent_s = now - peer.last_seen_s
                if reap and silent_s > self.peer_timeout_s:
                    self._end(peer, "dead", f"no message for {silent_s:.3f} s (timeout {self.peer_timeout_s} s)")
                    self._reply(peer.id, Error(code=ErrorCode.NOT_WELCOME, text="declared dead: missed heartbeats"))
                    continue
                self._send_nowait(self._router, [peer.id, *beat])
                if peer.consumed:
                    self._grant(peer)


# ============================================================================================ client


class Client(_Endpoint):
    """The connecting side. `async with Client(...) as c: welcome = await c.connect()`, then send() and
    recv(). recv() raises ConnectionLost once the server is gone (after what arrived before)."""

    def __init__(self, address: str, *, role: str, name: str, tasks: Iterable[str] = (), max_inflight: int = 1,
                 capabilities: dict[str, Any] | None = None, package_version: str | None = None,
                 curve_server_key: bytes | None = None, curve_public_key: bytes | None = None,
                 curve_secret_key: bytes | None = None, limits: Limits = codec.DEFAULT_LIMITS,
                 context: zmq.Context | None = None, max_queue: int = 1 << 16):
        _scheme(address)
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        super().__init__(limits, context)
        self.address = address
        if package_version is None:
            from importlib.metadata import PackageNotFoundError, version

            try:
                package_version = version("tailrace")
            except PackageNotFoundError:
                package_version = "0+unknown"
        self.hello = Hello(role=role, name=name, protocol_version=PROTOCOL_VERSION, package_version=package_version,
                           tasks=list(tasks), max_inflight=max_inflight, capabilities=dict(capabilities or {}))
        self.curve_server_key = curve_server_key
        if curve_server_key is not None and (curve_public_key is None or curve_secret_key is None):
            curve_public_key, curve_secret_key = generate_keypair()
        self._client_keys = (curve_public_key, curve_secret_key)
        self.max_queue = max_queue
        self.welcome: Welcome | None = None
        self._credits = 0
        self._credit_ready = asyncio.Event()
        self._welcomed: asyncio.Future | None = None
        self._last_seen_s = 0.0
        self._dealer: Any = None
        self._sub: Any = None

    @property
    def credits(self) -> int:
        return self._credits

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def connect(self, timeout_s: float = 10.0) -> Welcome:
        """Say Hello and wait for Welcome. Raises Rejected or ConnectTimeout (and closes)."""
        if self._dealer is not None:
            raise RuntimeError("connect() was already called")
        loop = asyncio.get_running_loop()
        self._welcomed = loop.create_future()
        try:
            self._dealer = self._socket(zmq.DEALER, curve_server_public=self.curve_server_key)
            self._dealer.sock.setsockopt(zmq.ROUTING_ID, b"tr-" + secrets.token_hex(8).encode())
            self._dealer.sock.connect(self.address)
            self._spawn(self._dealer.drain_forever(self._on_frames), "client-recv")
            await self._send_frames(codec.encode(self.hello))
            try:
                welcome = await asyncio.wait_for(asyncio.shield(self._welcomed), timeout_s)
            except TimeoutError:
                raise ConnectTimeout(f"no Welcome from {self.address} within {timeout_s} s (is the trainer "
                                     "running there? with CURVE, is the server key right?)") from None
        except BaseException:
            await self.close()
            raise
        self._last_seen_s = time.monotonic()
        self._spawn(self._heartbeat_loop(), "client-heartbeat")
        return welcome

    async def send(self, msg: Any) -> None:
        """Send one message, waiting for credit (messages other than Hello, Heartbeat, Credit,
        Shutdown) and for room in the socket. Tensors over 64 KiB are handed to ZeroMQ without a copy
        and transmitted later: send a clone of a tensor that will be modified in place."""
        frames = codec.encode(msg)
        if type(msg) not in FREE_KINDS:
            while self._credits <= 0:
                self._check_open()
                self._credit_ready.clear()
                await self._credit_ready.wait()
            self._credits -= 1
        self._check_open()
        await self._send_frames(frames)

    def send_nowait(self, msg: Any) -> bool:
        """Send without waiting; False when there is no credit or no room in the socket."""
        self._check_open()
        free = type(msg) in FREE_KINDS
        if not free and self._credits <= 0:
            return False
        if not self._send_nowait(self._dealer, codec.encode(msg)):
            return False
        if not free:
            self._credits -= 1
        return True

    async def send_many(self, msgs: Iterable[Any]) -> None:
        for msg in msgs:
            await self.send(msg)

    async def recv(self) -> Any:
        """Next application message. Shutdown from the trainer is returned once, then ConnectionLost."""
        if not self._inbox:
            await self._wait_inbox()
        return self._inbox.popleft()

    def recv_nowait(self) -> Any | None:
        return self._inbox.popleft() if self._inbox else None

    async def subscribe(self, kinds: Iterable[int] | None = None) -> None:
        """Connect a SUB socket to the notice endpoint: all notices, or only these message kinds."""
        if self.welcome is None or not self.welcome.notice_endpoint:
            raise RuntimeError("subscribe() needs a Welcome with a notice endpoint: connect() first")
        if self._sub is None:
            self._sub = self._socket(zmq.SUB, curve_server_public=self.curve_server_key)
            self._sub.sock.connect(_notice_connect_address(self.welcome.notice_endpoint, self.address))
        prefixes = [b""] if kinds is None else [b"TR" + bytes((PROTOCOL_VERSION, k)) for k in kinds]
        for prefix in prefixes:
            self._sub.sock.setsockopt(zmq.SUBSCRIBE, prefix)

    async def recv_notice(self) -> Any:
        """Next notice; bad notices are counted and skipped. Raises ConnectionLost with recv()."""
        if self._sub is None:
            raise RuntimeError("recv_notice() needs subscribe() first")
        while True:
            self._check_open()
            frames = self._sub.recv_nowait()
            if frames is None:
                await self._sub.wait_readable()
                continue
            try:
                return codec.decode(frames, self.limits)
            except ProtocolError as exc:
                self.counters["bad_notice"] += 1
                log.warning("bad notice dropped: %s", exc)

    async def close(self, reason: str = "") -> None:
        """Say Shutdown (when welcomed), stop the loops, close the sockets. Idempotent."""
        if self._closed:
            return
        try:
            if self.welcome is not None and self._error is None and self._dealer is not None:
                self._send_nowait(self._dealer, codec.encode(Shutdown(reason=reason or "client closing")))
        finally:
            await self._close_all()

    # ---------------------------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._dealer is None:
            raise TransportError("not connected: call connect() first")

    def _stop(self, error: BaseException, cause: BaseException | None = None) -> None:
        super()._stop(error, cause)
        self._credit_ready.set()
        if self._sub is not None:
            self._sub.wake()
        if self._welcomed is not None and not self._welcomed.done():
            self._welcomed.set_exception(self._error)
            self._welcomed.exception()  # retrieved here: connect() may already have timed out

    def _lose(self, reason: str, level: int = logging.WARNING) -> None:
        if self._error is None:
            log.log(level, "lost the trainer at %s: %s", self.address, reason)
        self._stop(ConnectionLost(reason))

    async def _send_frames(self, frames: list) -> None:
        await self._dealer.send(frames)

    def _on_frames(self, frames: list) -> None:
        if self._error is not None:  # the session is over: nothing more reaches the owner
            self.counters["dropped/after_loss"] += 1
            return
        self._last_seen_s = time.monotonic()
        try:
            msg = codec.decode(frames, self.limits)
        except Exception as exc:  # ProtocolError, or a codec bug: no input may stop this loop
            self.counters["bad_input"] += 1
            log.warning("bad message from the trainer dropped: %r", exc)
            code = exc.code if isinstance(exc, ProtocolError) else ErrorCode.INTERNAL
            if self._credits > 0 and self._errors.allow(b"") and self._send_nowait(
                    self._dealer, codec.encode(Error(code=code, text=str(exc)[:MAX_TEXT]))):
                self._credits -= 1  # an Error takes credit like any message
            return
        kind = type(msg)
        if kind is Heartbeat:
            return
        if kind is Credit:
            self._credits += msg.credits
            self._credit_ready.set()
            return
        if self.welcome is None:
            self._on_handshake(msg)
            return
        if kind is Error and msg.code == ErrorCode.NOT_WELCOME:
            self._lose(f"the trainer no longer knows this peer: {msg.text}")
        elif kind is Shutdown:
            self._inbox.append(msg)
            self._lose(f"the trainer shut down: {msg.reason}", logging.INFO)
        elif len(self._inbox) >= self.max_queue:
            self.counters["dropped/queue_full"] += 1
        else:
            self._inbox.append(msg)
            self._ready.set()

    def _on_handshake(self, msg: Any) -> None:
        if self._welcomed is None or self._welcomed.done():
            return
        if type(msg) is Welcome:
            self.welcome = msg
            self._credits = msg.credits
            self._welcomed.set_result(msg)
        elif type(msg) in (Reject, Error):
            self._welcomed.set_exception(Rejected(msg.code, msg.text))
        else:
            self.counters["dropped/before_welcome"] += 1

    async def _heartbeat_loop(self) -> None:
        welcome = self.welcome
        assert welcome is not None
        seq = 0
        ticks = _Ticks(welcome.heartbeat_interval_s)
        while self._error is None:
            reap = await ticks.next()
            silent_s = time.monotonic() - self._last_seen_s
            if reap and silent_s > welcome.peer_timeout_s:
                self._lose(f"no message for {silent_s:.3f} s (timeout {welcome.peer_timeout_s} s)")
                return
            self._send_nowait(self._dealer, codec.encode(Heartbeat(seq=seq, wall_s=time.time())))
            seq += 1
