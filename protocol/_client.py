"""The connecting side of the transport: Client, what every process but the trainer uses (DEALER for its
session, plus SUB for notices after subscribe()). Private to protocol/: import it from tailrace.protocol.transport,
whose docstring draws the client-recv and client-heartbeat loops and how credits unblock send().
Test: pytest tests/protocol/test_transport.py
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import time
from collections.abc import Iterable
from typing import Any

import zmq

from tailrace.protocol import codec
from tailrace.protocol._wire import (
    FREE_KINDS,
    MAX_TEXT,
    ConnectionLost,
    ConnectTimeout,
    Endpoint,
    Rejected,
    Ticks,
    TransportError,
    generate_keypair,
    log,
    notice_connect_address,
    split_scheme,
)
from tailrace.protocol.codec import Limits, ProtocolError
from tailrace.protocol.messages import (
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

RETRY_FIRST_S = 0.5  # first pause after a refused or unanswered Hello; doubles up to RETRY_MAX_S
RETRY_MAX_S = 8.0


class Client(Endpoint):
    """The connecting side. `async with Client(...) as c: welcome = await c.connect()`, then send() and
    recv(). recv() raises ConnectionLost once the server is gone (after what arrived before)."""

    def __init__(self, address: str, *, role: str, name: str, tasks: Iterable[str] = (), max_inflight: int = 1,
                 capabilities: dict[str, Any] | None = None, package_version: str | None = None,
                 curve_server_key: bytes | None = None, curve_public_key: bytes | None = None,
                 curve_secret_key: bytes | None = None, limits: Limits = codec.DEFAULT_LIMITS,
                 context: zmq.Context | None = None, max_queue: int = 1 << 16, incarnation: int | None = None):
        split_scheme(address)
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
                           tasks=list(tasks), max_inflight=max_inflight, capabilities=dict(capabilities or {}),
                           incarnation=time.time_ns() // 1000 if incarnation is None else incarnation)
        self.curve_server_key = curve_server_key
        if curve_server_key is not None and curve_secret_key is not None and curve_public_key is None:
            curve_public_key = zmq.curve_public(curve_secret_key)
        if curve_server_key is not None and (curve_public_key is None or curve_secret_key is None):
            curve_public_key, curve_secret_key = generate_keypair()
        self._client_keys = (curve_public_key, curve_secret_key)
        self.max_queue = max_queue
        self.welcome: Welcome | None = None
        self.shutdown_reason: str | None = None  # set when the trainer said Shutdown: a normal end
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

    async def connect(self, timeout_s: float = 10.0, *, retry_for_s: float = 0.0,
                      waiting_every_s: float = 0.0) -> Welcome:
        """Say Hello and wait for Welcome, `timeout_s` per attempt. A refused or unanswered Hello is
        tried again on a fresh socket, with backoff and a log line saying why, until `retry_for_s` has
        passed (math.inf: until it is answered; a protocol version mismatch never is retried). With
        `waiting_every_s`, "waiting for a trainer at ADDR" is logged one second after the first Hello
        and then this often, until the Welcome. Raises Rejected or ConnectTimeout (and closes)."""
        if self._dealer is not None:
            raise RuntimeError("connect() was already called")
        deadline_s = time.monotonic() + retry_for_s
        backoff_s = RETRY_FIRST_S
        waiting = asyncio.create_task(self._say_waiting(waiting_every_s, retry_for_s)) if waiting_every_s > 0 else None
        try:
            while True:
                try:
                    welcome = await self._handshake(timeout_s)
                    break
                except (Rejected, ConnectTimeout) as exc:
                    wait_s = min(backoff_s, deadline_s - time.monotonic())
                    if getattr(exc, "code", 0) == ErrorCode.VERSION_MISMATCH or wait_s <= 0:
                        raise
                    quiet = waiting is not None and isinstance(exc, ConnectTimeout)  # said by _say_waiting
                    log.log(logging.DEBUG if quiet else logging.WARNING, "%s %r: handshake with %s failed (%s); "
                            "trying again in %.1f s", self.hello.role, self.hello.name, self.address, exc, wait_s)
                    await self._drop_dealer()
                    await asyncio.sleep(wait_s * random.uniform(0.8, 1.0))
                    backoff_s = min(RETRY_MAX_S, 2 * backoff_s)
        except BaseException:
            await self.close()
            raise
        finally:
            if waiting is not None:
                waiting.cancel()
        self._last_seen_s = time.monotonic()
        self._spawn(self._heartbeat_loop(), "client-heartbeat")
        return welcome

    async def _say_waiting(self, every_s: float, retry_for_s: float) -> None:
        started_s = time.monotonic()
        until = "until it answers" if retry_for_s == float("inf") else f"giving up after {retry_for_s:g} s"
        await asyncio.sleep(min(1.0, every_s))
        while True:
            log.warning("%s %r: waiting for a trainer at %s (%.0f s so far; %s)", self.hello.role, self.hello.name,
                        self.address, time.monotonic() - started_s, until)
            await asyncio.sleep(every_s)

    async def _handshake(self, timeout_s: float) -> Welcome:
        self._welcomed = asyncio.get_running_loop().create_future()
        self._dealer = self._socket(zmq.DEALER, curve_server_public=self.curve_server_key)
        self._dealer.sock.setsockopt(zmq.ROUTING_ID, b"tr-" + secrets.token_hex(8).encode())
        self._dealer.sock.connect(self.address)
        self._spawn(self._dealer.drain_forever(self._on_frames), "client-recv")
        await self._send_frames(codec.encode(self.hello))
        try:
            return await asyncio.wait_for(asyncio.shield(self._welcomed), timeout_s)
        except TimeoutError:
            raise ConnectTimeout(f"no Welcome from {self.address} within {timeout_s} s (is the trainer "
                                 "running there? with CURVE, are the server key and this client's key "
                                 "right?)") from None

    async def _drop_dealer(self) -> None:
        """Forget a failed handshake's socket and receive task; the next attempt starts afresh."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._wires.remove(self._dealer)
        self._dealer.close()
        self._dealer = None

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
            self._sub.sock.connect(notice_connect_address(self.welcome.notice_endpoint, self.address))
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

    def _lose(self, reason: str, level: int = logging.WARNING, code: int | None = None) -> None:
        if self._error is None:
            log.log(level, "lost the trainer at %s: %s", self.address, reason)
        self._stop(ConnectionLost(reason, code))

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
            self._lose(f"the trainer no longer knows this peer: {msg.text}", code=msg.code)
        elif kind is Shutdown:
            self.shutdown_reason = msg.reason
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
        ticks = Ticks(welcome.heartbeat_interval_s)
        while self._error is None:
            reap = await ticks.next()
            silent_s = time.monotonic() - self._last_seen_s
            if reap and silent_s > welcome.peer_timeout_s:
                self._lose(f"no message for {silent_s:.3f} s (timeout {welcome.peer_timeout_s} s)")
                return
            self._send_nowait(self._dealer, codec.encode(Heartbeat(seq=seq, wall_s=time.time())))
            seq += 1
