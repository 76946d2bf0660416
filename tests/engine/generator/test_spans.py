"""The generator's step spans (prefill, then decode or spec_decode with the batch), idle reasons, and the
trainer's trace.jsonl. Run: pytest tests/engine/generator/test_spans.py
"""

import itertools
import json
import time
from types import SimpleNamespace

from tailrace.engine.generator.spans import idle_state, record_step, step_marks
from tailrace.engine.trainer.trace import TraceLog
from tailrace.protocol import messages as m
from tailrace.protocol.telemetry import SpanBuffer


class FakeBackend:
    def __init__(self, speculative=False):
        self.stats = SimpleNamespace(prefill_s=0.0)
        self.spec_stats = SimpleNamespace(num_spec_steps=0) if speculative else None
        self.num_running = 0

    def step(self, prefill_s, rows, spec=False):
        time.sleep(prefill_s + 0.002)
        self.stats.prefill_s += prefill_s
        self.num_running = rows
        if spec:
            self.spec_stats.num_spec_steps += 1


def test_a_step_that_admits_is_prefill_then_decode_with_the_batch():
    spans, backend = SpanBuffer("generator", "g"), FakeBackend(speculative=True)
    marks = step_marks(backend)
    backend.step(0.01, rows=6)
    record_step(spans, backend, marks, num_finished=2)
    marks = step_marks(backend)
    backend.step(0.0, rows=5, spec=True)
    record_step(spans, backend, marks, num_finished=0)
    got = spans.drain().spans
    assert [(s.state, s.value) for s in got] == [("prefill", 0), ("decode", 8), ("spec_decode", 5)]
    assert abs(got[0].duration_s - 0.01) < 1e-6
    assert all(b.start_wall_s >= a.start_wall_s + a.duration_s for a, b in itertools.pairwise(got))


def test_idle_says_why():
    assert idle_state(request_outstanding=True, exhausted=False) == "idle_parked"
    assert idle_state(request_outstanding=False, exhausted=True) == "idle_no_work"


def test_trace_log_writes_spans_counters_and_events(tmp_path):
    trace = TraceLog(tmp_path / "trace.jsonl")
    trace.write(m.Spans(role="generator", name="g", spans=[m.Span(state="decode", start_wall_s=1.0, duration_s=0.5,
                                                                    value=4)], dropped=1))
    trace.write(m.Stats(role="generator", name="g", state="generating", policy_version=1, wall_s=2.0,
                        counters={"generator/queue/running": 4, "generator/tokens/generated": 99}))
    trace.write(m.Event(role="trainer", name="trainer", event="stall", text="no reward server", wall_s=3.0))
    trace.close()
    records = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["span", "counters", "event"]
    assert records[0]["state"] == "decode" and records[0]["value"] == 4 and trace.num_dropped == 1
    assert records[1]["counters"] == {"generator/queue/running": 4}  # only what a timeline draws
