"""The trainer's publication of a new policy version after each step: a CPU copy of the weights (gathered
across ranks) into the weights store, a WeightsNotice to every generator and on the notice socket, then
the parked work requests the new version may answer. Generators in the weights broadcast group
(trainer/broadcaster.py) get the version from the broadcaster's own task, which nothing here awaits.

On one rank the publication runs as a task beside the next step's early forward/backward (early.py),
which only reads the weights: the controller moves to the new version at once, so work admitted meanwhile
names it and a generator starts that work once the version reached it. Whatever changes the weights or
needs them served (the next optimizer step, evaluation, a checkpoint, the end of the run) first awaits
published(). With several ranks every rank joins the gather, in the order of rank 0's calls, so nothing
overlaps it. Test: tests/engine/trainer/test_trainer_service.py
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from tailrace.engine.trainer import dist

if TYPE_CHECKING:
    from tailrace.engine.core.weights import WeightsStore
    from tailrace.engine.trainer.broadcaster import Broadcaster
    from tailrace.engine.trainer.controller import Controller
    from tailrace.engine.trainer.learner import Learner
    from tailrace.protocol.telemetry import SpanBuffer
    from tailrace.protocol.transport import Server


class PublishService(Protocol):
    """What the publication uses of the trainer service (TrainerService satisfies it:
    tests/engine/trainer/test_collaborators.py)."""

    learner: Learner
    controller: Controller
    store: WeightsStore
    server: Server
    spans: SpanBuffer
    publishing: asyncio.Task | None  # the background publication of the newest version
    broadcaster: Broadcaster | None  # weights by broadcast to the generators that joined, or None

    async def serve_parked(self) -> None: ...

    def spawn(self, coro: Any, name: str) -> asyncio.Task: ...  # a task whose error stops the run


async def begin(service: PublishService) -> None:
    """Publish the learner's version: started in the background on one rank, awaited on several."""
    if dist.world_size() == 1:
        service.controller.on_new_version(service.learner.policy_version)
        service.publishing = service.spawn(publish(service, track="weights"), "publish")  # an error stops the run
    else:
        await publish(service)


async def published(service: PublishService) -> None:
    """Wait for the background publication of the newest version, if one is under way (its errors raise
    here)."""
    if service.publishing is not None:
        task, service.publishing = service.publishing, None
        await task


async def publish(service: PublishService, track: str = "main") -> None:
    version = service.learner.policy_version
    with service.spans.span("weights_gather", track=track):
        weights = await asyncio.to_thread(service.learner.state_dict_for_broadcast)  # gathered across ranks
    notice = service.store.publish("policy", version, weights)
    service.controller.on_new_version(version)
    broadcaster = service.broadcaster
    for peer in list(service.server.peers.values()):
        if peer.role == "generator" and (broadcaster is None or not broadcaster.can_join(peer)):
            await service.server.send(peer.id, notice)  # by chunks; the others get it by broadcast
    if broadcaster is not None:
        broadcaster.offer(version, weights, notice)  # sent by its own task, never awaited here
    await service.server.publish(notice)
    await service.serve_parked()
