"""The scheduler rule, measured: groups committed to the open step as they complete (take_for_step) let the
trainer run their forward/backward while the step's slowest group is still generated, so it waits only for
that group's own share and the optimizer step. Discrete-event runs of the real Controller with fake
generators and trainer (tests/engine/trainer/sched_sim.py): the trainer's idle share, the staleness bound never
exceeded (in-flight samples counted), nothing trained twice. Run: pytest tests/engine/trainer/test_controller_schedule.py
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from sched_sim import Sample, Workload, simulate

from tailrace.engine.core.samples import PromptRecord
from tailrace.engine.trainer.controller import Controller

DEFAULT = Workload(steps=24)
# Lengths like the papers' (p99 / median well over 8), a policy three times as deep (costs x 3).
LONGTAIL = Workload(steps=24, length_median=5, length_sigma_prompt=1.1, max_new_tokens=256,
                    decode_s=(10e-3, 0.36e-3), train_s=(48e-3, 420e-6))


def _efficiency(w: Workload, max_staleness: int, incremental: bool) -> tuple[float, float]:
    """(stream over sync, that over the bound no schedule beats: sync / the busiest process), trainer idle."""
    sync = simulate(w, 0)
    r = simulate(w, max_staleness, incremental=incremental)
    bound = sync.seconds / max(r.trainer_busy_s, *r.generator_busy_s)
    return sync.seconds / r.seconds / bound, r.idle_trainer


@pytest.mark.parametrize("w,least", [(DEFAULT, 0.95), (LONGTAIL, 0.85)], ids=["default", "longtail"])
def test_committing_early_brings_the_trainer_near_the_bound(w, least):
    waited, idle_waited = _efficiency(w, 1, incremental=False)
    early, idle_early = _efficiency(w, 1, incremental=True)
    assert early >= least, (early, waited)
    assert early > waited + 0.05 and idle_early < 0.6 * idle_waited, (early, waited, idle_early, idle_waited)


@pytest.mark.parametrize("seed,max_staleness,w", list(itertools.product(
    range(3), (0, 1, 2), (DEFAULT, LONGTAIL, replace(DEFAULT, groups_per_step=3, group_size=5, num_generators=3)))))
def test_bound_holds_and_nothing_is_trained_twice(seed, max_staleness, w):
    w = replace(w, seed=seed, steps=10)
    r = simulate(w, max_staleness, incremental=True)
    assert r.staleness_ok and r.max_staleness_seen <= max_staleness
    trained = [g for batch in r.batches for g in batch]
    assert len(trained) == len(set(trained))
    assert all(len(batch) >= w.groups_per_step for batch in r.batches)
    r.controller.check_accounting()


def _prompts():
    for i in itertools.count():
        yield PromptRecord(i, [1, 2], f"p{i}", "t")


def _finish(ctl: Controller, group_id: int, version: int, group_size: int) -> None:
    for sid in range(group_size):
        ctl.on_received(group_id, sid)
        ctl.on_scored(group_id, sid, Sample(version, 4))


def test_complete_groups_are_committed_while_a_stale_group_is_in_flight():
    """gps 2, max_staleness 1: at version 1, group 0 (admitted at 0) must be in this step and is in flight;
    groups 2 and 3 complete. One is committed at once (the other slot is group 0's), none twice."""
    ctl = Controller(_prompts(), group_size=2, groups_per_step=2, max_staleness=1)
    ctl.request_work("g", 2)  # group 0, admitted at version 0
    ctl.on_new_version(1)
    ctl.request_work("g", 4)  # groups 1 and 2, admitted at version 1
    _finish(ctl, 1, 1, 2)
    _finish(ctl, 2, 1, 2)
    assert [g.group_id for g in ctl.take_for_step()] == [1]  # group 0's slot is kept
    assert ctl.take_for_step() == [] and ctl.close_step() is None  # group 0 still in flight: wait
    _finish(ctl, 0, 0, 2)
    assert [g.group_id for g in ctl.take_for_step()] == [0]
    batch = ctl.close_step()
    assert sorted(g.group_id for g in batch) == [0, 1]
    assert [g.group_id for g in ctl.complete] == [2]
    ctl.on_trained(batch, 1)
    assert ctl.max_staleness_seen == 1
    ctl.check_accounting()


def test_a_step_with_a_forced_group_still_waits_for_a_full_batch():
    """gps 2, max_staleness 1, three prompts: at version 1 the stale group 0 completes and is forced into the
    step. Groups 1 and 2 (admitted at version 1) are in flight: the step waits for one of them rather than
    train one group. At version 2 the last group alone closes its step once the data is known to be out."""
    ctl = Controller(iter(list(itertools.islice(_prompts(), 3))), group_size=2, groups_per_step=2, max_staleness=1)
    ctl.request_work("g", 2)  # group 0, admitted at version 0
    ctl.on_new_version(1)
    ctl.request_work("g", 4)  # groups 1 and 2, admitted at version 1
    _finish(ctl, 0, 0, 2)
    assert [g.group_id for g in ctl.take_for_step()] == [0]
    assert ctl.close_step() is None  # one group of two, and more are coming
    _finish(ctl, 1, 1, 2)
    batch = ctl.pop_batch()
    assert sorted(g.group_id for g in batch) == [0, 1]
    ctl.on_trained(batch, 1)
    ctl.on_new_version(2)
    _finish(ctl, 2, 1, 2)
    assert ctl.pop_batch() is None  # a fourth prompt could still be admitted
    assert ctl.request_work("g", 2).exhausted  # it cannot: the data ran out
    batch = ctl.pop_batch()
    assert [g.group_id for g in batch] == [2]
    ctl.on_trained(batch, 2)
    ctl.check_accounting()
