"""Micro-batches in lock step across trainer ranks under per-layer FSDP2 residency.

With train.fsdp.step_residency = "layer" every FSDP unit all-gathers its parameters in its forward and
reduce-scatters its gradient in its backward, so all ranks must call every unit the same number of times
in the same order. A strategy given a Lockstep therefore:

    plans its micro-batches locally (each = one call of the root, which runs every layer once)
    agree(phase, [counts, decisions]) -> the element-wise maximum over ranks (one all-reduce)
    runs its own micro-batches, then pad(backward) for the ones it lacks (zero weight, statistics dropped)

so every rank runs exactly the agreed count, whatever its share of the batch (none at all included).
The trainer builds it (engine/trainer/learner.py); strategies (engine/trainer, engine/replay) only use it.
Test: pytest tests/engine/trainer/test_dist.py
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Lockstep:
    """agree_max: element-wise maximum over ranks of a list of ints (collective). pad(backward): one
    zero-weight micro-batch through every unit of the model (forward; backward too when `backward`).
    check(entries): compares a hash of the planned schedule across ranks (train.fsdp.check_schedule;
    a no-op otherwise)."""

    agree_max: Callable[[Sequence[int]], list[int]]
    pad: Callable[[bool], None]
    check: Callable[[Sequence[object]], None]

    def agree(self, phase: str, values: Sequence[int], *, backward: bool) -> list[int]:
        """The ranks' maximum of `values` (values[0] is the phase's micro-batch count); every rank then
        plans `phase` with these numbers, which check() verifies when asked to."""
        agreed = self.agree_max(values)
        self.check((phase, tuple(agreed), backward))
        return agreed

    def pad_to(self, done: int, agreed: int, *, backward: bool) -> None:
        """Padding micro-batches after this rank's `done` ones, up to the agreed count."""
        assert done <= agreed, f"ran {done} micro-batches of {agreed} agreed"
        for _ in range(agreed - done):
            self.pad(backward)
