"""The trainer's event-loop lag probe: how long the loop failed to wake a task that asked to sleep.

    every interval_s   sleeps interval_s and measures the oversleep (time.monotonic()); the largest is
                       published as counter trainer/loop/max_stall_ms in the trainer's Stats, the largest of
                       the last complete WINDOW_S as trainer/loop/recent_max_stall_ms, and the number of
                       wake-ups later than STALL_MS as trainer/loop/stalls

A message handler, a decode or a synchronous call that holds the loop shows up here as lag; so does a
machine too busy to schedule the process (the figure is what peers see either way). The trainer service
runs `watch` as one of its loops. Test: pytest tests/faults/test_loop_stall.py
"""

from __future__ import annotations

import asyncio
import collections
import time

STALL_MS = 50.0  # a wake-up later than this counts as a stall (DESIGN.md invariant 5: no input stalls a loop)
WINDOW_S = 1.0  # trainer/loop/recent_max_stall_ms covers the last window this long


async def watch(counters: collections.Counter[str], interval_s: float = 0.01) -> None:
    """Measure loop lag into `counters` until cancelled."""
    window_end_s, window_max_ms = time.monotonic() + WINDOW_S, 0.0
    while True:
        started = time.monotonic()
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        lag_ms = (now - started - interval_s) * 1000.0
        window_max_ms = max(window_max_ms, lag_ms)
        if lag_ms > counters["trainer/loop/max_stall_ms"]:
            counters["trainer/loop/max_stall_ms"] = lag_ms
        if lag_ms > STALL_MS:
            counters["trainer/loop/stalls"] += 1
        if now >= window_end_s:
            counters["trainer/loop/recent_max_stall_ms"] = window_max_ms
            window_end_s, window_max_ms = now + WINDOW_S, 0.0
