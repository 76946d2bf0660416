"""Rank 0 leads, the other trainer ranks follow: every collective happens in the same order on all of them.

    rank 0 (TrainerService)              ranks 1..N-1 (follow)
    Leader.step(groups)       --STEP-->  receive batch tensors -> learner.step
    Leader.state_dict_for_broadcast()    --WEIGHTS--> gather_full_state_dict (rank 0 keeps the result)
    checkpoint.save(root, Leader)        --CHECKPOINT--> checkpoint.save(root, learner) (DCP shards, RNG)
    Leader.close()            --STOP-->  return

Commands and batches travel on dist.command_group() (gloo, no deadline: followers wait there as long as
rank 0 waits for rollouts); a step's FSDP collectives run on the default group, whose timeout turns a
dead or stuck rank into an error. A batch crosses as tensors (ids, log-probs, versions, loss masks,
per-sample numbers), never pickled: it came from the network. Test: pytest tests/engine/trainer/test_dist.py
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from tailrace.engine.core.samples import Group, TrainSample
from tailrace.engine.trainer import dist

log = logging.getLogger("tailrace.trainer")
_HEADER = 6  # kind, samples, token ids, completion tokens, argument, path bytes


class Command(enum.IntEnum):
    STEP = 1
    WEIGHTS = 2
    CHECKPOINT = 3
    STOP = 4


def _bcast(tensor: torch.Tensor) -> torch.Tensor:
    tdist.broadcast(tensor, src=0, group=dist.command_group())
    return tensor


def encode_batch(groups: Sequence[Group]) -> list[torch.Tensor]:
    """The tensors of a batch: per sample (group, sample, prompt length, completion length) and (reward,
    advantage, temperature); all token ids; completion versions, behaviour log-probs and loss masks (uint8,
    1 where the sample has no mask)."""
    samples = [s for g in groups for s in g.samples]
    ints = torch.tensor([[s.group_id, s.sample_id, s.num_prompt_tokens, s.num_completion_tokens] for s in samples],
                        dtype=torch.int64)
    floats = torch.tensor([[s.reward, s.advantage, s.temperature] for s in samples], dtype=torch.float64)
    ids = torch.cat([t for s in samples for t in (s.prompt_ids, s.completion_ids)])
    versions = torch.cat([s.policy_versions for s in samples])
    logprobs = torch.cat([s.behaviour_logprobs for s in samples])
    masks = torch.cat([torch.ones(s.num_completion_tokens, dtype=torch.uint8) if s.loss_mask is None
                       else s.loss_mask.to(torch.uint8) for s in samples])
    return [ints, floats, ids, versions, logprobs, masks]


def decode_batch(ints: torch.Tensor, floats: torch.Tensor, ids: torch.Tensor, versions: torch.Tensor,
                 logprobs: torch.Tensor, masks: torch.Tensor) -> list[Group]:
    groups: dict[int, list[TrainSample]] = {}
    at_id = at_t = 0
    for (gid, sid, p, t), (reward, advantage, temperature) in zip(ints.tolist(), floats.tolist(), strict=True):
        mask = masks[at_t:at_t + t].to(torch.bool)
        groups.setdefault(gid, []).append(TrainSample(
            group_id=gid, sample_id=sid, prompt_ids=ids[at_id:at_id + p], completion_ids=ids[at_id + p:at_id + p + t],
            behaviour_logprobs=logprobs[at_t:at_t + t], policy_versions=versions[at_t:at_t + t],
            reward=reward, advantage=advantage, temperature=temperature,
            loss_mask=None if bool(mask.all()) else mask))
        at_id, at_t = at_id + p + t, at_t + t
    return [Group(group_id=gid, samples=samples) for gid, samples in groups.items()]


def _announce(kind: Command, *, batch: list[torch.Tensor] | None = None, arg: int = 0, path: str = "") -> None:
    raw = torch.frombuffer(bytearray(path.encode()), dtype=torch.uint8) if path else torch.empty(0, dtype=torch.uint8)
    sizes = [batch[0].shape[0], batch[2].numel(), batch[3].numel()] if batch else [0, 0, 0]
    _bcast(torch.tensor([int(kind), *sizes, arg, raw.numel()], dtype=torch.int64))
    for tensor in batch or ():
        _bcast(tensor.contiguous())
    if raw.numel():
        _bcast(raw)


def _receive() -> tuple[Command, list[torch.Tensor], int, str]:
    kind, n, n_ids, n_t, arg, n_path = _bcast(torch.zeros(_HEADER, dtype=torch.int64)).tolist()
    batch: list[torch.Tensor] = []
    if kind == Command.STEP:
        shapes = [((n, 4), torch.int64), ((n, 3), torch.float64), ((n_ids,), torch.int64), ((n_t,), torch.int64),
                  ((n_t,), torch.float32), ((n_t,), torch.uint8)]
        batch = [_bcast(torch.empty(shape, dtype=dtype)) for shape, dtype in shapes]
    path = bytes(_bcast(torch.empty(n_path, dtype=torch.uint8)).tolist()).decode() if n_path else ""
    return Command(kind), batch, arg, path


def share_run_dir(run_dir: Path | None) -> Path:
    """Rank 0's run folder on every rank (followers resume from its checkpoints)."""
    if dist.is_rank0():
        assert run_dir is not None
        _announce(Command.CHECKPOINT, path=str(run_dir))
        return run_dir
    return Path(_receive()[3])


class Leader:
    """Rank 0's learner: each call first tells the followers to make the same call. Other attributes are
    the learner's."""

    def __init__(self, learner: Any) -> None:
        self.learner = learner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.learner, name)

    def step(self, batch: Sequence[Group]) -> dict[str, float]:
        _announce(Command.STEP, batch=encode_batch(batch))
        return self.learner.step(batch)

    def state_dict_for_broadcast(self) -> dict[str, torch.Tensor]:
        _announce(Command.WEIGHTS)
        return self.learner.state_dict_for_broadcast()

    def before_checkpoint(self, root: Path, keep_last: int) -> Any:
        _announce(Command.CHECKPOINT, arg=keep_last, path=str(root))
        return self.learner

    def close(self) -> None:
        _announce(Command.STOP)


def for_all_ranks(learner: Any, root: Path, keep_last: int) -> Any:
    """checkpoint.save's first step: a Leader brings its followers into the save; returns the learner."""
    return learner.before_checkpoint(root, keep_last) if isinstance(learner, Leader) else learner


def follow(learner: Any, save_checkpoint: Callable[..., Any]) -> int:
    """A follower's loop: rank 0's commands until STOP (save_checkpoint is checkpoint.save, passed in
    because checkpoint.py calls for_all_ranks). Returns the number of steps trained."""
    while True:
        kind, batch, arg, path = _receive()
        if kind == Command.STEP:
            learner.step(decode_batch(*batch))
        elif kind == Command.WEIGHTS:
            learner.state_dict_for_broadcast()
        elif kind == Command.CHECKPOINT:
            save_checkpoint(path, learner, data_position={}, keep_last=arg)
        else:
            log.info("rank %d: stop after %d steps", dist.rank(), learner.step_count)
            return learner.step_count
