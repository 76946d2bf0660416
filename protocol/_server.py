"""The binding side of the transport: Server (the trainer's ROUTER for sessions + PUB for notices) and how it
sees its peers (Peer, PeerEvent). Private to protocol/: import these from tailrace.protocol.transport, whose
docstring draws the server-recv and server-heartbeat loops and their bounds.
Test: pytest tests/protocol/test_transport.py
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import zmq

from tailrace.protocol import codec
from tailrace.protocol._auth import ClientKeys
from tailrace.protocol._offload import OffLoopDecoder
from tailrace.protocol._wire import (
    FREE_KINDS,
    MAX_TEXT,
    TAKEN_OVER_TEXT,
    BindFailed,
    Endpoint,
    Ticks,
    bind_address,
    log,
    notice_bind_address,
)
from tailrace.protocol.codec import Limits, ProtocolError
from tailrace.protocol.messages import (
    PROTOCOL_VERSION,
    Credit,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Reject,
    Shutdown,
    Welcome,
)


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
    key: str = ""  # the client's CURVE public key (Z85) when the server authenticates keys, else ""

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
    event: "joined", "left" (Shutdown, new Hello, taken over by a new session under its name, or server
    closing) or "dead" (missed heartbeats). A takeover delivers the new session's "joined" first, then the
    old one's "left", so work the old session held can go straight to its successor."""

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


def _bind(sock: zmq.Socket, address: str) -> None:
    """sock.bind, with a failure that names the address (another process may take a port between a
    preflight check and this bind)."""
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        raise BindFailed(address, exc.strerror) from None


class Server(Endpoint):
    """The binding side (the trainer). `await start()` or `async with Server(...)`, then loop on
    `peer, msg = await recv()`: msg is a message, or None when `peer` is a PeerEvent (joined, left,
    dead). `accept(hello)` may return a Reject to refuse a peer. A Hello under a connected name takes that
    session over (protocol/SPEC.md, "Sessions and takeover"). With `client_roles` (CURVE only), a ZAP
    handler admits only the listed client keys, and each may say Hello only in the roles listed for it.
    The event loop must stay responsive (heavy compute in threads), or peers miss heartbeats."""

    def __init__(self, address: str = "tcp://127.0.0.1:0", *, run_id: str,
                 policy_version: int | Callable[[], int] = 0, drafter_version: int | Callable[[], int] = 0,
                 credits: int = 64, heartbeat_interval_s: float = 1.0, missed_heartbeats: int = 5,
                 limits: Limits = codec.DEFAULT_LIMITS, curve_secret_key: bytes | None = None,
                 curve_public_key: bytes | None = None, context: zmq.Context | None = None,
                 accept: Callable[[Hello], Reject | None] | None = None, max_peers: int = 1024,
                 client_roles: Mapping[str, Iterable[str]] | None = None):
        if not 1 <= credits <= 1 << 20:
            raise ValueError(f"credits must be in 1..2^20, got {credits}")
        if not 0.001 <= heartbeat_interval_s <= 3600:
            raise ValueError(f"heartbeat_interval_s must be in 0.001..3600, got {heartbeat_interval_s}")
        if missed_heartbeats < 1:
            raise ValueError(f"missed_heartbeats must be >= 1, got {missed_heartbeats}")
        if max_peers < 1:
            raise ValueError(f"max_peers must be >= 1, got {max_peers}")
        if client_roles is not None and curve_secret_key is None:
            raise ValueError("client_roles needs curve_secret_key: client keys exist only with CURVE")
        self._auth = None if client_roles is None else ClientKeys(client_roles)
        self._own_context: zmq.Context | None = None
        if self._auth is not None and context is None:
            context = self._own_context = zmq.Context()  # ZAP is one handler per context: ours alone
        super().__init__(limits, context)
        self.address = bind_address(address)  # the resolved endpoint once started
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
        self._offload = OffLoopDecoder(lambda frames: codec.decode(frames, self.limits), self._on_decoded,
                                       self._spawn, self.counters)

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
            if self._auth is not None:
                await self._auth.start(self._context)  # before any CURVE socket binds
            self._router = self._socket(zmq.ROUTER, curve_server_secret=self._curve_secret)
            self._router.read_user_id = self._auth is not None
            router = self._router.sock
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable sends fail loudly, never block
            router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting peer keeps its session
            _bind(router, self.address)
            self.address = router.last_endpoint.decode()
            self._pub = self._socket(zmq.PUB, curve_server_secret=self._curve_secret)
            _bind(self._pub.sock, notice_bind_address(self.address))
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

    async def _close_all(self) -> None:
        try:
            await super()._close_all()
        finally:
            if self._auth is not None:
                self._auth.stop()
            if self._own_context is not None:  # its sockets are closed: term() waits out their linger only
                await asyncio.to_thread(self._own_context.term)

    # ---------------------------------------------------------------------------------- receive

    def _on_frames(self, frames: list) -> None:
        ident = frames[0]
        peer = self._peers.get(ident)
        if peer is not None:
            peer.last_seen_s = time.monotonic()
            if self._offload.takes(ident, frames, max_queued=max(1, peer.credits)):
                return  # a large message: decoded in a thread (protocol/_offload.py), then _on_decoded
        elif self._too_large_before_hello(ident, frames):
            return
        try:
            msg, error = codec.decode(frames[1:], self.limits), None
        except Exception as exc:
            msg, error = None, exc
        self._on_decoded(ident, frames, msg, error)

    def _on_decoded(self, ident: bytes, frames: list, msg: Any, error: Exception | None) -> None:
        if isinstance(error, ProtocolError):
            self._bad_input(ident, frames[1:], error)
            return
        if error is not None:  # the codec promises ProtocolError; no input may stop this loop anyway
            log.error("decoding a message from %r failed", ident, exc_info=error)
            self._bad_input(ident, frames[1:], ProtocolError(f"{type(error).__name__}: {error}",
                                                             code=ErrorCode.INTERNAL))
            return
        peer = self._peers.get(ident)  # again: a message decoded in a thread may outlive its session
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

    def _too_large_before_hello(self, ident: bytes, frames: list) -> bool:
        """A peer without a session may send only a small Hello: anything larger is dropped by its frame
        sizes alone, before it is copied or parsed (ZeroMQ itself has buffered it once, up to
        max_frame_bytes, and frees it when the frames go)."""
        size = sum(map(len, frames[1:]))  # bytes and zmq.Frame alike
        if size <= self.limits.max_handshake_bytes:
            return False
        self.counters["dropped/too_large_before_hello"] += 1
        self._reply_error(ident, ErrorCode.TOO_LARGE, f"a message of {size} bytes before a Welcome; the limit "
                          f"is {self.limits.max_handshake_bytes} bytes until a Hello is accepted")
        return True

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
        key = self._router.user_id if self._auth is not None else ""
        old = self._peers.get(self._names.get(hello.name, b""))
        reject = self._check_hello(hello, key, old)
        if reject is not None:
            self.counters["peers/rejected"] += 1
            log.info("rejected %s %r: %s", hello.role, hello.name, reject.text)
            self._reply(ident, reject, limited=True)
            return
        now = time.monotonic()
        peer = Peer(id=ident, hello=hello, joined_s=now, last_seen_s=now, credits=self.credits, key=key)
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
        if old is not None:  # after "joined": what the old session held is handed straight to this one
            self.counters["peers/taken_over"] += 1
            self._end(old, "left", f"taken over by a new session (incarnation {hello.incarnation})")
            self._reply(old.id, Error(code=ErrorCode.NOT_WELCOME, text=f"{TAKEN_OVER_TEXT} by a newer "
                                      f"connection under the name {hello.name!r}"))

    def _check_hello(self, hello: Hello, key: str, old: Peer | None) -> Reject | None:
        if hello.protocol_version != PROTOCOL_VERSION:
            return Reject(code=ErrorCode.VERSION_MISMATCH, text=(
                f"protocol version {hello.protocol_version} not supported; this trainer speaks {PROTOCOL_VERSION}"))
        if hello.role == "trainer":
            return Reject(code=ErrorCode.UNAUTHORIZED, text="role 'trainer' is this endpoint's own")
        if not hello.name:
            return Reject(code=ErrorCode.UNAUTHORIZED, text="name must not be empty")
        if self._auth is not None and not self._auth.may(key, hello.role):
            return Reject(code=ErrorCode.UNAUTHORIZED, text=f"this client key may not join as {hello.role!r}")
        if old is not None and old.key != key:
            return Reject(code=ErrorCode.UNAUTHORIZED, text=f"name {hello.name!r} is held by another client key")
        if old is not None and hello.incarnation < old.hello.incarnation:
            return Reject(code=ErrorCode.UNAUTHORIZED, text=(
                f"name {hello.name!r} is connected with a newer incarnation ({old.hello.incarnation} > "
                f"{hello.incarnation})"))
        if old is None and len(self._peers) >= self.max_peers:
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
        if self._names.get(peer.name) == peer.id:  # after a takeover the name is its successor's
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
        inbox = self._inbox
        if not inbox:  # the owner waits only on an empty inbox: one Event.set per burst, not per message
            self._ready.set()
        inbox.append(item)

    def _grant(self, peer: Peer) -> None:
        if self._send_nowait(self._router, [peer.id, *codec.encode(Credit(credits=peer.consumed))]):
            peer.credits += peer.consumed
            peer.consumed = 0  # else kept, and granted again at the next heartbeat

    async def _heartbeat_loop(self) -> None:
        seq = 0
        ticks = Ticks(self.heartbeat_interval_s)
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
