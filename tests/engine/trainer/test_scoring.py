"""Scoring on the trainer: built-in functions, bad reward functions become counted discards."""

import math
import time
from types import SimpleNamespace

import pytest

from tailrace.engine.config import RewardConfig
from tailrace.engine.trainer.scoring import RewardDispatcher, ScoringFailed


def dispatcher(fn, mode="builtin"):
    return RewardDispatcher(RewardConfig(mode=mode), None, {"t": fn})


async def test_builtin_reward():
    d = dispatcher(lambda p, c, md: 0.25)
    assert await d.score("t", "p", "c", {}) == 0.25
    assert d.num_scored == {"server": 0, "builtin": 1}


@pytest.mark.parametrize("fn, reason", [
    (lambda p, c, md: 1 / 0, "reward_error"),
    (lambda p, c, md: math.nan, "reward_nan"),
    (lambda p, c, md: math.inf, "reward_nan"),
    (lambda p, c, md: "1.0", "reward_error"),
    (lambda p, c, md: True, "reward_error"),
])
async def test_bad_reward_functions_are_discards_with_reason(fn, reason):
    with pytest.raises(ScoringFailed) as info:
        await dispatcher(fn).score("t", "p", "c", {})
    assert info.value.reason == reason


async def test_unknown_task_and_servers_mode_without_server():
    with pytest.raises(ScoringFailed, match="no built-in function") as info:
        await dispatcher(lambda p, c, md: 1.0).score("other", "p", "c", {})
    assert info.value.reason == "no_reward_fn"
    d = RewardDispatcher(RewardConfig(mode="servers", wait_for_server_s=0.0), None, {"t": lambda p, c, md: 1.0})
    with pytest.raises(ScoringFailed, match="no reward server") as info:
        await d.score("t", "p", "c", {})
    assert info.value.reason == "no_reward_server"


class FlakyRouter:
    """A reward server for task "t" that leaves in the middle of the first request and comes back
    `back_after_s` later (a kill -9 and a restart), or never (back_after_s None)."""

    def __init__(self, back_after_s):
        self.back_after_s, self.gone_at, self.calls = back_after_s, None, 0

    def has_server(self, task):
        if self.gone_at is None:
            return True
        return self.back_after_s is not None and time.monotonic() - self.gone_at >= self.back_after_s

    async def score(self, task, prompt, completion, metadata, *, timeout_s, retries):
        from tailrace.protocol.reward_sdk import RewardUnavailable

        self.calls += 1
        if self.calls == 1:
            self.gone_at = time.monotonic()
            raise RewardUnavailable("reward server r0 died with the request in flight")
        return SimpleNamespace(reward=0.75, details={"exact": 1.0})


@pytest.mark.parametrize("mode", ["servers", "auto"])
async def test_a_server_leaving_mid_request_waits_for_its_replacement(mode):
    d = RewardDispatcher(RewardConfig(mode=mode, wait_for_server_s=5.0), FlakyRouter(back_after_s=0.3), {})
    started = time.monotonic()
    assert await d.score("t", "p", "c", {}) == 0.75  # not discarded at once: the restarted server scores it
    assert 0.3 <= time.monotonic() - started < 5.0 and d.num_scored["server"] == 1 and d.waiting["t"] == 0


async def test_no_server_back_within_the_wait_is_a_counted_discard():
    d = RewardDispatcher(RewardConfig(mode="servers", wait_for_server_s=0.4), FlakyRouter(back_after_s=None), {})
    started = time.monotonic()
    with pytest.raises(ScoringFailed, match="wait_for_server_s") as info:
        await d.score("t", "p", "c", {})
    assert info.value.reason == "no_reward_server" and time.monotonic() - started >= 0.4
