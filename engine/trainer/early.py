"""The trainer's early forward/backward: groups committed to the open step (Controller.take_for_step) run
their forward/backward at once (Learner.accumulate), while the step's other groups are still generated,
so that when the last one arrives only its own forward/backward and the optimizer step remain. The policy
version does not change until that optimizer step, so staleness is what it would be without this, and the
gradient is the same (tests/engine/trainer/test_learner_accumulate.py). train.early_backward false turns it off (a
batch barrier: the synchronous baseline of tools/bench.py pipeline). Test: tests/engine/trainer/test_controller_schedule.py
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol

from tailrace.engine.trainer.intake import to_group

if TYPE_CHECKING:
    from tailrace.engine.config import RunConfig
    from tailrace.engine.trainer.controller import Controller
    from tailrace.engine.trainer.learner import Learner
    from tailrace.protocol.telemetry import SpanBuffer


class EarlyService(Protocol):
    """What the early forward/backward uses of the trainer service (TrainerService satisfies it:
    tests/engine/trainer/test_collaborators.py)."""

    cfg: RunConfig
    learner: Learner
    controller: Controller
    spans: SpanBuffer
    train_busy_s: float  # the forward/backward's seconds are added here


async def accumulate_committed(service: EarlyService) -> None:
    """Commit the complete groups that belong to the open step and run the forward/backward of those not
    yet run (in a thread, like a step), again while more complete meanwhile; nothing when the step can
    close now (the step itself runs them, without a thread hop). A learner that cannot (several ranks)
    leaves them to the step."""
    accumulate = getattr(service.learner, "accumulate", None)
    if accumulate is None or not service.cfg.train.early_backward:
        return
    ctl = service.controller
    while True:
        ctl.take_for_step()
        done = service.learner.accumulated_group_ids
        todo = [g for g in ctl.step_groups if g.group_id not in done]
        if not todo or ctl.step_can_close():
            return
        started = time.monotonic()
        with service.spans.span("train_accumulate", value=len(todo)):
            ran = await asyncio.to_thread(accumulate, [to_group(g) for g in todo])
        if not ran:
            return
        service.train_busy_s += time.monotonic() - started
