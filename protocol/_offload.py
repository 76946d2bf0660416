"""Large messages decoded off the event loop: a message whose body or frame count makes decoding cost more
than a few milliseconds (tens of thousands of small tensors in a WeightsChunk take seconds in Python) is
decoded in a worker thread, so the loop keeps serving heartbeats and other peers meanwhile.

    Server._on_frames --(large, or this peer already has some queued)--> per-peer queue --> worker task:
        asyncio.to_thread(decode) one message at a time --> Server delivers it, as if decoded inline

A peer's messages keep their order (once one of its messages is queued, the next ones queue behind it);
other peers are not held up. A queue holds at most as many messages as the peer has credit for, so what
waits here is bounded exactly as the inbox is. Private to protocol/; used by protocol/_server.py.
Test: pytest tests/faults/test_loop_stall.py
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

MIN_BODY_BYTES = 32 << 10  # decoding costs up to ~1 us per body byte (small tensors): ~30 ms inline at most
MIN_FRAMES = 17  # a Rollout has 2 + 3 frames; many tensor frames mean many tensors to build

Deliver = Callable[[bytes, list, Any, Exception | None], None]
"""deliver(ident, frames, msg, exc): exc is the decode error (msg None), else msg is the message."""


def large(frames: list) -> bool:
    """Should these frames (routing id first) be decoded in a thread?"""
    return len(frames) > MIN_FRAMES or (len(frames) > 2 and len(frames[2]) > MIN_BODY_BYTES)


class OffLoopDecoder:
    def __init__(self, decode: Callable[[list], Any], deliver: Deliver, spawn: Callable[[Any, str], None],
                 counters: collections.Counter[str]):
        self._decode = decode
        self._deliver = deliver
        self._spawn = spawn
        self.counters = counters
        self._queues: dict[bytes, collections.deque[list]] = {}

    def takes(self, ident: bytes, frames: list, max_queued: int) -> bool:
        """True if these frames are decoded in a thread (or dropped, past `max_queued` for this peer);
        False to decode them inline, now."""
        queue = self._queues.get(ident)
        if queue is None:
            if not large(frames):
                return False
            queue = self._queues[ident] = collections.deque()
            self._spawn(self._drain(ident, queue), "server-decode")
        if len(queue) >= max_queued:
            self.counters["dropped/decode_queue_full"] += 1
            return True
        queue.append(frames)
        self.counters["decoded_off_loop"] += 1
        return True

    async def _drain(self, ident: bytes, queue: collections.deque[list]) -> None:
        try:
            while queue:
                frames = queue[0]
                try:
                    msg, exc = await asyncio.to_thread(self._decode, frames[1:]), None
                except Exception as error:  # delivered to the same handling as an inline decode error
                    msg, exc = None, error
                queue.popleft()
                self._deliver(ident, frames, msg, exc)
                del frames, msg
        finally:
            del self._queues[ident]
