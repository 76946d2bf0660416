"""Several reward functions as one, like TRL's reward_funcs: reward.functions lists entries
{fn = "module:function", weight, name, tasks}; `combine` gives one score function whose reward is the
weighted sum of the entries that score the completion's task, and whose other entries are each function's
own value under its name (the trainer logs them per step as trainer/reward/details/<name>, mean and count;
a function's own details follow as <name>/<key>). A function that raises, or returns something that is not
a finite number (or a {"reward": r} dict of them), makes the whole score fail with its name in the
message: the reward server answers ScoreError and the trainer discards the sample (reward_error).

`tailrace reward --config FILE` (and `tailrace run`, which starts it) serves them. Sync functions run
one after another in the SDK's thread; with an async one among them all run concurrently, sync ones in
threads. Test: pytest tests/engine/core/test_reward_fns.py
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailrace.engine.config import RewardFunctionConfig


def load_function(spec: str, setting: str = "--fn") -> Callable[..., Any]:
    """The callable `module:function`, imported with the working directory on sys.path."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{setting} {spec!r}: expected module:function, e.g. tailrace.engine.data.tasks:score")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # user modules next to where they run the command
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{setting} {spec!r}: cannot import {module_name}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"{setting} {spec!r}: {module_name} has no function {attr!r}")
    return fn


def _is_async(fn: Any) -> bool:
    call = type(fn).__call__ if not inspect.isroutine(fn) else None  # callable objects
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


@dataclass(frozen=True)
class Component:
    key: str
    spec: str
    fn: Callable[..., Any]
    weight: float
    tasks: tuple[str, ...]  # ("*",) = every task

    def scores(self, task: Any) -> bool:
        return "*" in self.tasks or task in self.tasks


def components(entries: Sequence[RewardFunctionConfig]) -> list[Component]:
    out = []
    for entry in entries:
        fn = load_function(entry.fn, "reward.functions:")
        tasks = tuple(entry.tasks) or tuple(getattr(fn, "tasks", ())) or ("*",)
        out.append(Component(entry.key, entry.fn, fn, entry.weight, tasks))
    return out


def registered_tasks(parts: Sequence[Component]) -> tuple[str, ...]:
    """What a reward server serving `parts` registers: every task one of them scores."""
    if any("*" in p.tasks for p in parts):
        return ("*",)
    return tuple(dict.fromkeys(t for p in parts for t in p.tasks))


class RewardFunctionFailed(Exception):
    """One of reward.functions raised or returned a bad value; the message names it."""

    def __init__(self, part: Component, text: str):
        super().__init__(f"reward function {part.key} ({part.spec}): {text}")


def _call(part: Component, prompt: str, completion: str, metadata: dict[str, Any]) -> Any:
    try:
        return part.fn(prompt, completion, dict(metadata))
    except Exception as exc:  # the SDK turns it into a ScoreError: the sample is discarded, not the run
        raise RewardFunctionFailed(part, f"{type(exc).__name__}: {exc}") from exc


async def _call_async(part: Component, prompt: str, completion: str, metadata: dict[str, Any]) -> Any:
    if not _is_async(part.fn):
        return await asyncio.to_thread(_call, part, prompt, completion, metadata)
    try:
        return await part.fn(prompt, completion, dict(metadata))
    except Exception as exc:
        raise RewardFunctionFailed(part, f"{type(exc).__name__}: {exc}") from exc


def _value(part: Component, value: Any) -> tuple[float, dict[str, float]]:
    """A function's reward and details, checked as a reward server checks a return value."""
    from tailrace.protocol.messages import ScoreError
    from tailrace.protocol.reward_sdk import to_reply

    reply = to_reply(0, value)
    if isinstance(reply, ScoreError):
        raise RewardFunctionFailed(part, reply.text)
    return reply.reward, reply.details


def _sum(parts: Sequence[Component], values: Sequence[Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    total = 0.0
    for part, value in zip(parts, values, strict=True):
        reward, details = _value(part, value)
        total += part.weight * reward
        out[part.key] = reward
        out.update({f"{part.key}/{k}": v for k, v in details.items()})
    return {"reward": total, **out}


def combine(parts: Sequence[Component]) -> Callable[..., Any]:
    """One score(prompt, completion, metadata) -> {"reward": weighted sum, <name>: value, ...}."""
    if not parts:
        raise ValueError("reward.functions: empty")

    def scoring(metadata: dict[str, Any]) -> list[Component]:
        task = metadata.get("task")
        chosen = [p for p in parts if p.scores(task)]
        if not chosen:
            raise ValueError(f"no entry of reward.functions scores task {task!r}")
        return chosen

    if not any(_is_async(p.fn) for p in parts):
        def score(prompt: str, completion: str, metadata: dict[str, Any]) -> dict[str, float]:
            chosen = scoring(metadata)
            return _sum(chosen, [_call(p, prompt, completion, metadata) for p in chosen])
    else:
        async def score(prompt: str, completion: str, metadata: dict[str, Any]) -> dict[str, float]:
            chosen = scoring(metadata)
            values = await asyncio.gather(*(_call_async(p, prompt, completion, metadata) for p in chosen))
            return _sum(chosen, values)

    score.tasks = registered_tasks(parts)
    return score
