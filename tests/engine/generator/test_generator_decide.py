"""The generator's pure decision function: shutdown first, then new weights, then admitting work,
then asking for work, then decoding."""

import collections
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tailrace.engine.generator.service import Action, GenState, background_priority, decide
from tailrace.protocol.messages import WorkItem


def item(version=0, n=4):
    return WorkItem(group_id=1, prompt_token_ids=[1, 2], num_samples=n, min_policy_version=version)


def state(**kw):
    s = GenState(capacity=8)
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def test_priority_order():
    full = dict(shutdown="bye", ready_weights=(1, {}), pending_items=collections.deque([item()]), num_running=2)
    assert decide(state(**full)) is Action.SHUTDOWN
    full.pop("shutdown")
    assert decide(state(**full)) is Action.SWAP_WEIGHTS
    full.pop("ready_weights")
    assert decide(state(**full)) is Action.ADMIT
    full.pop("pending_items")
    assert decide(state(**full)) is Action.REQUEST_WORK
    assert decide(state(num_running=2, request_outstanding=True)) is Action.DECODE
    assert decide(state(request_outstanding=True)) is Action.WAIT
    assert decide(state(exhausted=True)) is Action.WAIT


def test_work_waits_for_required_weights():
    s = state(pending_items=collections.deque([item(version=3)]), policy_version=2, request_outstanding=True)
    assert decide(s) is Action.WAIT  # nothing may be sampled with weights older than version 3
    s.policy_version = 3
    assert decide(s) is Action.ADMIT


def test_finish_running_first_mode():
    s = state(ready_weights=(2, {}), num_running=3, in_flight_update=False, request_outstanding=True,
              pending_items=collections.deque([item()]))
    assert decide(s) is Action.DECODE  # running sequences finish on the old weights, nothing new joins
    s.num_running = 0
    assert decide(s) is Action.SWAP_WEIGHTS


def test_no_request_beyond_capacity():
    s = state(capacity=4, pending_items=collections.deque([item(version=5, n=4)]), policy_version=0)
    assert decide(s) is Action.WAIT  # pending samples already fill the free capacity


def test_idle_generator_trains_the_drafter_and_work_comes_first():
    assert decide(state(request_outstanding=True, drafter_has_data=True)) is Action.TRAIN_DRAFTER
    assert decide(state(request_outstanding=True, drafter_has_data=False)) is Action.WAIT
    assert decide(state(num_running=1, request_outstanding=True, drafter_has_data=True)) is Action.DECODE
    busy = state(drafter_has_data=True, pending_items=collections.deque([item()]))
    assert decide(busy) is Action.ADMIT


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
def test_drafter_training_thread_runs_at_background_priority():
    # The generator trains its drafter in a thread made by this initializer: nice 19 there, the
    # process's other threads (decoding, the event loop) untouched.
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with ThreadPoolExecutor(1, initializer=background_priority) as pool:
        niceness = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()
    assert niceness == 19 and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main
