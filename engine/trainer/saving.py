"""How the trainer saves: checkpoints (a record consistent with what they trained, the files written off
the event loop), summary.json at the end, and what it does when a write to its run folder fails (writes.py
names the failure):

    a periodic checkpoint (checkpoint.every_steps)   its partial folder is removed, it is skipped with a
                                                     warning, and the run goes on; the next one failing too
                                                     stops the run
    trace.jsonl (telemetry)                          said once; the trace ends there, the run goes on
    any other write (metrics.jsonl, trained.jsonl,   stops the run at once
    a drafter in a checkpoint)
    a stop for a failed write                        no final checkpoint is tried: `latest` stays at the last
                                                     complete one, which --resume continues from (the steps
                                                     after it are trained again, their log lines dropped)

Each failure is one line on stderr ("tailrace trainer: cannot write PATH: [Errno 28] No space left on
device; ..." with what became of the run), Event "write_failed" on the notice socket (`tailrace run` prints
it on its own stderr), the peers' Shutdown reason and summary.json's stop_reason (when it can be written).
Operators: docs/operating.md, "A full disk (or any failed write)". Test: pytest tests/engine/trainer/test_disk_errors.py
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from tailrace.engine.trainer import checkpoint
from tailrace.engine.trainer.writes import WriteFailed, say, writing
from tailrace.protocol import messages as m


def save_checkpoint(service: Any) -> Path:
    with service.spans.span("checkpoint"):
        return _write_checkpoint(service, _checkpoint_record(service))


async def save_checkpoint_off_loop(service: Any) -> Path:
    """The same, with the file writes in a worker thread: the event loop keeps serving peers. The record
    is taken on the loop, where the controller changes; the learner does not change meanwhile (the train
    loop awaits this)."""
    with service.spans.span("checkpoint"):
        return await asyncio.to_thread(_write_checkpoint, service, _checkpoint_record(service))


def _checkpoint_record(service: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(data position, counters) consistent with what the checkpoint trained."""
    service.state = "checkpointing"
    ctrl = service.controller
    consistent, unfinished = ctrl.checkpoint_state()
    if ctrl.stopping:  # on_stop has counted them run_ended; the next run admits them again
        unfinished = ctrl.stopped_prompts
    position = {"prompts_consumed": service.source.position, "groups_admitted": consistent["groups_admitted"],
                "next_group_id": consistent["next_group_id"],
                "unfinished": [dataclasses.asdict(p) for p in unfinished]}
    return position, service.summary() | {"samples_handed_out": consistent["samples_handed_out"]}


def _write_checkpoint(service: Any, record: tuple[dict[str, Any], dict[str, Any]]) -> Path:
    position, counters = record
    folder = checkpoint.save(service.run_dir / "checkpoint", service.learner, data_position=position,
                             counters=counters, tokenizer=service.tokenizer, keep_last=service.cfg.checkpoint.keep)
    if folder.is_dir():  # rank 0 alone relays drafters
        with writing(folder):
            service.drafters.save(folder)
    return folder


def last_checkpoint(run_dir: Path) -> str:
    """What --resume would continue from, in words."""
    latest = checkpoint.latest(run_dir / "checkpoint")
    return f"checkpoint {latest.name}" if latest is not None else "no complete checkpoint (a resume starts over)"


async def periodic_checkpoint(service: Any) -> None:
    """checkpoint.every_steps: a checkpoint that cannot be written is skipped with a warning (its partial
    folder already removed), and the run goes on; the next one failing too raises (the run stops)."""
    try:
        await service.save_checkpoint_off_loop()
    except WriteFailed as exc:
        service.checkpoints_failed += 1
        if service.checkpoints_failed >= 2:
            raise
        exc.outcome = (f"checkpoint of step {service.learner.step_count} skipped (its partial folder removed; the "
                       f"last complete one is {last_checkpoint(service.run_dir)}); the run stops if the next one fails too")
        await warn(service, exc)
    else:
        service.checkpoints_failed = 0


async def warn(service: Any, exc: WriteFailed) -> None:
    """Say a failed write: on stderr, and as Event "write_failed" on the notice socket (`tailrace run` prints
    it on its own stderr, which is not on the run folder's disk)."""
    await service.server.publish(say_failed(service, exc))


def trace_failed(service: Any, exc: WriteFailed) -> None:
    """TraceLog's on_failure: the trace ends, the run goes on (said once)."""
    exc.outcome = "trace.jsonl ends here (tools/timeline.py reads it up to this point); the run goes on"
    event = say_failed(service, exc)
    if service.state != "stopping":  # else the run's end is near and says its own reason
        service.spawn(service.server.publish(event), "write-failed-notice")


def say_failed(service: Any, exc: WriteFailed) -> m.Event:
    text = f"tailrace trainer: {exc}"
    say(text)
    service.counters["trainer/writes/failed"] += 1
    event = m.Event(role="trainer", name="trainer", event="write_failed", text=text, fields={"path": exc.path},
                    wall_s=time.time())
    with contextlib.suppress(WriteFailed):  # the trace is on the same disk: then it ends here
        service.trace.write(event)
    return event


def stopped_outcome(service: Any) -> str:
    return (f"the run stopped at step {service.learner.step_count}, resumable: --resume continues from "
            f"{last_checkpoint(service.run_dir)} once there is room (the steps after it are trained again)")


def finish(service: Any) -> dict[str, Any]:
    """The final checkpoint and summary.json. After a failed write no final checkpoint is tried (the run
    resumes from the last complete one); a final checkpoint or summary that cannot be written is said in
    one line, and the run ends as failed."""
    service.controller.check_accounting()
    if not isinstance(service.failure, WriteFailed):
        try:
            service.save_checkpoint()
        except WriteFailed as exc:
            service.fail("the final checkpoint", exc)
            say(f"tailrace trainer: {exc}")
    latest = checkpoint.latest(service.run_dir / "checkpoint")
    summary = service.summary() | {"checkpoint": str(latest.parent / checkpoint.LATEST) if latest else None}
    try:
        with writing(service.run_dir / "summary.json"):
            (service.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    except WriteFailed as exc:
        service.fail("summary.json", exc)
        say(f"tailrace trainer: {exc}")
    for close in (service.sink.close, lambda: _close_trace(service)):
        try:
            close()
        except OSError as exc:  # the run's end is already decided; the metrics' tail is what failed
            say(f"tailrace trainer: {WriteFailed(service.run_dir, exc)}")
    return summary


def _close_trace(service: Any) -> None:
    if (spans := service.spans.drain()) is not None:
        with contextlib.suppress(WriteFailed):  # the trace ends where it failed
            service.trace.write(spans)
    service.trace.close()
