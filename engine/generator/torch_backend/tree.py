"""Tree-sampled rollouts: the samples of one group start as a single trunk row and fork at fixed depths.

A group of n samples of one prompt is admitted as one row (the trunk) holding the other n - 1 samples
as its held branches. When the row has generated fork_depths[i] completion tokens (or, in entropy
mode, when its next token's distribution is uncertain enough), the backend splits
its samples into up to `branching` chunks: the row keeps the first, and each other chunk becomes a
clone row (a copy of the row's key/value cache, tokens, log-probs and versions) whose first sample it
runs and whose other samples it holds. Every leaf is an ordinary sample. The decisions (which waiting
samples a trunk holds, how a fork splits them) are pure and live here; the backend copies the rows.
Rows are the backend's _Seq: .request, .branches (held samples), .next_fork, .tree_done, .first_token_s.
Test: pytest tests/engine/generator/torch_backend/test_tree_sampling.py
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class TreeSampling:
    """Where a row holding samples forks, by one of two rules:

    fork_depths: completion lengths (strictly ascending, >= 1); the row forks once it has generated
        that many tokens, so branches share exactly those tokens (a deterministic function of depth).
    fork_entropy: nats; the row forks at a position whose next-token distribution (as sampled:
        temperature, top-k, top-p applied) has entropy above this, before the token there is drawn, so
        every branch draws its own token at the uncertain position; at most max_forks forks per path.
    branching: the most rows one fork turns a row into (the row itself included)."""

    fork_depths: tuple[int, ...] = ()
    fork_entropy: float | None = None
    max_forks: int = 2
    branching: int = 2

    def __post_init__(self):
        depths = tuple(int(d) for d in self.fork_depths)
        if (not depths) == (self.fork_entropy is None):
            raise ValueError("tree sampling needs exactly one of fork_depths and fork_entropy")
        if any(d < 1 for d in depths) or list(depths) != sorted(set(depths)):
            raise ValueError(f"fork_depths must be strictly ascending depths >= 1, got {self.fork_depths}")
        if self.fork_entropy is not None and not self.fork_entropy >= 0.0:
            raise ValueError(f"fork_entropy must be >= 0 nats, got {self.fork_entropy}")
        if self.max_forks < 1:
            raise ValueError(f"max_forks must be at least 1, got {self.max_forks}")
        if self.branching < 2:
            raise ValueError(f"branching must be at least 2, got {self.branching}")
        object.__setattr__(self, "fork_depths", depths)

    @property
    def num_forks(self) -> int:
        """The most forks along one path from the trunk to a leaf."""
        return len(self.fork_depths) if self.fork_depths else self.max_forks

    def next_fork(self, num_generated: int) -> int:
        """Index of the first fork depth still ahead of a row with num_generated tokens."""
        return sum(d <= num_generated for d in self.fork_depths)


def entropy(logprobs_BV: torch.Tensor) -> torch.Tensor:
    """Entropy [B] in nats of distributions given as log-probs (-inf outside the support)."""
    probs_BV = logprobs_BV.exp()
    return -torch.where(probs_BV > 0, probs_BV * logprobs_BV, 0.0).sum(-1)


def split_samples(members: Sequence[T], num_children: int) -> list[list[T]]:
    """Split a row's samples (itself first) into num_children contiguous chunks as equal as possible,
    larger chunks first; chunk 0 starts with the row itself."""
    assert 1 <= num_children <= len(members)
    base, extra = divmod(len(members), num_children)
    out, start = [], 0
    for i in range(num_children):
        size = base + (i < extra)
        out.append(list(members[start:start + size]))
        start += size
    return out


def take_trunks(waiting: deque, max_rows: int) -> tuple[list, deque]:
    """Pop up to max_rows trunks from the waiting queue; each holds the waiting samples of its group
    with the same prompt and sampling (none for samples given back, tree_done). Returns (trunks, the
    rest of the queue)."""
    new = []
    while len(new) < max_rows and waiting:
        trunk = waiting.popleft()
        req = trunk.request
        held = [] if trunk.tree_done else [
            s for s in waiting if not s.tree_done and s.request.group_id == req.group_id
            and s.request.prompt_ids == req.prompt_ids and s.request.sampling == req.sampling]
        if held:
            ids = {id(s) for s in held}
            waiting = deque(s for s in waiting if id(s) not in ids)
        trunk.branches, trunk.next_fork = held, 0
        new.append(trunk)
    return new, waiting


def plan_forks(seqs: Sequence, rows: list[int], next_forks: list[int], tree: TreeSampling,
               num_free_rows: int) -> tuple[list[int], list, list]:
    """Split the samples of each forking row (seqs[row], next fork index next_forks[i]) into up to
    tree.branching chunks, as far as num_free_rows allows (the rest stay held); each chunk but the
    row's own becomes a clone. A row out of forks gives its held samples up. Updates the rows' and
    clones' tree fields; returns (source row of each clone, clones, samples given up)."""
    sources: list[int] = []
    clones: list = []
    requeue: list = []
    for row, next_fork in zip(rows, next_forks, strict=True):
        seq = seqs[row]
        seq.next_fork = next_fork
        num_children = min(tree.branching, 1 + len(seq.branches), 1 + num_free_rows - len(clones))
        chunks = split_samples([seq, *seq.branches], num_children)
        seq.branches = chunks[0][1:]
        family = [seq]
        for chunk in chunks[1:]:
            clone = chunk[0]
            clone.branches, clone.next_fork, clone.first_token_s = chunk[1:], next_fork, seq.first_token_s
            clones.append(clone)
            sources.append(row)
            family.append(clone)
        if next_fork >= tree.num_forks:
            for member in family:
                requeue += member.branches
                member.branches = []
    return sources, clones, requeue
