"""Scoring completions on the trainer: attached reward servers for the tasks they register, built-in
reward functions (engine/data/tasks.py) for the rest.

    reward.mode = "auto":    a server that scores the task if one is attached, else the built-in function
    reward.mode = "servers": only servers
    reward.mode = "builtin": only built-in functions
    reward.functions set:    only servers (the one that serves their weighted sum), whatever reward.mode
A completion only a server can score waits up to reward.wait_for_server_s for one, also when its server
leaves mid-request (a restarted server takes over); `waiting` counts them per task for the watchdog.

A reward function or server may return a dict, {"reward": r, "exact": e}: score_with_details gives its
other entries too, which the trainer logs per step (trainer/reward/details/<key>, mean and count).

A completion that cannot be scored raises ScoringFailed with the reason the controller counts it
under (reward_error, reward_timeout, reward_nan, no_reward_server, no_reward_fn). Test: pytest tests/engine/trainer/test_scoring.py
"""

from __future__ import annotations

import asyncio
import collections
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from tailrace.engine.config import RewardConfig
from tailrace.engine.core import report
from tailrace.engine.data.tasks import REWARD_FNS  # pure Python


class ScoringFailed(Exception):
    def __init__(self, reason: str, text: str):
        super().__init__(f"{reason}: {text}")
        self.reason = reason
        self.text = text


class ServerGone(Exception):
    """No attached server could take the request (the last one left, or left mid-request)."""


class RewardDispatcher:
    """`router` is the trainer-side client of reward servers (protocol.reward.RewardRouter) or None."""

    def __init__(self, cfg: RewardConfig, router: Any = None,
                 builtin: dict[str, Callable[..., float]] | None = None):
        self.cfg = cfg
        self.router = router
        if builtin is None:
            from tailrace.engine.data.tasks import REWARD_FNS

            builtin = REWARD_FNS
        # reward.functions run on a reward server: a built-in function scoring a task before that server
        # attaches would mix two different rewards in one run
        self.builtin = builtin if cfg.mode != "servers" and not cfg.functions else {}
        self.num_scored = {"server": 0, "builtin": 0}
        self.waiting: collections.Counter[str] = collections.Counter()  # task -> completions waiting for a server

    def _has_server(self, task: str) -> bool:
        return self.router is not None and self.router.has_server(task)

    async def score(self, task: str, prompt: str, completion: str, metadata: dict[str, Any]) -> float:
        return (await self.score_with_details(task, prompt, completion, metadata))[0]

    async def score_with_details(self, task: str, prompt: str, completion: str,
                                 metadata: dict[str, Any]) -> tuple[float, dict[str, float]]:
        """(reward, the other named numbers the function returned)."""
        if self.cfg.mode != "builtin" and (self.cfg.mode == "servers" or task not in self.builtin):
            return await self._score_waiting(task, prompt, completion, metadata)
        if self.cfg.mode == "auto" and self._has_server(task):
            try:
                reward = await self._score_remote(task, prompt, completion, metadata)
            except ServerGone:
                pass  # the server left mid-request: the built-in function scores it instead
            else:
                self.num_scored["server"] += 1
                return reward
        return self._score_builtin(task, prompt, completion, metadata)

    async def _score_waiting(self, task: str, prompt: str, completion: str,
                             metadata: dict[str, Any]) -> tuple[float, dict[str, float]]:
        """Only a server can score `task`: wait up to reward.wait_for_server_s for one, also when the
        server scoring it goes away mid-request (a restarted server takes over), then give up."""
        wait_s = self.cfg.wait_for_server_s
        deadline = time.monotonic() + wait_s
        self.waiting[task] += 1
        try:
            while True:
                if self._has_server(task):
                    try:
                        reward = await self._score_remote(task, prompt, completion, metadata)
                    except ServerGone:
                        pass
                    else:
                        self.num_scored["server"] += 1
                        return reward
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(0.05)
        finally:
            self.waiting[task] -= 1
        raise ScoringFailed("no_reward_server", f"task {task!r}: no reward server scored it within "
                                                f"reward.wait_for_server_s = {wait_s:g} s")

    def _score_builtin(self, task: str, prompt: str, completion: str,
                       metadata: dict[str, Any]) -> tuple[float, dict[str, float]]:
        fn = self.builtin.get(task)
        if fn is None:
            where = "no reward server scores it" if self.cfg.mode != "builtin" else "no built-in function"
            raise ScoringFailed("no_reward_fn", f"task {task!r}: {where}")
        try:
            reward = fn(prompt, completion, metadata)
        except Exception as exc:  # a user-visible reward bug must not stop the run
            raise ScoringFailed("reward_error", f"{type(exc).__name__}: {exc}") from exc
        reward = _check_reward(reward)
        self.num_scored["builtin"] += 1
        return reward

    async def _score_remote(self, task: str, prompt: str, completion: str,
                            metadata: dict[str, Any]) -> tuple[float, dict[str, float]]:
        from tailrace.protocol.reward_sdk import RewardUnavailable, ScoreFailed

        try:
            score = await self.router.score(task, prompt, completion, metadata, timeout_s=self.cfg.timeout_s,
                                            retries=self.cfg.retries)
        except ScoreFailed as exc:
            raise ScoringFailed("reward_timeout" if exc.code == 504 else "reward_error", str(exc)) from exc
        except RewardUnavailable as exc:
            raise ServerGone(str(exc)) from exc
        return _check_reward(score.reward)[0], dict(score.details)


def reward_detail_metrics(groups: list[Any]) -> dict[str, float]:
    """trainer/reward/details/<key> (mean) and <key>_count over the samples of a step whose reward
    function returned that key."""
    values: dict[str, list[float]] = collections.defaultdict(list)
    for sample in (s for g in groups for s in g.samples):
        for key, value in sample.reward_details.items():
            values[key].append(value)
    out: dict[str, float] = {}
    for key, vs in sorted(values.items()):
        out[f"trainer/reward/details/{key}"] = statistics.fmean(vs)
        out[f"trainer/reward/details/{key}_count"] = len(vs)
    return out


def _check_reward(reward: Any) -> tuple[float, dict[str, float]]:
    """(reward, details) of a built-in function's float or {"reward": r, ...} dict, checked as a reward
    server checks its function's (protocol/reward_sdk.py to_reply)."""
    details: dict[str, float] = {}
    if isinstance(reward, dict):
        from tailrace.protocol.messages import ScoreError
        from tailrace.protocol.reward_sdk import to_reply

        reply = to_reply(0, {**reward, "reward": 0.0} if "reward" in reward else reward)  # checks the details
        if isinstance(reply, ScoreError):
            raise ScoringFailed("reward_error", reply.text)
        reward, details = reward["reward"], reply.details
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise ScoringFailed("reward_error", f"reward must be a number, got {type(reward).__name__}")
    if not math.isfinite(reward):
        raise ScoringFailed("reward_nan", f"reward is {reward}")
    return float(reward), details


def reward_line(cfg: Any, address: str, *, curve: bool = False) -> str:
    """What scores a trainer's completions of data.task (cfg: a RunConfig), for its start-up log line."""
    reward, task = cfg.reward, cfg.data.task
    if reward.mode == "builtin":
        return f"rewards: the built-in function of task {task!r}"
    if reward.functions:
        return (f"rewards: reward.functions, on the reward server that serves them (tailrace run starts it; "
                f"else: tailrace reward --connect {address} --config FILE)")
    if reward.mode == "auto" and task in REWARD_FNS:
        return f"rewards: the built-in function of task {task!r}, or a reward server attached for it"
    return (f"rewards: reward servers only for task {task!r}; unless one is started for it, attach a reward "
            f"server with: {report.attach_line(address, task, curve=curve)}")
