"""What a forward/backward strategy knows of a loss, shared by the trainer and branch-replay from below.

    SequenceLoss    the call every strategy makes on the rows it computes: (log-probs, which sample and
                    which completion position each row is, the step's normaliser) -> (loss, statistics)
    LossNormaliser  the counts of the whole optimizer step, fixed before any forward pass
    add_stats       sums statistics of micro-batches (and ranks) by name

The objectives themselves live with their users: GRPO's PPO-clip StepLoss in engine/trainer/loss.py,
DPO's DPOLoss in engine/replay/dpo_loss.py. Test: pytest tests/engine/trainer/test_loss.py
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tailrace.engine.core.samples import TrainSample


@dataclass(frozen=True)
class LossNormaliser:
    """Counts of the whole optimizer step (all micro-batches, all ranks), fixed before any forward pass.

    num_tokens: logical tokens with a loss term (a token shared by k samples counts k times, as in the naive
    loss; a multi-turn sample's observation tokens, loss_mask False, do not count). num_samples: samples in
    the step.
    """

    num_tokens: int
    num_samples: int

    @classmethod
    def from_samples(cls, samples: Sequence[TrainSample]) -> LossNormaliser:
        return cls(num_tokens=sum(s.num_loss_tokens for s in samples), num_samples=len(samples))

    def token_weights(self, lengths_N: torch.Tensor, aggregation: str) -> torch.Tensor:
        """Per-row weight; lengths_N is each row's sample's number of loss tokens (TrainSample.num_loss_tokens)."""
        assert self.num_tokens > 0 and self.num_samples > 0
        if aggregation == "token_mean":
            return torch.full(lengths_N.shape, 1.0 / self.num_tokens, dtype=torch.float64, device=lengths_N.device)
        assert aggregation == "sample_mean", aggregation
        return 1.0 / (self.num_samples * lengths_N.to(torch.float64))


class SequenceLoss(Protocol):
    """The loss of one step's samples, callable on any subset of their (sample, position) rows.

    logp_N: log-probs of the rows' completion tokens (with grad); sample_idx_N, pos_N: int64 [N], index i
    meaning the strategy's samples[i]. A strategy calls it on loss rows only: the completion positions whose
    loss_mask is True (TrainSample.loss_positions), each once per pass; observation tokens of a multi-turn
    sample get no row. Returns the loss to backpropagate and summed float64 statistics.
    """

    def __call__(self, logp_N: torch.Tensor, sample_idx_N: torch.Tensor, pos_N: torch.Tensor,
                 normaliser: LossNormaliser, *,
                 entropy_N: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def add_stats(total: dict[str, torch.Tensor], part: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for k, v in part.items():
        total[k] = total[k] + v if k in total else v.clone()
    return total
