"""Streaming batcher with fake groups: group and token budgets, no waiting for slow groups, bounds."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.engine.samples import Group, TrainSample
from tailrace.engine.trainer.batcher import BatcherConfig, StreamingBatcher


def group(group_id, num_tokens):
    """A one-sample group of num_tokens logical tokens (1 prompt token)."""
    t = num_tokens - 1
    sample = TrainSample(group_id=group_id, sample_id=0, prompt_ids=[0], completion_ids=[1] * t,
                         behaviour_logprobs=[0.0] * t, policy_versions=[0] * t, reward=0.0)
    return Group(group_id=group_id, samples=[sample])


def ids(batch):
    return None if batch is None else [g.group_id for g in batch]


def test_groups_per_step():
    b = StreamingBatcher(BatcherConfig(groups_per_step=3))
    for i in range(2):
        b.add(group(i, 5))
        assert b.pop_batch() is None
    b.add(group(2, 5))
    b.add(group(3, 5))
    assert ids(b.pop_batch()) == [0, 1, 2]
    assert ids(b.pop_batch()) is None
    assert b.num_pending == 1 and b.pending_tokens == 5


def test_never_waits_for_a_slow_group():
    # Groups arrive in completion order; group 0 (the long tail) has not finished and is not waited for.
    b = StreamingBatcher(BatcherConfig(groups_per_step=2))
    for gid in (3, 1):
        b.add(group(gid, 4))
    assert ids(b.pop_batch()) == [3, 1]
    b.add(group(2, 4))
    b.add(group(0, 400))
    assert ids(b.pop_batch()) == [2, 0]


def test_token_budget():
    b = StreamingBatcher(BatcherConfig(groups_per_step=0, max_tokens_per_step=25))
    b.add(group(0, 10))
    b.add(group(1, 10))
    assert b.pop_batch() is None  # 20 < 25 and nothing says the batch is full yet
    b.add(group(2, 10))
    assert ids(b.pop_batch()) == [0, 1]  # the third would exceed the budget
    b.add(group(3, 15))
    assert ids(b.pop_batch()) == [2, 3]  # exactly at the budget
    b.add(group(4, 60))
    assert ids(b.pop_batch()) == [4]  # larger than the budget: alone, never stuck


def test_both_limits_whichever_first():
    b = StreamingBatcher(BatcherConfig(groups_per_step=3, max_tokens_per_step=100))
    for i in range(3):
        b.add(group(i, 10))
    assert ids(b.pop_batch()) == [0, 1, 2]
    b.add(group(3, 60))
    b.add(group(4, 50))
    assert ids(b.pop_batch()) == [3]


def test_bounded_and_flush():
    b = StreamingBatcher(BatcherConfig(groups_per_step=2, max_pending_groups=3))
    for i in range(3):
        b.add(group(i, 5))
    assert not b.has_room
    with pytest.raises(OverflowError):
        b.add(group(9, 5))
    assert ids(b.pop_batch()) == [0, 1]
    assert b.has_room
    assert ids(b.flush()) == [2]
    assert b.flush() is None and b.num_pending == 0 and b.pending_tokens == 0


def test_config_validation():
    with pytest.raises(ValueError, match="at least one"):
        BatcherConfig(groups_per_step=0, max_tokens_per_step=0)
    with pytest.raises(ValueError, match="max_pending_groups"):
        BatcherConfig(groups_per_step=8, max_pending_groups=4)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(2, 50), min_size=1, max_size=40),
    groups_per_step=st.integers(0, 5),
    max_tokens=st.sampled_from([0, 30, 64, 100]),
)
def test_every_group_once_in_order_within_limits(sizes, groups_per_step, max_tokens):
    if groups_per_step == 0 and max_tokens == 0:
        groups_per_step = 1
    b = StreamingBatcher(BatcherConfig(groups_per_step=groups_per_step, max_tokens_per_step=max_tokens,
                                       max_pending_groups=64))
    out = []
    for i, n in enumerate(sizes):
        b.add(group(i, n))
        while (batch := b.pop_batch()) is not None:
            out.append(batch)
    while (batch := b.flush()) is not None:
        out.append(batch)
    assert [g.group_id for batch in out for g in batch] == list(range(len(sizes)))
    for batch in out:
        assert not groups_per_step or len(batch) <= groups_per_step
        assert not max_tokens or len(batch) == 1 or sum(g.num_tokens for g in batch) <= max_tokens
