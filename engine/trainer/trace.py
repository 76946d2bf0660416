"""runs/<name>/trace.jsonl: every process's spans, the counters a timeline draws, and the run's events.

One JSON object a line, flushed per batch so tools can tail it (tools/timeline.py --run reads it):

    {"kind": "span", "role": "generator", "name": "gen-0", "track": "main", "state": "decode",
     "start_wall_s": 1795000000.0, "duration_s": 0.012, "value": 24.0}
    {"kind": "counters", "role": "generator", "name": "gen-0", "wall_s": ..., "counters": {...}}
    {"kind": "event", "role": "trainer", "name": "trainer", "event": "stall", "text": ..., "wall_s": ...}

Only the counters a timeline draws are kept (queues, running batch, staleness, in flight), so that the
file grows with what happened, not with the number of metrics. Test: pytest tests/engine/generator/test_spans.py (the trace file)
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from tailrace.engine.trainer.writes import WriteFailed, writing
from tailrace.protocol import messages as m

TRACE_COUNTER_MARKS = ("/queue/", "staleness", "in_flight")


def trace_counters(counters: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in counters.items() if any(mark in k for mark in TRACE_COUNTER_MARKS)
            and math.isfinite(v)}


def span_records(msg: m.Spans) -> list[dict]:
    return [{"kind": "span", "role": msg.role, "name": msg.name, "track": s.track, "state": s.state,
             "start_wall_s": s.start_wall_s, "duration_s": s.duration_s, "value": s.value} for s in msg.spans]


def counters_record(msg: m.Stats) -> dict:
    return {"kind": "counters", "role": msg.role, "name": msg.name, "state": msg.state, "wall_s": msg.wall_s,
            "counters": trace_counters(msg.counters)}


def event_record(msg: m.Event) -> dict:
    return {"kind": "event", "role": msg.role, "name": msg.name, "event": msg.event, "text": msg.text,
            "wall_s": msg.wall_s}


def records(msg: object) -> list[dict]:
    """The trace records of one notice (Spans, Stats, Event; others have none)."""
    if isinstance(msg, m.Spans):
        return span_records(msg)
    if isinstance(msg, m.Stats):
        return [counters_record(msg)]
    if isinstance(msg, m.Event):
        return [event_record(msg)]
    return []


class TraceLog:
    """on_failure(WriteFailed) is called once when a write fails (a full disk): the trace ends there and the
    run goes on (it is telemetry: nothing resumes from it); without it the WriteFailed is raised."""

    def __init__(self, path: str | Path, on_failure: Callable[[WriteFailed], None] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self.num_dropped = 0  # spans the senders' rings overwrote (they said so in Spans.dropped)
        self.failed = False  # a write failed: the trace ends there
        self.on_failure = on_failure

    def write(self, msg: m.Spans | m.Stats | m.Event) -> None:
        if isinstance(msg, m.Spans):
            self.num_dropped += msg.dropped
        lines = records(msg)
        if lines and not self._file.closed and not self.failed:
            try:
                with writing(self.path):
                    self._file.write("".join(json.dumps(r) + "\n" for r in lines))
                    self._file.flush()
            except WriteFailed as exc:
                self.failed = True
                if self.on_failure is None:
                    raise
                self.on_failure(exc)

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:  # what failed to flush was said when it failed, or is the trace's tail
            pass
