"""The staleness bound and the accounting under random schedules (hypothesis), with fake generators that
lag behind the trainer's policy version, split groups between them, update weights while samples are in
flight, and finish samples in any order; plus leases. Pure controller logic, no processes.
Run: pytest tests/engine/trainer/test_controller_properties.py
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.engine.core.samples import PromptRecord
from tailrace.engine.trainer.controller import Controller


@dataclass
class FakeSample:
    min_policy_version: int


@dataclass
class FakeGenerator:
    """Samples with its own policy version, which lags the trainer's by up to `lag` versions (a sample
    needs at least its WorkItem.min_policy_version: a generator below it waits for weights, as the real
    one does). A running sample's oldest token keeps the version it started with."""

    name: str
    capacity: int
    lag: int
    version: int = 0
    running: list[tuple[int, int, int]] = field(default_factory=list)  # (group_id, sample_id, start version)
    waiting: list[tuple[int, int, int]] = field(default_factory=list)  # (group_id, sample_id, min version)


def prompts():
    i = 0
    while True:
        yield PromptRecord(i, [1, 2], f"p{i}", "t")
        i += 1


def simulate(seed: int, max_staleness: int, group_size: int, groups_per_step: int, num_generators: int,
             steps: int = 12) -> Controller:
    rng = random.Random(seed)
    ctrl = Controller(prompts(), group_size=group_size, groups_per_step=groups_per_step,
                      max_staleness=max_staleness, total_steps=steps)
    gens = [FakeGenerator(f"g{i}", capacity=rng.randint(1, 2 * group_size), lag=rng.randint(0, 3))
            for i in range(num_generators)]
    version = 0
    for _ in range(20_000):
        if version >= steps:
            break
        gen = rng.choice(gens)
        action = rng.random()
        if action < 0.25:  # ask for work up to the free room
            room = gen.capacity - len(gen.running) - len(gen.waiting)
            decision = ctrl.request_work(gen.name, room) if room > 0 else None
            for _, r, min_version in (decision.items if decision else []):
                gen.waiting.extend((r.group_id, sid, min_version)
                                   for sid in range(r.first_sample_id, r.first_sample_id + r.num_samples))
        elif action < 0.45:  # weights arrive (maybe not the newest: lagging generators)
            gen.version = max(gen.version, version - rng.randint(0, gen.lag))
        elif action < 0.55:  # start what the generator's version allows
            startable = [w for w in gen.waiting if w[2] <= gen.version]
            for w in startable:
                gen.waiting.remove(w)
                gen.running.append((w[0], w[1], gen.version))
        elif gen.running:  # finish a random running sample (any order, across generators)
            group_id, sample_id, started = gen.running.pop(rng.randrange(len(gen.running)))
            assert ctrl.check_rollout(gen.name, group_id, sample_id) is None
            ctrl.on_received(group_id, sample_id)
            if rng.random() < 0.05:
                ctrl.on_discard(group_id, sample_id, "reward_error")
            else:
                ctrl.on_scored(group_id, sample_id, FakeSample(started))
        batch = ctrl.pop_batch()
        if batch is not None:
            ctrl.on_trained(batch, version)
            version += 1
            ctrl.on_new_version(version)
    assert version >= steps, "the simulated run stalled"
    ctrl.on_stop()
    ctrl.check_accounting()
    return ctrl


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), max_staleness=st.integers(0, 4), group_size=st.integers(1, 6),
       groups_per_step=st.integers(1, 4), num_generators=st.integers(1, 4))
def test_staleness_never_exceeds_the_bound(seed, max_staleness, group_size, groups_per_step, num_generators):
    ctrl = simulate(seed, max_staleness, group_size, groups_per_step, num_generators)
    assert ctrl.max_staleness_seen <= max_staleness


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_newer_sample_first_does_not_release_the_older_one(max_staleness):
    """A group split across two generators: the up-to-date one returns its sample first, sampled with a
    newer version; the other sample, still in flight at the admission version, keeps the step that would
    make it too stale waiting for it."""
    ctrl = Controller(prompts(), group_size=2, groups_per_step=1, max_staleness=max_staleness)
    ctrl.request_work("old", 1)  # group 0, sample 0: stays out, sampled with version 0
    ctrl.request_work("new", 1)  # group 0, sample 1
    version = 0
    for _ in range(max_staleness + 3):
        if version == max_staleness:
            ctrl.on_received(0, 1)
            ctrl.on_scored(0, 1, FakeSample(max_staleness))  # after an in-flight weight update
        decision = ctrl.request_work("new", 2)
        for _, r, _ in decision.items if decision else []:
            for sid in range(r.first_sample_id, r.first_sample_id + r.num_samples):
                ctrl.on_received(r.group_id, sid)
                ctrl.on_scored(r.group_id, sid, FakeSample(version))
        batch = ctrl.pop_batch()
        if batch is None:
            break
        ctrl.on_trained(batch, version)
        version += 1
        ctrl.on_new_version(version)
    assert version == max_staleness  # one more step would leave sample 0 too stale
    ctrl.on_received(0, 0)
    ctrl.on_scored(0, 0, FakeSample(0))
    batch = ctrl.pop_batch()
    assert 0 in [g.group_id for g in batch]
    ctrl.on_trained(batch, version)
    assert ctrl.max_staleness_seen == max_staleness


def test_a_lease_that_runs_out_re_dispatches_and_drops_the_late_result():
    ctrl = Controller(prompts(), group_size=4, groups_per_step=1, max_staleness=1)
    ctrl.request_work("silent", 4, now=0.0, lease_s=10.0)
    assert ctrl.expire_leases(now=9.0) == {}
    assert ctrl.next_lease_end() == (10.0, "silent")
    ctrl.on_received(0, 0)  # one result came back in time; its lease ends
    ctrl.on_scored(0, 0, FakeSample(0))
    assert ctrl.expire_leases(now=10.5) == {"silent": 3}
    assert ctrl.discarded == {"lease_expired": 3}
    work = ctrl.request_work("other", 8, now=11.0, lease_s=10.0)
    assert [(r.group_id, r.first_sample_id, r.num_samples) for _, r, _ in work.items][0] == (0, 1, 3)
    assert ctrl.check_rollout("silent", 0, 1) == "lease_expired"  # the late result is dropped
    for sid in (1, 2, 3):
        assert ctrl.check_rollout("other", 0, sid) is None
        ctrl.on_received(0, sid)
        ctrl.on_scored(0, sid, FakeSample(0))
    batch = ctrl.pop_batch()
    assert [g.group_id for g in batch] == [0] and len(batch[0].results) == 4
    ctrl.on_trained(batch, 0)
    ctrl.on_stop()
    ctrl.check_accounting()
    assert ctrl.samples_trained == 4 and ctrl.samples_handed_out == 4 + 3 + 4  # 4 more for group 1


def test_a_late_result_counts_under_why_its_sample_was_taken_back_also_once_its_group_is_over():
    """Issue 31: a late Rollout of a lease that ran out was counted unknown_group once another generator
    had finished the group; it is lease_expired (generator_dead for a dead generator's), whatever the group."""
    ctrl = Controller(prompts(), group_size=3, groups_per_step=1, max_staleness=1)
    ctrl.request_work("gone", 1, now=0.0, lease_s=50.0)  # sample 0
    ctrl.request_work("slow", 2, now=0.0, lease_s=5.0)  # samples 1, 2
    ctrl.on_generator_dead("gone")
    assert ctrl.expire_leases(now=6.0) == {"slow": 2}
    assert ctrl.check_rollout("slow", 0, 1) == "lease_expired"  # the group is still open
    again = ctrl.request_work("slow", 1, now=6.0, lease_s=5.0).items  # sample 1 again, to the same generator
    assert [(r.first_sample_id, r.num_samples) for _, r, _ in again] == [(1, 1)]
    ctrl.request_work("other", 2, now=6.0, lease_s=5.0)  # samples 2 and 0
    for peer, sid in (("slow", 1), ("other", 2), ("other", 0)):
        assert ctrl.check_rollout(peer, 0, sid) is None  # sample 0 answers slow's new hand-out
        ctrl.on_received(0, sid)
        ctrl.on_scored(0, sid, FakeSample(0))
    assert 0 not in ctrl.groups  # the group is over
    assert ctrl.check_rollout("slow", 0, 2) == "lease_expired"
    assert ctrl.check_rollout("gone", 0, 0) == "generator_dead"
    assert ctrl.check_rollout("slow", 0, 1) == "unknown_group"  # its result answered the second hand-out
    assert ctrl.check_rollout("stranger", 0, 1) == "unknown_group"
    assert dict(ctrl.discarded) == {"lease_expired": 2, "generator_dead": 1}


def test_resume_from_a_checkpoint_trains_every_prompt_once_and_accounts_exactly():
    """A checkpoint taken with groups in flight and complete-but-untrained: the resumed controller admits
    exactly those prompts again first, counts nothing twice, and its group ids never repeat."""
    source = prompts()
    first = Controller(source, group_size=2, groups_per_step=2, max_staleness=1, total_steps=4)
    trained: list[int] = []

    def step(ctrl, version, peer="g"):
        while (batch := ctrl.pop_batch()) is None:
            decision = ctrl.request_work(peer, 3)
            assert decision is not None
            for _, r, _ in decision.items:
                for sid in range(r.first_sample_id, r.first_sample_id + r.num_samples):
                    ctrl.on_received(r.group_id, sid)
                    ctrl.on_scored(r.group_id, sid, FakeSample(version))
        ctrl.on_trained(batch, version)
        trained.extend(g.prompt.prompt_id for g in batch)
        ctrl.on_new_version(version + 1)

    step(first, 0)
    step(first, 1)
    first.request_work("g", 3)  # more in flight at the checkpoint
    counters, unfinished = first.checkpoint_state()
    assert unfinished and counters["samples_handed_out"] == first.samples_trained + sum(first.discarded.values())
    assert counters["samples_handed_out"] < first.samples_handed_out  # the in-flight ones are not counted
    resumed = Controller(source, group_size=2, groups_per_step=2, max_staleness=1, total_steps=4,
                         policy_version=2, groups_admitted=counters["groups_admitted"],
                         next_group_id=counters["next_group_id"], unfinished=unfinished)
    resumed.samples_handed_out = counters["samples_handed_out"]
    resumed.samples_trained = first.samples_trained
    resumed.discarded.update(first.discarded)
    ids_before = set(first.groups) | {g.group_id for g in first.complete}
    step(resumed, 2)
    assert not ids_before & {g.group_id for g in resumed.complete} | set(resumed.groups)
    step(resumed, 3)
    resumed.on_stop()
    resumed.check_accounting()
    assert len(trained) == len(set(trained))  # no prompt twice
    after = trained[trained.index(unfinished[0].prompt_id):]
    assert after[:len(unfinished)] == [p.prompt_id for p in unfinished]  # the unfinished ones come first
    assert max(trained) == len(trained) - 1  # and none was skipped
