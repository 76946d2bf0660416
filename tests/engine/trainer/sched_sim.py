"""A discrete-event simulation of one run around the real Controller: fake generators (continuous
batching, a decode step whose cost grows with the running batch, weights that arrive some time after
they are published, samples of heavy-tailed lengths fixed by (group, sample)) and a fake trainer (a step
costs a + b * tokens). Simulated time only: no sleeps, no processes, deterministic.

Used by tests/engine/trainer/test_controller_schedule.py to measure what the scheduler rule costs (the trainer's
idle share) and to check the staleness bound and the accounting on long-tail workloads.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from tailrace.engine.core.samples import PromptRecord
from tailrace.engine.trainer.controller import Controller


@dataclass(frozen=True)
class Workload:
    """Costs in simulated seconds; lengths log-normal around a per-prompt median (groups share a prompt)."""

    steps: int = 12
    groups_per_step: int = 8
    group_size: int = 8
    num_generators: int = 2
    max_batch_size: int = 32
    decode_s: tuple[float, float] = (3.4e-3, 0.12e-3)  # a + b * running batch
    train_s: tuple[float, float] = (16e-3, 140e-6)  # a + b * tokens of the batch
    weights_delay_s: float = 0.02  # published -> loaded by a generator
    prompt_tokens: int = 12
    length_median: float = 6.0
    length_sigma_prompt: float = 0.8  # spread of the per-prompt median
    length_sigma_sample: float = 0.3  # spread of the samples of one prompt around it
    max_new_tokens: int = 64
    seed: int = 0

    def length(self, group_id: int, sample_id: int) -> int:
        prompt_rng = random.Random(f"{self.seed}:prompt:{group_id}")
        median = math.log(self.length_median) + prompt_rng.gauss(0.0, self.length_sigma_prompt)
        rng = random.Random(f"{self.seed}:sample:{group_id}:{sample_id}")
        return max(1, min(self.max_new_tokens, round(math.exp(rng.gauss(median, self.length_sigma_sample)))))


@dataclass
class Sample:
    min_policy_version: int
    num_tokens: int


@dataclass
class _Gen:
    name: str
    version: int = 0
    waiting: list = field(default_factory=list)  # (group_id, sample_id, min version)
    running: list = field(default_factory=list)  # [group_id, sample_id, start version, tokens left, length]
    busy_until: float | None = None
    busy_s: float = 0.0
    parked: bool = False


@dataclass
class Result:
    seconds: float
    trainer_busy_s: float
    generator_busy_s: list[float]
    max_staleness_seen: int
    staleness_ok: bool  # every trained sample within the bound
    controller: Controller
    batches: list[list[int]]  # group ids trained, per step

    @property
    def idle_trainer(self) -> float:
        return 1.0 - self.trainer_busy_s / self.seconds


def _prompts():
    i = 0
    while True:
        yield PromptRecord(i, [1] * 4, f"p{i}", "t")
        i += 1


def simulate(w: Workload, max_staleness: int, *, incremental: bool = False, **controller_kwargs) -> Result:
    """Run w.steps training steps; returns the figures. incremental: the trainer runs the forward/backward
    of each group committed to the open step at once (Controller.take_for_step), the optimizer step when it
    closes; else the whole step when Controller.pop_batch gives it. Raises AssertionError if the run deadlocks."""
    ctl = Controller(_prompts(), group_size=w.group_size, groups_per_step=w.groups_per_step,
                     max_staleness=max_staleness, total_steps=w.steps, **controller_kwargs)
    gens = [_Gen(f"gen-{i}") for i in range(w.num_generators)]
    events: list = []  # (time, seq, kind, payload)
    seq = 0

    def push(t: float, kind: str, payload=None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    now, trainer_busy, trainer_free_at, staleness_ok = 0.0, 0.0, None, True
    batches: list[list[int]] = []

    def ask(gen: _Gen) -> None:
        room = w.max_batch_size - len(gen.running) - len(gen.waiting)
        if room <= 0:
            return
        decision = ctl.request_work(gen.name, room, now=now)
        gen.parked = decision is None
        for _, rng, min_version in (decision.items if decision else []):
            gen.waiting += [(rng.group_id, sid, min_version)
                            for sid in range(rng.first_sample_id, rng.first_sample_id + rng.num_samples)]
        kick(gen)

    def kick(gen: _Gen) -> None:
        if gen.busy_until is not None:
            return
        startable = [x for x in gen.waiting if x[2] <= gen.version][: w.max_batch_size - len(gen.running)]
        for x in startable:
            gen.waiting.remove(x)
            gen.running.append([x[0], x[1], gen.version, w.length(x[0], x[1]), 0])
        if gen.running:
            cost = w.decode_s[0] + w.decode_s[1] * len(gen.running)
            gen.busy_until = now + cost
            gen.busy_s += cost
            push(gen.busy_until, "decode", gen)

    accumulated: set[int] = set()  # groups of the open step whose forward/backward already ran

    def tokens_of(groups) -> int:
        return sum(s.num_tokens for g in groups for s in g.results.values())

    def try_train() -> None:
        nonlocal trainer_free_at, trainer_busy
        if trainer_free_at is not None or ctl.policy_version >= w.steps:
            return
        if incremental:
            taken = ctl.take_for_step()
            if taken:  # forward/backward of the committed groups now; the optimizer step later
                accumulated.update(g.group_id for g in taken)
                cost = w.train_s[1] * tokens_of(taken)
                trainer_busy += cost
                trainer_free_at = now + cost
                push(trainer_free_at, "accumulated", None)
                return
            batch = ctl.close_step()
        else:
            batch = ctl.pop_batch()
        if batch is None:
            return
        cost = w.train_s[0] + w.train_s[1] * tokens_of([g for g in batch if g.group_id not in accumulated])
        accumulated.clear()
        trainer_busy += cost
        trainer_free_at = now + cost
        push(trainer_free_at, "trained", batch)

    for gen in gens:
        ask(gen)
    while ctl.policy_version < w.steps:
        assert events, f"deadlock at t={now:.3f}: {ctl.stats()}"
        now, _, kind, payload = heapq.heappop(events)
        if kind == "decode":
            gen = payload
            gen.busy_until = None
            still = []
            for row in gen.running:
                row[3] -= 1
                row[4] += 1
                if row[3] > 0:
                    still.append(row)
                    continue
                ctl.on_received(row[0], row[1])
                ctl.on_scored(row[0], row[1], Sample(row[2], w.prompt_tokens + row[4]))
            gen.running = still
            ask(gen)
            kick(gen)
        elif kind == "trained":
            version = ctl.policy_version
            for group in payload:
                staleness_ok &= all(version - s.min_policy_version <= max_staleness for s in group.results.values())
            ctl.on_trained(payload, version)
            batches.append([g.group_id for g in payload])
            ctl.on_new_version(version + 1)
            trainer_free_at = None
            for gen in gens:
                push(now + w.weights_delay_s, "weights", (gen, version + 1))
                if gen.parked:
                    ask(gen)
        elif kind == "accumulated":
            trainer_free_at = None
        elif kind == "weights":
            gen, version = payload
            gen.version = max(gen.version, version)
            kick(gen)
        try_train()
    return Result(now, trainer_busy, [g.busy_s for g in gens], ctl.max_staleness_seen, staleness_ok, ctl, batches)


def sync_seconds(w: Workload) -> float:
    """The same workload with max_staleness 0 (generate the batch, then train)."""
    return simulate(w, 0).seconds
