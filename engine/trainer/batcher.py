"""Streaming batcher: complete, scored groups wait here, first in first out, until a step's worth is ready.

A group enters as soon as its last sample is scored, so a step never waits for the slowest group of
"its" prompts: whatever has finished forms the next batch. A batch is ready when it holds groups_per_step
groups, or when its logical tokens reach max_tokens_per_step (the next group would not fit), whichever
comes first. Pending groups are bounded: the controller asks `has_room` before admitting more work.
Pure logic, no I/O. Test: pytest tests/engine/test_batcher.py
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tailrace.engine.samples import Group


@dataclass(kw_only=True, frozen=True)
class BatcherConfig:
    """groups_per_step: groups per optimizer step (0 = no group limit). max_tokens_per_step: logical
    tokens (prompt + completion, over all samples) per step (0 = no token limit). At least one is set.
    max_pending_groups: complete groups allowed to wait (back-pressure on admission)."""

    groups_per_step: int = 8
    max_tokens_per_step: int = 0
    max_pending_groups: int = 256

    def __post_init__(self) -> None:
        if self.groups_per_step < 0 or self.max_tokens_per_step < 0:
            raise ValueError("groups_per_step, max_tokens_per_step: must be >= 0")
        if self.groups_per_step == 0 and self.max_tokens_per_step == 0:
            raise ValueError("groups_per_step, max_tokens_per_step: set at least one of them")
        if self.max_pending_groups < max(1, self.groups_per_step):
            raise ValueError(f"max_pending_groups: must be >= groups_per_step ({self.groups_per_step})")


class StreamingBatcher:
    def __init__(self, config: BatcherConfig) -> None:
        self.config = config
        self._pending: deque[Group] = deque()
        self._pending_tokens = 0

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def pending_tokens(self) -> int:
        return self._pending_tokens

    @property
    def has_room(self) -> bool:
        return len(self._pending) < self.config.max_pending_groups

    def add(self, group: Group) -> None:
        """Queue a complete, scored group. Raises OverflowError when full (callers check has_room)."""
        if not self.has_room:
            raise OverflowError(f"batcher full: {len(self._pending)} groups pending")
        self._pending.append(group)
        self._pending_tokens += group.num_tokens

    def _ready_count(self) -> int:
        """How many leading groups form a batch now; 0 if none is ready yet."""
        max_groups, max_tokens = self.config.groups_per_step, self.config.max_tokens_per_step
        tokens = 0
        for count, group in enumerate(self._pending):
            if max_groups and count == max_groups:
                return count
            # The next group does not fit: the batch is full. A first group larger than the budget
            # alone still makes a batch, or it would block the queue for ever.
            if max_tokens and count and tokens + group.num_tokens > max_tokens:
                return count
            tokens += group.num_tokens
            if max_tokens and tokens >= max_tokens:
                return count + 1
        if max_groups and len(self._pending) == max_groups:
            return max_groups
        return 0

    def pop_batch(self) -> list[Group] | None:
        """The next batch, oldest groups first, or None when not enough has finished yet."""
        return self._take(self._ready_count())

    def flush(self) -> list[Group] | None:
        """Whatever is pending, as a (possibly short) batch, respecting the limits; None if empty.
        For the end of the data or a shutdown: call until None."""
        count = self._ready_count()
        return self._take(count or len(self._pending))

    def _take(self, count: int) -> list[Group] | None:
        if count == 0:
            return None
        batch = [self._pending.popleft() for _ in range(count)]
        self._pending_tokens -= sum(g.num_tokens for g in batch)
        return batch
