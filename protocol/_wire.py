"""The transport's shared machinery: errors, address grammar, the heartbeat clock, the error-reply rate
limiter, Wire (one ZeroMQ socket driven by the asyncio loop through its ZMQ_FD) and Endpoint (what Server
and Client share: supervised tasks, inbox, counters, sockets). Private to protocol/: import the public
names from tailrace.protocol.transport, whose docstring draws the loops.
Test: pytest tests/protocol/test_transport.py
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.backend

from tailrace.protocol.codec import Limits
from tailrace.protocol.messages import Credit, ErrorCode, Heartbeat, Hello, Shutdown

log = logging.getLogger("tailrace.transport")

BATCH = 256  # messages handled per wakeup before yielding to other tasks
FREE_KINDS = (Hello, Heartbeat, Credit, Shutdown)  # messages that consume no credit
LINGER_MS = 200  # how long a closed socket keeps trying to deliver its last messages (Shutdown)
MAX_TEXT = 4096  # Error/Reject text bound on the wire


def generate_keypair() -> tuple[bytes, bytes]:
    """A new CURVE key pair (public, secret), each 40 bytes of Z85 text."""
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support")
    return zmq.curve_keypair()


def read_key(path: str, what: str = "key file") -> bytes | None:
    """The Z85 key stored in the file at `path` (surrounding whitespace dropped); None for an empty path.
    ValueError naming `what` when the file is missing or does not hold a 40-character key."""
    if not path:
        return None
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"{what}: cannot read {path}: {exc.strerror}") from None
    if len(key) != 40:
        raise ValueError(f"{what}: {path} does not hold a 40-character Z85 CURVE key")
    return key


class TransportError(Exception):
    """The connection cannot be used (closed, failed, or lost)."""


class ConnectionLost(TransportError):
    """The other side went away: missed heartbeats, Shutdown, closed, or it ended our session with an Error:
    405 (it does not know us), 409 (taken over: exit, a successor holds the name) or 410 (declared dead).
    code: that Error's code, else 0."""

    def __init__(self, reason: str, code: int = 0):
        super().__init__(reason)
        self.code = code

    @property
    def declared_dead(self) -> bool:
        """The trainer ended this session because it judged us dead (Error 410: nothing from us within its
        peer timeout, a frozen or starved process) while both sides are alive: the peer may rejoin as a new
        session (SPEC, Heartbeats and liveness). False for 409 (taken over: a successor holds the name, exit)
        and every other loss. The one place that reads this verdict off the wire."""
        return self.code == ErrorCode.DECLARED_DEAD


class Rejected(TransportError):
    """The trainer answered Hello with Reject (or Error): code and text say why."""

    def __init__(self, code: int, text: str):
        super().__init__(f"rejected ({code}): {text}")
        self.code = code
        self.text = text


class ConnectTimeout(TransportError, TimeoutError):
    """No Welcome within the connect timeout."""


class BindFailed(TransportError):
    """The server could not bind its address (a port in use, a host it does not have)."""

    def __init__(self, address: str, reason: str):
        super().__init__(f"cannot bind {address}: {reason}")
        self.address = address
        self.reason = reason


def split_scheme(address: str) -> tuple[str, str]:
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "ipc", "inproc") or not rest:
        raise ValueError(f"address {address!r}: expected tcp://host:port, ipc://path or inproc://name")
    return scheme, rest


def bind_address(address: str) -> str:
    scheme, rest = split_scheme(address)
    if scheme != "tcp":
        return address
    host, colon, port = rest.rpartition(":")
    if not colon or not port:
        raise ValueError(f"address {address!r}: tcp needs host:port (port 0 picks a free one)")
    return f"tcp://{host or '127.0.0.1'}:{'*' if port == '0' else port}"


def notice_bind_address(bound: str) -> str:
    scheme, rest = split_scheme(bound)
    if scheme == "tcp":
        return f"tcp://{rest.rpartition(':')[0]}:*"
    return bound if rest == "*" else f"{bound}.notice"


def notice_connect_address(notice_endpoint: str, connect_address: str) -> str:
    """tcp notice endpoints name the server's bind host; a client reaches it at its own connect host."""
    if notice_endpoint.startswith("tcp://") and connect_address.startswith("tcp://"):
        host = connect_address[len("tcp://"):].rpartition(":")[0]
        return f"tcp://{host}:{notice_endpoint.rpartition(':')[2]}"
    return notice_endpoint


class Ticks:
    """Heartbeat clock. next() sleeps to the next tick and says whether silence may be judged now: not
    right after the event loop stalled, when heartbeats that did arrive may still wait unread. Never twice
    in a row: the loop ran (and read what had arrived) between the two ticks, and a loop late on every tick
    (a loaded machine) must still judge a peer that froze, not keep it alive for ever."""

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self._next_s = time.monotonic()
        self._skipped = False

    async def next(self) -> bool:
        self._next_s += self.interval_s
        await asyncio.sleep(max(0.0, self._next_s - time.monotonic()))
        late_s = time.monotonic() - self._next_s
        if late_s > self.interval_s:
            self._next_s = time.monotonic()
            if not self._skipped:
                self._skipped = True
                return False
        self._skipped = False
        return True


class RateLimiter:
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
# pyzmq's Cython methods: its Python layer (enums, options) costs several us per message
_base_send, _base_recv = zmq.backend.Socket.send, zmq.backend.Socket.recv
ZERO_COPY_MIN_BYTES = 64 << 10
"""Frames at least this large are handed to ZeroMQ without a copy (pyzmq keeps the buffer alive until
ZeroMQ is done with it); smaller ones are copied, which is cheaper than tracking them."""


def _recv_multipart(sock: zmq.Socket, num_copied: int, user_id_to: Wire | None = None) -> list:
    """One message, or zmq.Again. The first `num_copied` frames (envelope, header, body) come as
    bytes when they are small, which is cheapest; large ones and tensor frames after them as zero-copy
    zmq.Frames, so that a frame the receiver refuses by its size is never copied.
    Frames are received as zmq.Frame because Frame.more is read in C, where Socket.get(RCVMORE) goes
    through the SocketOption enum (about 0.7 us per frame). With `user_id_to`, the "User-Id" that ZAP
    gave the sending connection is stored in user_id_to.user_id ("" when none)."""
    frame = _base_recv(sock, _NOBLOCK, False)
    frames = [frame.bytes]
    if user_id_to is not None:
        user_id_to.user_id = ""  # never the previous message's
    while frame.more:
        frame = _base_recv(sock, _NOBLOCK, False)
        if user_id_to is not None and len(frames) == 1:  # a data frame: it carries the connection's metadata
            user_id_to.user_id = _user_id(frame)
        frames.append(frame.bytes if len(frames) < num_copied and len(frame) < ZERO_COPY_MIN_BYTES else frame)
    return frames


def _user_id(frame: zmq.Frame) -> str:
    try:
        return frame.get("User-Id") or ""
    except zmq.ZMQError:  # no such property: the connection was not authenticated by ZAP
        return ""


def _send_multipart(sock: zmq.Socket, frames: list) -> None:
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
        _base_send(sock, frame, _NOBLOCK_MORE if i < last else _NOBLOCK, size < ZERO_COPY_MIN_BYTES)


class Wire:
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
        self.read_user_id = False  # ZAP on: note each message's "User-Id" (the client key) before handling it
        self.user_id = ""
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
                    frames = _recv_multipart(sock, num_copied, self if self.read_user_id else None)
                except zmq.Again:
                    break
                handle(frames)
                del frames  # else the last message stays alive while the loop waits for the next one
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


class Endpoint:
    """What Server and Client share: supervised background tasks, an inbox, counters, sockets."""

    def __init__(self, limits: Limits, context: zmq.Context | None):
        self.limits = limits
        self.counters: collections.Counter[str] = collections.Counter()
        self._context = context
        self._wires: list[Wire] = []
        self._tasks: set[asyncio.Task] = set()
        self._inbox: collections.deque = collections.deque()
        self._ready = asyncio.Event()
        self._error: BaseException | None = None  # set when the endpoint can no longer be used
        self._closed = False
        self._errors = RateLimiter(rate_per_s=10.0, burst=10.0)

    def _socket(self, kind: int, curve_server_secret: bytes | None = None,
                curve_server_public: bytes | None = None) -> Wire:
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
            wire = Wire(sock, num_copied=3 if kind == zmq.ROUTER else 2)  # ROUTER: + routing id
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

    def _send_nowait(self, wire: Wire, frames: list) -> bool:
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
