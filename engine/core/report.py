"""What a run tells its user in words, besides summary.json: what scores the trainer's completions (with
the line that attaches a reward server where one is needed), and the end of a run in one line, GRPO or
DPO. No heavy imports: `tailrace run` prints these. Test: pytest tests/engine/test_user_path.py
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


def _outcome(summary: dict[str, Any]) -> str:
    """What a run's steps did: DPO's margin and accuracy and pairs, or GRPO's reward and samples."""
    if summary.get("algorithm") == "dpo":
        first, last = summary.get("reward_margin_first"), summary.get("reward_margin_last")
        if first is None or last is None:
            return f"no pair trained, {summary.get('pairs_skipped_too_long', 0)} pairs skipped as too long"
        return (f"reward margin {first:.3f} -> {last:.3f}, accuracy {summary['accuracy_first']:.2f} -> "
                f"{summary['accuracy_last']:.2f}, {summary.get('pairs_trained', 0)} pairs trained, "
                f"{summary.get('pairs_skipped_too_long', 0)} skipped as too long")
    first, last = summary.get("reward_first"), summary.get("reward_last")
    reward = f"reward {first:.3f} -> {last:.3f}" if first is not None and last is not None else "no reward yet"
    discarded = sum(summary.get("discarded", {}).values())
    text = f"{reward}, {summary.get('samples_trained', 0)} samples trained, {discarded} discarded"
    if summary.get("steps_without_signal"):  # engine/trainer/reward_signal.py
        text += (f" ({summary['steps_without_signal']} of {summary.get('steps', 0)} steps without signal: "
                 "every group's samples got one reward)")
    return text


def summary_line(summary: dict[str, Any]) -> str:
    """The end of a run in words: steps and why it stopped, what they did (reward first -> last and
    samples; DPO: margin, accuracy and pairs), wall time, and the folder that from_pretrained loads."""
    text = (f"{summary.get('steps', 0)} steps ({summary.get('stop_reason') or 'stopped'}), {_outcome(summary)}, "
            f"{summary.get('wall_s', 0.0):.0f} s")
    if summary.get("checkpoint"):
        text += f"; model in {summary['checkpoint']} (loads with from_pretrained)"
    return text
