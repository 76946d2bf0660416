"""Scoring on the trainer: built-in functions, bad reward functions become counted discards."""

import math

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
    with pytest.raises(ScoringFailed, match="no reward server"):
        await d.score("t", "p", "c", {})
