"""What a run tells its user in words, besides summary.json: the line to attach a reward server to a
trainer, and the end of a run in one line. No heavy imports: `tailrace run` prints these.
Test: pytest tests/engine/test_user_path.py
"""

from __future__ import annotations

from typing import Any


def connect_failed(role: str, address: str, exc: Exception, connect_timeout_s: float) -> str:
    """One line for a peer that could not join its trainer: refused (with the trainer's reason) or unanswered."""
    from tailrace.protocol.transport import Rejected

    if isinstance(exc, Rejected):
        return f"tailrace {role}: the trainer at {address} refused it: {exc}"
    return (f"tailrace {role}: no trainer answered at {address} within --connect-timeout-s {connect_timeout_s:g} "
            "(is it running, and is this its trainer.bind address?)")


def attach_line(address: str, task: str, *, curve: bool = False) -> str:
    keys = " --curve-server-key FILE --curve-key FILE" if curve else ""
    return f"tailrace reward --connect {address} --fn module:function --tasks {task}{keys}"


def summary_line(summary: dict[str, Any]) -> str:
    """The end of a run in words: steps and why it stopped, reward first -> last, samples, wall time,
    and the folder that from_pretrained loads."""
    first, last = summary.get("reward_first"), summary.get("reward_last")
    reward = f"reward {first:.3f} -> {last:.3f}" if first is not None and last is not None else "no reward yet"
    discarded = sum(summary.get("discarded", {}).values())
    text = (f"{summary.get('steps', 0)} steps ({summary.get('stop_reason') or 'stopped'}), {reward}, "
            f"{summary.get('samples_trained', 0)} samples trained, {discarded} discarded, "
            f"{summary.get('wall_s', 0.0):.0f} s")
    if summary.get("checkpoint"):
        text += f"; model in {summary['checkpoint']} (loads with from_pretrained)"
    return text
