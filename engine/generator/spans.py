"""The generator's spans: one backend step becomes a prefill span (when it admitted rows) and a decode span
(value: the running batch), "spec_decode" when the step drafted and verified; idle turns say why.

    marks = step_marks(backend); finished = backend.step(); record_step(spans, backend, marks, len(finished))

Only counters the backend keeps anyway are read (BackendStats, SpecStats), so a step costs two list appends.
Test: pytest tests/engine/generator/test_spans.py
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from tailrace.protocol.telemetry import SpanBuffer


class StepMarks(NamedTuple):
    wall_s: float
    prefill_s: float
    spec_steps: int


def _spec_steps(backend: Any) -> int:
    spec = getattr(backend, "spec_stats", None)
    return spec.num_spec_steps if spec is not None else 0


def step_marks(backend: Any) -> StepMarks:
    return StepMarks(time.time(), backend.stats.prefill_s, _spec_steps(backend))


def record_step(spans: SpanBuffer, backend: Any, marks: StepMarks, num_finished: int) -> None:
    """Spans of the step that began at `marks`: prefill first (admission runs at the start of a step)."""
    end = time.time()
    prefill_end = min(end, marks.wall_s + backend.stats.prefill_s - marks.prefill_s)
    if prefill_end > marks.wall_s:
        spans.add("prefill", marks.wall_s, prefill_end)
    state = "spec_decode" if _spec_steps(backend) > marks.spec_steps else "decode"
    spans.add(state, prefill_end, end, value=backend.num_running + num_finished)


def idle_state(request_outstanding: bool, exhausted: bool) -> str:
    """Why a generator with nothing to decode waits: its work request is parked at the trainer (the
    staleness gate is closed), or there is no work to ask for (prompts exhausted, or no room)."""
    return "idle_parked" if request_outstanding and not exhausted else "idle_no_work"
