"""Training data as the trainer sees it: prompts as a prompt source yields them (`PromptRecord`), and one
scored sample per completion, grouped by prompt (GRPO groups).

Shared from below by engine/data/prompt_sources.py, the trainer and branch-replay. A `TrainSample` holds tensors on the
CPU; the learner moves what it needs to its device. Building these from decoded protocol `Rollout`
messages is the trainer service's job (engine/trainer/service.py).
Tested through tests/engine/trainer/test_learner.py, tests/engine/replay/test_replay.py and tests/engine/trainer/test_controller.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PromptRecord:
    """One prompt as the controller sees it: token ids for the generators, text and metadata for rewards."""

    prompt_id: int
    token_ids: list[int]
    text: str
    task: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True, eq=False)
class TrainSample:
    """One completion of one prompt, with everything the loss needs.

    prompt_ids: int64 [P], P >= 1 (the first completion token is predicted from the last prompt token).
    completion_ids: int64 [T], T >= 1.
    behaviour_logprobs: float32 [T], log-probs of the completion tokens under the distribution the
    generator actually sampled from: softmax(logits / temperature), renormalised over the kept tokens when
    top-p/top-k truncated it. The trainer's log-probs use softmax(logits / temperature) over the full
    vocabulary, so the truncated importance weight exp(logp_prox - behaviour_logp) corrects for staleness,
    truncation and backend numerics alike.
    policy_versions: int64 [T], the policy version that sampled each token (a rollout can span updates).
    loss_mask: bool [T] or None (all True). A multi-turn episode's completion interleaves the assistant's
    tokens with the environment's observation tokens; those are False here: they are context (shared
    prefix in branch-replay's trie like any other token) but carry no loss term, and their
    behaviour_logprobs (0.0) and policy_versions entries are ignored (staleness counts assistant tokens).
    reward_details: the other named numbers of a {"reward": r, "exact": e} reward (logged, not trained on).
    advantage: set by the learner from the group's rewards (GRPO) when it is given groups.
    """

    group_id: int
    sample_id: int
    prompt_ids: torch.Tensor
    completion_ids: torch.Tensor
    behaviour_logprobs: torch.Tensor
    policy_versions: torch.Tensor
    reward: float
    advantage: float = 0.0
    temperature: float = 1.0
    finish_reason: str = "stop"
    reward_details: dict[str, float] = field(default_factory=dict)  # the reward dict's other entries (logged)
    loss_mask: torch.Tensor | None = None  # bool [T]: False for observation tokens (multi-turn); None = all True

    def __post_init__(self) -> None:
        # as_tensor accepts lists and numpy arrays (decoded wire frames are int32 numpy views).
        self.prompt_ids = torch.as_tensor(self.prompt_ids, dtype=torch.int64).reshape(-1)
        self.completion_ids = torch.as_tensor(self.completion_ids, dtype=torch.int64).reshape(-1)
        self.behaviour_logprobs = torch.as_tensor(self.behaviour_logprobs, dtype=torch.float32).reshape(-1)
        self.policy_versions = torch.as_tensor(self.policy_versions, dtype=torch.int64).reshape(-1)
        num_completion = self.completion_ids.numel()
        if self.prompt_ids.numel() == 0:
            raise ValueError("prompt_ids: empty prompt (the first completion token needs a prompt token)")
        if num_completion == 0:
            raise ValueError("completion_ids: empty completion")
        for name in ("behaviour_logprobs", "policy_versions"):
            if getattr(self, name).numel() != num_completion:
                raise ValueError(f"{name}: length {getattr(self, name).numel()} != completion length {num_completion}")
        if self.loss_mask is not None:
            mask = torch.as_tensor(self.loss_mask).reshape(-1)
            # Decoded wire frames may carry the mask as 0/1 integers: anything else is not a mask.
            if mask.dtype != torch.bool and (mask.is_floating_point() or mask.is_complex()
                                             or not bool(((mask == 0) | (mask == 1)).all())):
                raise ValueError(f"loss_mask: must be bool (or 0/1 integers), got {mask.dtype}")
            mask = mask.to(torch.bool)
            if mask.numel() != num_completion:
                raise ValueError(f"loss_mask: length {mask.numel()} != completion length {num_completion}")
            if not bool(mask.any()):
                raise ValueError("loss_mask: no token carries a loss term (at least one must be True)")
            self.loss_mask = mask
        if not bool(torch.isfinite(self.behaviour_logprobs).all()):
            raise ValueError("behaviour_logprobs: non-finite value")
        if not math.isfinite(self.reward):
            raise ValueError(f"reward: non-finite value {self.reward}")
        if not self.temperature > 0.0:
            raise ValueError(f"temperature: must be > 0 for log-probs, got {self.temperature}")

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_ids.numel()

    @property
    def num_completion_tokens(self) -> int:
        """Tokens after the prompt: the assistant's and, multi-turn, the observations between its turns."""
        return self.completion_ids.numel()

    @property
    def num_loss_tokens(self) -> int:
        """Tokens that carry a loss term: the completion's tokens where loss_mask is True."""
        return self.num_completion_tokens if self.loss_mask is None else int(self.loss_mask.sum())

    @property
    def loss_positions(self) -> torch.Tensor:
        """int64 [num_loss_tokens]: the completion positions that carry a loss term, ascending."""
        if self.loss_mask is None:
            return torch.arange(self.num_completion_tokens, dtype=torch.int64)
        return torch.nonzero(self.loss_mask).flatten()

    @property
    def num_tokens(self) -> int:
        """Logical tokens: prompt + completion, what a naive forward pass processes."""
        return self.num_prompt_tokens + self.num_completion_tokens

    @property
    def _loss_versions(self) -> torch.Tensor:
        # Observation tokens carry whatever version the generator stamped: not the policy that wrote them.
        return self.policy_versions if self.loss_mask is None else self.policy_versions[self.loss_mask]

    @property
    def min_policy_version(self) -> int:
        """The oldest policy that sampled one of the tokens with a loss term."""
        return int(self._loss_versions.min())

    @property
    def max_policy_version(self) -> int:
        return int(self._loss_versions.max())


@dataclass(kw_only=True, eq=False)
class Group:
    """The scored samples of one prompt. Samples that could not be scored are left out by the caller."""

    group_id: int
    samples: list[TrainSample]
    task: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError(f"samples: group {self.group_id} is empty")
        for sample in self.samples:
            if sample.group_id != self.group_id:
                raise ValueError(f"samples: sample group_id {sample.group_id} in group {self.group_id}")

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    @property
    def num_completion_tokens(self) -> int:
        return sum(s.num_completion_tokens for s in self.samples)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def min_policy_version(self) -> int:
        return min(s.min_policy_version for s in self.samples)


def flatten_samples(batch: Sequence[Group] | Sequence[TrainSample]) -> list[TrainSample]:
    """Samples of a batch given as groups or as samples, in order."""
    out: list[TrainSample] = []
    for item in batch:
        if isinstance(item, Group):
            out.extend(item.samples)
        elif isinstance(item, TrainSample):
            out.append(item)
        else:
            raise TypeError(f"expected Group or TrainSample, got {type(item).__name__}")
    return out
