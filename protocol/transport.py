"""Asyncio ZeroMQ transport: the trainer's Server binds, every other process is a Client that connects.

One address is all a client needs: tcp://host:port, ipc://path, or inproc://name with a shared ZeroMQ
context (e.g. one zmq.asyncio.Context: the in-process twin used by tests). Sockets are driven by the
asyncio loop through their ZMQ_FD (_wire.Wire); run() uses uvloop. Conversation rules (handshake,
heartbeats, credits, CURVE, size limits): protocol/SPEC.md. This module is the public face; the code lives
in protocol/_wire.py (errors, addresses, Wire, the Endpoint base that Server and Client share),
protocol/_server.py (Server, Peer, PeerEvent, sessions and takeover), protocol/_auth.py (the CURVE client
allow-list and its ZAP handler) and protocol/_client.py (Client, handshake retries).
Test: pytest tests/protocol/test_transport.py

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
from typing import Any

from tailrace.protocol._auth import load_client_roles
from tailrace.protocol._client import Client
from tailrace.protocol._server import Peer, PeerEvent, Server
from tailrace.protocol._wire import (
    BindFailed,
    ConnectionLost,
    ConnectTimeout,
    Rejected,
    TransportError,
    generate_keypair,
    read_key,
)

__all__ = ["BindFailed", "Client", "ConnectTimeout", "ConnectionLost", "Peer", "PeerEvent", "Rejected", "Server",
           "TransportError", "generate_keypair", "load_client_roles", "read_key", "run"]


def run(coro: Any) -> Any:
    """Run a coroutine to completion on uvloop when it is installed, else on the default asyncio loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
