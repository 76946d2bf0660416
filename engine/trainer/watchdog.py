"""The trainer's watchdog: leases that run out are reclaimed, and a train loop that waits says why.

    every second   controller.expire_leases(now): samples held past their lease are re-queued for
                   another generator ("lease_expired"); their late results are dropped
    after controller.stall_warn_s of waiting for a batch with no sign of life (no peer joined, no
                   rollout came in, no step trained)
                   diagnose() names what blocks progress, most specific first: completions waiting for a
                   reward server of a task, no generator connected (or, when trainer.expected_generators
                   are being started, as by `tailrace run`: still waiting for them), no environment server
                   for multi-turn episodes (env.max_turns > 1), samples held by a
                   generator (and when its lease ends), every generator parked; said on the log, as Event "stall" on the
                   notice socket (`tailrace run` prints it under its bar), and again every STALL_REPEAT_S
                   while it lasts; Event "stall_over" when training resumes.

`diagnose` is pure (tested with fakes); `watch` is the loop the trainer service runs.
Test: pytest tests/engine/trainer/test_watchdog.py
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tailrace.engine.config import RunConfig
    from tailrace.engine.trainer.controller import Controller
    from tailrace.engine.trainer.scoring import RewardDispatcher
    from tailrace.protocol import messages as m
    from tailrace.protocol.transport import Server

log = logging.getLogger("tailrace.trainer")

STALL_REPEAT_S = 15.0  # a stall that goes on is said again this often
STARTUP_GRACE_S = 30.0  # "no generator connected" is said only this long after the trainer started


@dataclass(frozen=True)
class Situation:
    """What the watchdog sees of the trainer when it has waited for a batch."""

    waiting_s: float
    reward_waiting: dict[str, int]  # task -> completions waiting for a reward server
    wait_for_server_s: float
    generators: list[str]  # connected generator names
    expected_generators: int  # generators being started for this trainer (trainer.expected_generators); 0 = unknown
    parked: int  # generators whose work request is parked
    held: dict[str, int]  # generator -> samples it holds (handed out, result not in)
    next_lease: tuple[float, str] | None  # (seconds left, generator) of the lease that ends first
    groups_in_flight: int
    groups_complete: int
    groups_per_step: int
    scoring: int  # completions being scored
    episodes: bool = False  # multi-turn episodes (env.max_turns > 1): generators need an environment server
    env_servers: int = 0  # environment servers attached (role "env")
    env_wait_for_server_s: float = 0.0


def diagnose(s: Situation) -> str:
    """One line that says what the trainer waits for."""
    waiting = f"no progress for {s.waiting_s:.0f} s"
    tasks = {task: n for task, n in s.reward_waiting.items() if n > 0}
    if tasks:
        named = ", ".join(f"{task!r} ({n} completions)" for task, n in sorted(tasks.items()))
        return (f"{waiting}: no reward server attached for task {named}; they are discarded as "
                f"no_reward_server after reward.wait_for_server_s = {s.wait_for_server_s:g} s "
                f"(attach one: tailrace reward --connect ADDR --fn module:function --tasks TASK)")
    if not s.generators and s.expected_generators:
        return (f"{waiting}: waiting for {s.expected_generators} generator{'s' if s.expected_generators > 1 else ''} "
                f"to connect (none yet; each loads the model first, and its log says how far it got)")
    if not s.generators:
        return f"{waiting}: no generator connected (start one: tailrace generator --connect ADDR)"
    if s.episodes and not s.env_servers and s.generators:
        return (f"{waiting}: no environment server attached; multi-turn episodes (env.max_turns > 1) end as "
                f"no_env_server after env.wait_for_server_s = {s.env_wait_for_server_s:g} s "
                f"(attach one: tailrace env module:Class --connect ADDR)")
    if s.held:
        holders = ", ".join(f"{name} holds {n}" for name, n in sorted(s.held.items()))
        lease = ""
        if s.next_lease is not None:
            left_s, peer = s.next_lease
            lease = f"; the first lease ({peer}) ends in {max(0.0, left_s):.0f} s, then its samples go elsewhere"
        return f"{waiting}: waiting for samples in flight ({holders}){lease}"
    if s.scoring:
        return f"{waiting}: {s.scoring} completions being scored by reward servers"
    if s.parked == len(s.generators):
        return (f"{waiting}: every generator is parked ({s.groups_in_flight} groups in flight, "
                f"{s.groups_complete}/{s.groups_per_step} complete for the step)")
    return (f"{waiting}: {s.groups_in_flight} groups in flight, {s.groups_complete}/{s.groups_per_step} "
            f"complete for the step")


class WatchedService(Protocol):
    """What the watchdog uses of the trainer service (TrainerService satisfies it:
    tests/engine/trainer/test_collaborators.py)."""

    cfg: RunConfig
    controller: Controller
    server: Server
    rewards: RewardDispatcher | None  # None until the service serves
    counters: collections.Counter[str]
    parked: dict[bytes, int]  # generator peer id -> capacity of its parked WorkRequest
    scoring: set[asyncio.Task]  # completions being scored
    changed: asyncio.Event  # set to wake the train loop
    started_s: float
    waiting_since_s: float | None  # when the train loop began waiting for a batch; None: not waiting
    progress_s: float  # last sign of life
    stop_requested: bool

    async def serve_parked(self) -> None: ...

    def event(self, name: str, text: str, **fields: Any) -> m.Event: ...


def situation(service: WatchedService, now: float) -> Situation:
    ctrl = service.controller
    held: collections.Counter[str] = collections.Counter()
    for group in ctrl.groups.values():
        for sid in group.leases:
            held[group.assigned[sid]] += 1
    next_lease = ctrl.next_lease_end()
    generators = [p.name for p in service.server.peers.values() if p.role == "generator"]
    env_servers = sum(p.role == "env" for p in service.server.peers.values())
    return Situation(
        waiting_s=now - max(service.waiting_since_s or now, service.progress_s),
        reward_waiting=dict(service.rewards.waiting) if service.rewards else {},
        wait_for_server_s=service.cfg.reward.wait_for_server_s, generators=generators,
        expected_generators=service.cfg.trainer.expected_generators,
        parked=len(service.parked), held=dict(held),
        next_lease=(next_lease[0] - now, next_lease[1]) if next_lease else None,
        groups_in_flight=len(ctrl.groups), groups_complete=len(ctrl.complete) + len(ctrl.step_groups),
        groups_per_step=ctrl.groups_per_step, scoring=len(service.scoring),
        episodes=service.cfg.env.max_turns > 1, env_servers=env_servers,
        env_wait_for_server_s=service.cfg.env.wait_for_server_s)


async def watch(service: WatchedService, interval_s: float = 1.0) -> None:
    """Reclaim expired leases and say stalls, until cancelled."""
    said, said_at = "", 0.0
    while True:
        await asyncio.sleep(interval_s)
        now = time.monotonic()
        reclaimed = service.controller.expire_leases(now)
        for peer, count in reclaimed.items():
            text = f"generator {peer} held {count} samples past their lease: re-dispatched"
            log.warning(text)
            service.counters["trainer/leases/expired"] += count
            await service.server.publish(service.event("lease_expired", text, peer=peer, samples=count))
        if reclaimed:
            await service.serve_parked()
            service.changed.set()
        waiting_since = service.waiting_since_s
        if waiting_since is None or service.stop_requested:
            if said:
                await service.server.publish(service.event("stall_over", "training resumed"))
                said = ""
            continue
        # A stall is waiting with no sign of life: rollouts still streaming in are progress, not a stall.
        if now - max(waiting_since, service.progress_s) < service.cfg.controller.stall_warn_s:
            continue
        seen = situation(service, now)
        if not seen.generators and now - service.started_s < STARTUP_GRACE_S:
            continue  # generators load their model first; an empty room this early is not yet a stall
        text = diagnose(seen)
        cause = text.split(": ", 1)[-1]
        if cause.split(" (")[0] != said.split(" (")[0] or now - said_at >= STALL_REPEAT_S:
            log.warning("stalled: %s", text)
            service.counters["trainer/stalls/said"] += 1
            await service.server.publish(service.event("stall", text))
            said, said_at = cause, now
