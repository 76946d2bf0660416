"""torch.distributed helpers for the trainer: world size 1 without initialising anything, torchrun when present.

The learner is written against these helpers so that multi-device training is configuration, not a
rewrite: every rank gets the whole step's batch (rank 0 receives it from the protocol and broadcasts
it), trains its shard with the step-wide loss normaliser, and gradients are summed across ranks. At world
size 1 every collective is a no-op. Tested at world size 1 through tests/engine/test_learner.py.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as tdist

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def init_from_env(backend: str | None = None) -> DistInfo:
    """Join the process group that torchrun describes in the environment; world size 1 otherwise.

    Only WORLD_SIZE > 1 initialises anything, so a plain `python` run never needs a rendezvous.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not tdist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        tdist.init_process_group(backend=backend)
    return DistInfo(rank=tdist.get_rank(), world_size=tdist.get_world_size(), local_rank=local_rank)


def is_initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def world_size() -> int:
    return tdist.get_world_size() if is_initialized() else 1


def rank() -> int:
    return tdist.get_rank() if is_initialized() else 0


def is_rank0() -> bool:
    return rank() == 0


def barrier() -> None:
    if world_size() > 1:
        tdist.barrier()


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum across ranks; returns the tensor."""
    if world_size() > 1:
        tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM)
    return tensor


def all_reduce_grads_(parameters: Sequence[torch.nn.Parameter]) -> None:
    """Sum gradients across ranks (each rank's loss already carries the step-wide normaliser, so the sum
    is the full-batch gradient; averaging would divide it by the world size)."""
    if world_size() == 1:
        return
    for p in parameters:
        if p.grad is None:  # a rank with an empty shard (or an unused parameter) still joins the sum
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in parameters]
    # One flat buffer keeps this to a single collective per step.
    flat = torch.cat([g.reshape(-1) for g in grads])
    tdist.all_reduce(flat, op=tdist.ReduceOp.SUM)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def all_reduce_stats_(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sum a dict of scalar statistics across ranks (keys must match on every rank)."""
    if world_size() == 1:
        return stats
    keys = sorted(stats)
    flat = torch.stack([stats[k].to(torch.float64).reshape(()) for k in keys])
    if tdist.get_backend() == "nccl":
        flat = flat.cuda()
    tdist.all_reduce(flat, op=tdist.ReduceOp.SUM)
    return {k: v.cpu() for k, v in zip(keys, flat.unbind(0), strict=True)}


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank src's object on every rank (trainer-internal data only: this pickles, never use it on
    anything that came from the network before it was validated and rebuilt)."""
    if world_size() == 1:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


def shard(items: Sequence[T], cost: Callable[[T], int], rank_: int, world_size_: int) -> list[T]:
    """This rank's share of items, balanced by cost: longest first onto the least loaded rank.

    Deterministic (ties broken by index) so every rank computes the same assignment without talking.
    Keeps the original order within a shard.
    """
    if world_size_ == 1:
        return list(items)
    loads = [0] * world_size_
    owner = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: (-cost(items[i]), i)):
        r = min(range(world_size_), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += cost(items[i])
    return [item for i, item in enumerate(items) if owner[i] == rank_]
