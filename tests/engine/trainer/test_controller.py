"""Controller decisions with fake generators: admission under the staleness bound, re-dispatch after a
generator dies, batch formation, and the accounting invariant (handed out == trained + discarded)."""

import subprocess
import sys
from dataclasses import dataclass

import pytest

from tailrace.engine.core.samples import PromptRecord
from tailrace.engine.trainer.controller import AccountingError, Controller


@dataclass
class FakeSample:
    min_policy_version: int


def prompts(n=None):
    i = 0
    while n is None or i < n:
        yield PromptRecord(i, [1, 2, 3], f"p{i}", "t")
        i += 1


def make(**kw):
    args = dict(group_size=4, groups_per_step=2, max_staleness=1)
    args.update(kw)
    return Controller(prompts(args.pop("num_prompts", None)), **args)


def finish(ctrl, group_id, version=0, peer="g0"):
    group = ctrl.groups[group_id]
    for sid, owner in list(group.assigned.items()):
        if owner == peer and sid not in group.results:
            assert ctrl.check_rollout(peer, group_id, sid) is None
            ctrl.on_received(group_id, sid)
            ctrl.on_scored(group_id, sid, FakeSample(version))


def test_admission_respects_staleness_gate():
    ctrl = make(max_staleness=1)
    work = ctrl.request_work("g0", 1000)
    # (V + s + 1) * groups_per_step = 4 groups of 4 samples
    assert sum(r.num_samples for _, r, _ in work.items) == 16
    assert ctrl.request_work("g0", 1000) is None  # parked until the version advances
    finish(ctrl, 0)
    finish(ctrl, 1)
    ctrl.on_trained(ctrl.pop_batch(), 0)
    ctrl.on_new_version(1)
    work = ctrl.request_work("g0", 1000)
    assert sum(r.num_samples for _, r, _ in work.items) == 8
    assert all(v == 1 for _, _, v in work.items)  # must be sampled with version >= 1


def test_on_policy_admits_one_step():
    ctrl = make(max_staleness=0)
    work = ctrl.request_work("g0", 1000)
    assert len(work.items) == 2
    assert ctrl.request_work("g1", 1000) is None


def test_capacity_splits_groups():
    ctrl = make(group_size=4)
    work = ctrl.request_work("g0", 3)
    assert [(r.group_id, r.first_sample_id, r.num_samples) for _, r, _ in work.items] == [(0, 0, 3)]
    work = ctrl.request_work("g1", 3)
    assert [(r.group_id, r.first_sample_id, r.num_samples) for _, r, _ in work.items] == [(0, 3, 1), (1, 0, 2)]


def test_redispatch_after_generator_death_and_accounting():
    ctrl = make(group_size=4, groups_per_step=1, max_staleness=0)
    ctrl.request_work("g0", 4)
    group = ctrl.groups[0]
    ctrl.on_received(0, 0)
    ctrl.on_scored(0, 0, FakeSample(0))
    requeued = ctrl.on_generator_dead("g0")
    assert [(r.group_id, r.first_sample_id, r.num_samples) for r in requeued] == [(0, 1, 3)]
    assert ctrl.discarded["generator_dead"] == 3
    work = ctrl.request_work("g1", 8)
    assert [(r.group_id, r.first_sample_id, r.num_samples) for _, r, _ in work.items] == [(0, 1, 3)]
    assert ctrl.check_rollout("g0", 0, 1) == "generator_dead"  # the dead one's late result is refused, counted so
    finish(ctrl, 0, peer="g1")
    assert group.done
    batch = ctrl.pop_batch()
    assert [g.group_id for g in batch] == [0]
    ctrl.on_trained(batch, 0)
    ctrl.check_accounting()
    assert ctrl.samples_handed_out == 7 and ctrl.samples_trained == 4


def test_broken_accounting_raises_even_under_python_O(tmp_path):
    ctrl = make(group_size=4, groups_per_step=1)
    ctrl.request_work("g0", 4)
    finish(ctrl, 0)
    batch = ctrl.pop_batch()
    ctrl.on_trained(batch, 0)
    ctrl.samples_trained += 1  # a sample counted twice
    with pytest.raises(AccountingError, match="handed out 4, trained 5"):
        ctrl.check_accounting()
    # a real error, not an assert: python -O keeps it
    code = ("from tailrace.engine.trainer.controller import Controller, AccountingError\n"
            "c = Controller(iter([]), group_size=1, groups_per_step=1, max_staleness=0)\n"
            "c.samples_handed_out = 1\n"
            "try:\n    c.check_accounting()\nexcept AccountingError:\n    print('raised')\n")
    done = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "raised", done.stderr[-2000:]


def test_duplicates_and_unknown_rejected():
    ctrl = make()
    ctrl.request_work("g0", 4)
    ctrl.on_received(0, 0)
    assert ctrl.check_rollout("g0", 0, 0) == "duplicate"
    assert ctrl.check_rollout("g0", 99, 0) == "unknown_group"


def test_pop_batch_waits_for_group_that_would_become_too_stale():
    ctrl = make(max_staleness=1, groups_per_step=1, group_size=1)
    ctrl.request_work("g0", 100)  # groups 0 and 1 at version 0
    finish(ctrl, 1, version=0)
    batch = ctrl.pop_batch()  # step 0: group 0 still in flight but may be trained at version 1
    assert [g.group_id for g in batch] == [1]
    ctrl.on_trained(batch, 0)
    ctrl.on_new_version(1)
    ctrl.request_work("g0", 100)  # group 2 at version 1
    finish(ctrl, 2, version=1)
    # step 1 (version 1 -> 2): group 0 (version 0) must be in it, so wait for it
    assert ctrl.pop_batch() is None
    finish(ctrl, 0, version=0)
    batch = ctrl.pop_batch()
    assert [g.group_id for g in batch] == [0]  # stalest first
    ctrl.on_trained(batch, 1)
    assert ctrl.max_staleness_seen == 1


def test_stop_discards_everything_in_flight():
    ctrl = make(group_size=4, groups_per_step=2)
    ctrl.request_work("g0", 6)
    ctrl.on_received(0, 0)
    ctrl.on_scored(0, 0, FakeSample(0))
    ctrl.on_received(0, 1)
    ctrl.on_discard(0, 1, "reward_error")
    cancelled = ctrl.on_stop()
    assert sorted(cancelled) == [0, 1]
    assert ctrl.discarded == {"reward_error": 1, "run_ended": 5}
    ctrl.check_accounting()
    assert ctrl.request_work("g0", 4).exhausted


@pytest.mark.parametrize("num_prompts", [0, 3])
def test_exhausted_data(num_prompts):
    ctrl = make(num_prompts=num_prompts, group_size=1, groups_per_step=1, max_staleness=10)
    work = ctrl.request_work("g0", 100)
    if num_prompts == 0:
        assert work.exhausted and not work.items
    else:
        assert len(work.items) == 3
        assert ctrl.request_work("g0", 100).exhausted


def test_no_admission_beyond_the_run_and_empty_groups_replaced():
    ctrl = make(group_size=2, groups_per_step=2, max_staleness=3, total_steps=1)
    work = ctrl.request_work("g0", 100)
    assert len(work.items) == 2  # one step of 2 groups, although staleness would allow 8
    assert ctrl.request_work("g0", 100) is None  # parked: enough for the run unless a group ends empty
    ctrl.on_received(0, 0)
    ctrl.on_discard(0, 0, "bad_rollout")
    ctrl.on_received(0, 1)
    ctrl.on_discard(0, 1, "bad_rollout")  # group 0 ends with nothing to train: a replacement is admitted
    assert ctrl.request_work_possible()
    work = ctrl.request_work("g0", 100)
    assert [r.group_id for _, r, _ in work.items] == [2]
