"""Spans: what a process is doing, as wall-clock intervals in a bounded ring buffer, sent in batches.

    buf = SpanBuffer("generator", "gen-0")
    with buf.span("decode", value=batch_size): ...      # or buf.add(state, start, end) for measured ones
    msg = buf.drain()                                    # one Spans message per stats interval, or None

Every role records into one; the trainer writes what arrives to runs/<name>/trace.jsonl and republishes it
to tools (tools/top.py, tools/timeline.py). Cheap by construction: recording a span appends a list to a
deque, and back-to-back spans of the same state and value on a track merge into one (a loop that waits in
small slices leaves one span). `cost_s` is the time spent recording and draining, so a process can report
what its telemetry costs. ServerTelemetry adds a reward or environment server's Stats. Test: pytest tests/protocol/test_telemetry.py
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from tailrace.protocol.messages import Span, Spans, Stats

MAX_SPANS = 4096  # the ring's size: at most one Spans message's worth (Spans.spans' bound)
MERGE_GAP_S = 0.002  # a span starting this soon after the same one on its track extends it


class SpanBuffer:
    """A bounded ring of spans of one process. Not thread-safe: record from the event loop thread."""

    def __init__(self, role: str, name: str, *, capacity: int = MAX_SPANS, enabled: bool = True):
        assert 1 <= capacity <= MAX_SPANS
        self.role, self.name, self.enabled = role, name, enabled
        self._ring: collections.deque[list] = collections.deque(maxlen=capacity)
        self._last: dict[str, list] = {}  # track -> its newest record, which a following one may extend
        self.dropped = 0
        self.cost_s = 0.0

    def add(self, state: str, start_wall_s: float, end_wall_s: float, *, track: str = "main",
            value: float = 0.0) -> None:
        if not self.enabled:
            return
        t0 = time.perf_counter()
        last = self._last.get(track)
        end_wall_s = max(end_wall_s, start_wall_s)
        if last is not None and last[0] == state and last[3] == value and \
                0.0 <= start_wall_s - last[2] <= MERGE_GAP_S:
            last[2] = end_wall_s
        else:
            if last is not None and start_wall_s < last[2]:  # a wall clock stepped back: keep the track ordered
                start_wall_s = end_wall_s = max(end_wall_s, last[2])
            if len(self._ring) == self._ring.maxlen:
                self.dropped += 1
            record = [state, start_wall_s, end_wall_s, value, track]
            self._ring.append(record)
            self._last[track] = record
        self.cost_s += time.perf_counter() - t0

    @contextlib.contextmanager
    def span(self, state: str, *, track: str = "main", value: float = 0.0) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            self.add(state, start, time.time(), track=track, value=value)

    def drain(self) -> Spans | None:
        """Everything recorded since the last drain as one message (None when there is nothing)."""
        if not self._ring and not self.dropped:
            return None
        t0 = time.perf_counter()
        spans = [Span(state=s, start_wall_s=start, duration_s=end - start, track=track, value=value)
                 for s, start, end, value, track in self._ring]
        msg = Spans(role=self.role, name=self.name, spans=spans, dropped=self.dropped)
        self._ring.clear()
        self._last.clear()
        self.dropped = 0
        self.cost_s += time.perf_counter() - t0
        return msg


class ServerTelemetry:
    """A request server's Stats and spans (reward servers: role "reward", "scoring"; environment servers:
    role "env", "stepping"): requests, in flight, latency, errors under "<role>/..."; one span track per
    concurrency slot, so that concurrent requests never share a track."""

    def __init__(self, role: str, name: str, max_concurrency: int, busy: str):
        self.spans = SpanBuffer(role, name)
        self.role, self.name, self.busy = role, name, busy
        self.free_slots = list(range(max_concurrency - 1, -1, -1))
        self.counters = collections.Counter()
        self.latency_sum_s = 0.0

    def start(self) -> tuple[int, float]:
        self.counters[f"{self.role}/requests/received"] += 1
        return (self.free_slots.pop() if self.free_slots else -1), time.time()

    def finish(self, ticket: tuple[int, float], failed: bool) -> None:
        slot, start = ticket
        end = time.time()
        self.counters[f"{self.role}/requests/answered"] += 1
        self.counters[f"{self.role}/requests/errors"] += failed
        self.latency_sum_s += end - start
        if slot >= 0:
            self.spans.add(self.busy, start, end, track=f"slot-{slot}")
            self.free_slots.append(slot)

    def stats(self) -> Stats:
        c, prefix = self.counters, self.role
        in_flight = c[f"{prefix}/requests/received"] - c[f"{prefix}/requests/answered"]
        counters = {k: float(v) for k, v in c.items()}
        counters[f"{prefix}/requests/in_flight"] = float(in_flight)
        counters[f"{prefix}/latency/mean_s"] = self.latency_sum_s / max(1, c[f"{prefix}/requests/answered"])
        return Stats(role=self.role, name=self.name, state=self.busy if in_flight else "idle", policy_version=0,
                     counters=counters, wall_s=time.time())


def RewardTelemetry(name: str, max_concurrency: int) -> ServerTelemetry:  # noqa: N802 (a reward server's kind)
    """A reward server's telemetry: role "reward", spans "scoring"."""
    return ServerTelemetry("reward", name, max_concurrency, "scoring")


def EnvTelemetry(name: str, max_concurrency: int) -> ServerTelemetry:  # noqa: N802
    """An environment server's telemetry: role "env", spans "stepping" (resets and steps)."""
    return ServerTelemetry("env", name, max_concurrency, "stepping")


async def publish_every(telemetry: ServerTelemetry, send: Callable[[Any], Awaitable[None]], interval_s: float) -> None:
    """A server SDK's telemetry loop: its Stats and any new Spans through `send` every `interval_s`, until
    cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        for msg in (telemetry.stats(), telemetry.spans.drain()):
            if msg is not None:
                await send(msg)
