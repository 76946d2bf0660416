"""The trainer's controller: which work goes to which generator, and which groups train when (pure logic).

    data source --(admit, within the staleness gate)--> pending sample ranges --(WorkRequest)--> generators
    generators --(Rollout)--> in-flight groups --(scored)--> complete groups --(take_for_step)--> the open
        step's groups (forward/backward early) --(close_step, once nothing it must hold is in flight)--> learner
    generator dies --> its unfinished sample ranges are discarded ("generator_dead") and re-queued
    lease runs out --> the sample is reclaimed ("lease_expired") and re-queued; a late result is dropped
    and counted under the reason it was reclaimed for, also once its group is over (`reclaimed`, bounded)

Nothing here does I/O: the trainer's loop (engine/trainer/main.py) calls these methods and sends what
they return. Every sample handed out ends as trained or discarded with a reason (docs/operating.md);
`check_accounting` proves it and raises AccountingError when it does not hold. Test: pytest tests/engine/trainer/test_controller.py
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tailrace.engine.core.samples import PromptRecord

MAX_RECLAIMED = 1 << 16  # reclaimed samples remembered for their late results (oldest forgotten first)


class AccountingError(RuntimeError):
    """A sample was lost or counted twice: handed out != trained + discarded + in flight."""


@dataclass
class SampleRange:
    group_id: int
    first_sample_id: int
    num_samples: int


@dataclass
class GroupState:
    group_id: int
    prompt: PromptRecord
    admitted_version: int  # policy version when admitted: generators must sample with >= this
    group_size: int
    assigned: dict[int, str] = field(default_factory=dict)  # sample_id -> generator peer name
    leases: dict[int, tuple[float, float]] = field(default_factory=dict)  # sample_id -> (handed out, deadline)
    results: dict[int, Any] = field(default_factory=dict)  # sample_id -> scored sample
    discarded: set[int] = field(default_factory=set)
    pending_scores: set[int] = field(default_factory=set)  # received, being scored

    @property
    def done(self) -> bool:
        return len(self.results) + len(self.discarded) == self.group_size and not self.pending_scores

    def min_version(self) -> int:
        """Oldest policy version the group can end up with: its received samples' oldest versions, and the
        admission version while any sample is still in flight or queued (it may be sampled with that
        version, the oldest a generator may use for it)."""
        versions = [s.min_policy_version for s in self.results.values()]
        if len(self.results) + len(self.discarded) < self.group_size:
            versions.append(self.admitted_version)
        return min(versions, default=self.admitted_version)


@dataclass
class WorkDecision:
    items: list[tuple[PromptRecord, SampleRange, int]]  # (prompt, range, min_policy_version)
    exhausted: bool


class Controller:
    """Admission, dispatch, tracking and batch formation for one run.

    Staleness: a batch trained with policy version V only contains samples whose oldest token was
    sampled with version >= V - max_staleness. Admission keeps at most (V + max_staleness + 1) *
    groups_per_step groups admitted, and every group that would otherwise become too stale is forced into
    the current step (which waits for it if needed), so the bound holds without discarding. Complete
    groups are committed to the open step as they come (take_for_step), so the trainer can run their
    forward/backward while the step waits for its slowest group; close_step says when the step may run.
    """

    def __init__(self, prompts: Iterator[PromptRecord], *, group_size: int, groups_per_step: int,
                 max_staleness: int, max_groups_in_flight: int = 0, policy_version: int = 0,
                 groups_admitted: int = 0, total_steps: int = 0, next_group_id: int | None = None,
                 unfinished: list[PromptRecord] | None = None):
        """After a resume, `unfinished` are the prompts of groups the checkpoint did not train (admitted
        again first), `groups_admitted` excludes them and `next_group_id` keeps group ids unique."""
        self.prompts = itertools.chain(unfinished or [], prompts)
        self.group_size = group_size
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.max_groups_in_flight = max_groups_in_flight or (max_staleness + 1) * groups_per_step
        self.policy_version = policy_version
        self.groups_admitted = groups_admitted  # over the whole run, resumes included
        self.next_group_id = groups_admitted if next_group_id is None else next_group_id
        self.base_admitted = groups_admitted - policy_version * groups_per_step
        self.total_steps = total_steps  # 0 = unbounded
        self.groups_empty = 0
        self.source_exhausted = False
        self.stopping = False
        self.groups: dict[int, GroupState] = {}
        self.queue: collections.deque[SampleRange] = collections.deque()
        self.complete: list[GroupState] = []
        self.step_groups: list[GroupState] = []  # committed to the step that trains policy_version (take_for_step)
        self.samples_handed_out = 0
        self.samples_trained = 0
        self.discarded: collections.Counter[str] = collections.Counter()
        self.max_staleness_seen = 0
        self.stopped_prompts: list[PromptRecord] = []  # prompts of the groups on_stop ended untrained
        # (group id, sample id, peer) -> why that peer's sample was taken back: its late result is dropped and
        # counted under that reason, also after the group is over (bounded: then it counts as unknown_group)
        self.reclaimed: collections.OrderedDict[tuple[int, int, str], str] = collections.OrderedDict()

    @property
    def exhausted(self) -> bool:
        """No group will ever be admitted again: the prompts ran out or the run took all its steps."""
        return self.source_exhausted or bool(self.total_steps and self.policy_version >= self.total_steps)

    def _enough_for_the_run(self) -> bool:
        """The groups admitted and not yet trained cover the run's remaining steps. Not final: a group
        may still end with no trainable sample, and a step may take more than groups_per_step (forced
        stale groups), so admission opens again when that changes."""
        if not self.total_steps:
            return False
        needed = (self.total_steps - self.policy_version) * self.groups_per_step
        return len(self.groups) + len(self.complete) + len(self.step_groups) >= needed

    # ------------------------------------------------------------------------------- admission

    def _gate_open(self) -> bool:
        allowed = self.base_admitted + (self.policy_version + self.max_staleness + 1) * self.groups_per_step
        in_flight = len(self.groups)
        return (not self.stopping and not self.exhausted and self.groups_admitted < allowed + self.groups_empty
                and in_flight < self.max_groups_in_flight and not self._enough_for_the_run())

    def _admit_one(self) -> bool:
        try:
            prompt = next(self.prompts)
        except StopIteration:
            self.source_exhausted = True
            return False
        group_id = self.next_group_id
        self.next_group_id += 1
        self.groups_admitted += 1
        self.groups[group_id] = GroupState(group_id, prompt, self.policy_version, self.group_size)
        self.queue.append(SampleRange(group_id, 0, self.group_size))
        return True

    def request_work(self, peer: str, capacity: int, *, now: float = 0.0,
                     lease_s: float = float("inf")) -> WorkDecision | None:
        """Work for a generator with room for `capacity` samples, or None to park the request
        until the gate opens (a new policy version, a re-queued range). Each sample handed out is leased
        to `peer` until now + lease_s (see expire_leases)."""
        items = []
        while capacity > 0:
            if not self.queue and not (self._gate_open() and self._admit_one()):
                break
            rng = self.queue[0]
            take = min(capacity, rng.num_samples)
            if take < rng.num_samples:
                self.queue[0] = SampleRange(rng.group_id, rng.first_sample_id + take, rng.num_samples - take)
            else:
                self.queue.popleft()
            group = self.groups[rng.group_id]
            for sid in range(rng.first_sample_id, rng.first_sample_id + take):
                group.assigned[sid] = peer
                group.leases[sid] = (now, now + lease_s)
                self.reclaimed.pop((rng.group_id, sid, peer), None)  # its result answers this hand-out now
            self.samples_handed_out += take
            capacity -= take
            items.append((group.prompt, SampleRange(rng.group_id, rng.first_sample_id, take),
                          group.admitted_version))
        if items:
            return WorkDecision(items, False)
        if self.stopping or (self.exhausted and not self.queue):
            return WorkDecision([], True)
        return None

    def request_work_possible(self) -> bool:
        """Would request_work answer now (work, or "exhausted") rather than park?"""
        return bool(self.queue) or self._gate_open() or self.stopping or self.exhausted

    # ------------------------------------------------------------------------------- results

    def check_rollout(self, peer: str, group_id: int, sample_id: int) -> str | None:
        """None if this sample is one we handed to `peer` and still wait for; else why it is dropped."""
        group = self.groups.get(group_id)
        late = self.reclaimed.get((group_id, sample_id, peer))
        if group is None:
            return late or "unknown_group"
        if group.assigned.get(sample_id) != peer:
            return late or "not_assigned"
        if sample_id in group.results or sample_id in group.discarded or sample_id in group.pending_scores:
            return "duplicate"
        return None

    def on_received(self, group_id: int, sample_id: int) -> float | None:
        """The sample's result arrived (it is being scored); returns when it was handed out."""
        group = self.groups[group_id]
        group.pending_scores.add(sample_id)
        handed_out, _ = group.leases.pop(sample_id, (None, None))
        return handed_out

    # Scoring finishes asynchronously: after on_stop the group is gone and was already counted.
    def on_scored(self, group_id: int, sample_id: int, sample: Any) -> None:
        group = self.groups.get(group_id)
        if group is None:
            return
        group.pending_scores.discard(sample_id)
        group.results[sample_id] = sample
        self._maybe_complete(group)

    def on_discard(self, group_id: int, sample_id: int, reason: str) -> None:
        group = self.groups.get(group_id)
        if group is None:
            return
        group.pending_scores.discard(sample_id)
        group.discarded.add(sample_id)
        self.discarded[reason] += 1
        self._maybe_complete(group)

    def _maybe_complete(self, group: GroupState) -> None:
        if group.done:
            del self.groups[group.group_id]
            if group.results:
                self.complete.append(group)
            else:
                self.groups_empty += 1

    def on_generator_dead(self, peer: str) -> list[SampleRange]:
        """Samples handed to a dead generator and not yet received are discarded ("generator_dead") and
        re-queued at the front, so the group completes from another generator."""
        return self._reclaim(lambda group, sid: group.assigned[sid] == peer, "generator_dead")

    def expire_leases(self, now: float) -> dict[str, int]:
        """Samples whose lease ran out before their result arrived are reclaimed ("lease_expired") and
        re-queued at the front; the late result, if it comes, is dropped. Returns {peer: samples}."""
        held: collections.Counter[str] = collections.Counter()

        def expired(group: GroupState, sid: int) -> bool:
            if group.leases.get(sid, (now, now))[1] >= now:
                return False
            held[group.assigned[sid]] += 1
            return True

        self._reclaim(expired, "lease_expired")
        return dict(held)

    def next_lease_end(self) -> tuple[float, str] | None:
        """(deadline, peer) of the lease that runs out first, for the watchdog."""
        leases = [(end, g.assigned[sid]) for g in self.groups.values() for sid, (_, end) in g.leases.items()]
        return min(leases, default=None)

    def _reclaim(self, lost_if: Callable[[GroupState, int], bool], reason: str) -> list[SampleRange]:
        requeued = []
        for group in self.groups.values():
            lost = sorted(sid for sid in list(group.assigned)
                          if sid not in group.results and sid not in group.discarded
                          and sid not in group.pending_scores and lost_if(group, sid))
            for sid in lost:
                self._remember(group.group_id, sid, group.assigned.pop(sid), reason)
                group.leases.pop(sid, None)
                self.discarded[reason] += 1
            for first, count in _runs(lost):
                requeued.append(SampleRange(group.group_id, first, count))
        self.queue.extendleft(reversed(requeued))
        return requeued

    def _remember(self, group_id: int, sample_id: int, peer: str, reason: str) -> None:
        self.reclaimed[(group_id, sample_id, peer)] = reason
        if len(self.reclaimed) > MAX_RECLAIMED:
            self.reclaimed.popitem(last=False)

    # ------------------------------------------------------------------------------- training

    def take_for_step(self) -> list[GroupState]:
        """Complete groups committed now to the step that trains policy version V = self.policy_version,
        so that the learner can run their forward/backward while the rest of the step's groups are still
        being generated (Learner.accumulate); returns the newly committed ones.

        Every group that would exceed the staleness bound after this step (min version < V + 1 -
        max_staleness) is committed as soon as it completes; other complete groups, stalest first, fill
        the step up to groups_per_step, keeping a slot for each such group still in flight. A committed
        group stays in the step: what changes later (a staler group completing) can only add to it."""
        limit = self.policy_version + 1 - self.max_staleness
        reserved = sum(g.min_version() < limit for g in self.groups.values())
        self.complete.sort(key=lambda g: g.min_version())  # stalest first; stable keeps arrival order
        taken, kept = [], []
        for group in self.complete:
            room = len(self.step_groups) + len(taken) + reserved < self.groups_per_step
            (taken if group.min_version() < limit or room else kept).append(group)
        self.complete = kept
        self.step_groups += taken
        return taken

    def step_can_close(self) -> bool:
        """No group that must be in the open step is still in flight, and it holds groups_per_step groups
        (more when more had to be in it). Fewer only when no more can come: nothing in flight and the
        gate closed (the data ran out, or the run holds the groups of all its remaining steps)."""
        limit = self.policy_version + 1 - self.max_staleness
        if any(g.min_version() < limit for g in self.groups.values()):
            return False
        if len(self.step_groups) >= self.groups_per_step:
            return True
        return bool(self.step_groups) and not self.groups and not self.queue and not self._gate_open()

    def close_step(self) -> list[GroupState] | None:
        """The open step's groups once it may run its optimizer step (step_can_close), or None to wait."""
        if not self.step_can_close():
            return None
        batch, self.step_groups = self.step_groups, []
        return batch

    def pop_batch(self) -> list[GroupState] | None:
        """Groups for the step that trains policy version V = self.policy_version, or None to wait
        (take_for_step, then close_step).

        A group whose oldest sample would exceed the staleness bound after this step must be in it:
        if such a group is still in flight, wait for it."""
        self.take_for_step()
        return self.close_step()

    def pop_final(self) -> list[GroupState]:
        """Whatever complete groups remain, committed ones first (used when the data is exhausted)."""
        batch, self.step_groups, self.complete = [*self.step_groups, *self.complete], [], []
        return batch

    def on_trained(self, batch: list[GroupState], version: int) -> None:
        for group in batch:
            for sample in group.results.values():
                self.max_staleness_seen = max(self.max_staleness_seen, version - sample.min_policy_version)
                self.samples_trained += 1

    def on_new_version(self, version: int) -> None:
        self.policy_version = version

    def on_stop(self, reason: str = "run_ended") -> list[int]:
        """Stop admitting; every sample handed out and not trained is discarded with `reason`.
        Returns the group ids to cancel at the generators; their prompts stay in `stopped_prompts`."""
        self.stopping = True
        self.stopped_prompts = [g.prompt for g in sorted([*self.groups.values(), *self.step_groups, *self.complete],
                                                          key=lambda g: g.group_id)]
        cancelled = []
        for group in self.groups.values():
            # handed out and neither trained nor already discarded (generator_dead ones left `assigned`)
            self.discarded[reason] += len(group.assigned) - len(group.discarded)
            cancelled.append(group.group_id)
        self.discarded[reason] += sum(len(g.results) for g in [*self.step_groups, *self.complete])
        self.groups.clear()
        self.complete.clear()
        self.step_groups.clear()
        self.queue.clear()  # queued ranges were never handed out
        return cancelled

    def checkpoint_state(self) -> tuple[dict[str, Any], list[PromptRecord]]:
        """What a checkpoint records: counters consistent with what it trained (samples in flight are not
        counted as handed out: after a resume their groups are handed out again, from scratch), and the
        prompts of the groups not yet trained, to admit again first."""
        unfinished = sorted([*self.groups.values(), *self.step_groups, *self.complete], key=lambda g: g.group_id)
        counters = {"samples_handed_out": self.samples_trained + sum(self.discarded.values()),
                    "groups_admitted": self.groups_admitted - len(unfinished), "next_group_id": self.next_group_id}
        return counters, [g.prompt for g in unfinished]

    def check_accounting(self) -> None:
        """Invariant 4: handed out == trained + discarded (once nothing is in flight)."""
        total = self.samples_trained + sum(self.discarded.values())
        in_flight = sum(len(g.assigned) - len(g.discarded) for g in self.groups.values())
        in_flight += sum(len(g.results) for g in [*self.step_groups, *self.complete])
        if self.samples_handed_out != total + in_flight:
            raise AccountingError(
                f"accounting broken: handed out {self.samples_handed_out}, trained {self.samples_trained}, "
                f"discarded {dict(self.discarded)}, in flight {in_flight}")

    def stats(self) -> dict[str, float]:
        return {
            "trainer/controller/groups_in_flight": len(self.groups),
            "trainer/controller/groups_complete": len(self.complete),
            "trainer/controller/groups_committed": len(self.step_groups),
            "trainer/controller/ranges_queued": len(self.queue),
            "trainer/controller/samples_handed_out": self.samples_handed_out,
            "trainer/controller/samples_trained": self.samples_trained,
            "trainer/controller/samples_discarded": sum(self.discarded.values()),
            "trainer/controller/max_staleness_seen": self.max_staleness_seen,
        }


def _runs(ids: list[int]) -> Iterator[tuple[int, int]]:
    """Consecutive runs of sorted ints as (first, count)."""
    start = prev = None
    for i in ids:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            yield start, prev - start + 1
            start = prev = i
    if start is not None:
        yield start, prev - start + 1

