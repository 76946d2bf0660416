"""DPO over chosen/rejected pairs that share their prompt, as a loss the replay and packed strategies run.

    loss = mean over pairs of -log sigmoid(beta * ((S_c - R_c) - (S_r - R_r)))

S: a sample's summed completion log-prob under the policy, R: under the reference. The loss is not a sum
over tokens, so a strategy first runs one forward without autograd for every S (set_sequence_logprobs),
then the usual forward/backward with the per-token linearisation sum_rows c_sample * logp_row, where
c_s = d loss / d S_s: the same gradient as backpropagating the DPO loss itself, since dS_s = sum of the
sample's d logp. In the trie, chosen and rejected share their prompt, which runs once.
Test: pytest tests/engine/test_replay.py -k dpo
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tailrace.engine.losses import LossNormaliser


def dpo_loss(chosen_S: torch.Tensor, rejected_S: torch.Tensor, ref_chosen_S: torch.Tensor,
             ref_rejected_S: torch.Tensor, beta: float) -> torch.Tensor:
    """Mean DPO loss of pairs from summed log-probs (differentiable in chosen_S and rejected_S)."""
    margin = beta * ((chosen_S - ref_chosen_S) - (rejected_S - ref_rejected_S))
    return -F.logsigmoid(margin).mean()


class DPOLoss:
    """A strategy loss (engine/losses.py SequenceLoss) for pairs of sample indices (chosen, rejected).

    ref_logprobs_S: each sample's summed completion log-prob under the reference model (float64 [S]).
    """

    def __init__(self, pairs: Sequence[tuple[int, int]], ref_logprobs_S: torch.Tensor, *,
                 beta: float = 0.1) -> None:
        if not pairs:
            raise ValueError("pairs: no chosen/rejected pair")
        if not beta > 0.0:
            raise ValueError(f"beta: must be > 0, got {beta}")
        self.chosen = torch.tensor([c for c, _ in pairs], dtype=torch.int64)
        self.rejected = torch.tensor([r for _, r in pairs], dtype=torch.int64)
        self.ref_S = torch.as_tensor(ref_logprobs_S, dtype=torch.float64)
        self.beta = beta
        self.coef_S: torch.Tensor | None = None
        self.value: float = float("nan")
        self._pair_stats: dict[str, torch.Tensor] | None = None

    def set_sequence_logprobs(self, logprobs_S: torch.Tensor) -> None:
        """Summed log-probs under the current policy -> per-sample coefficients d loss / d S_s."""
        seq = logprobs_S.detach().to(torch.float64).requires_grad_()
        loss = dpo_loss(seq[self.chosen], seq[self.rejected], self.ref_S[self.chosen], self.ref_S[self.rejected],
                        self.beta)
        (self.coef_S,) = torch.autograd.grad(loss, seq)
        self.value = float(loss.detach())
        with torch.no_grad():
            ref = self.ref_S
            margin = (seq[self.chosen] - ref[self.chosen]) - (seq[self.rejected] - ref[self.rejected])
            self._pair_stats = {"loss_dpo": loss.detach(), "pairs": torch.tensor(float(self.chosen.numel())),
                                "accuracy": (margin > 0).sum().to(torch.float64)}

    def __call__(self, logp_N: torch.Tensor, sample_idx_N: torch.Tensor, pos_N: torch.Tensor,
                 normaliser: LossNormaliser, *, entropy_N: torch.Tensor | None = None):
        if self.coef_S is None:
            raise RuntimeError("DPOLoss: set_sequence_logprobs must run before the per-token loss")
        coef = self.coef_S[sample_idx_N.cpu()].to(device=logp_N.device, dtype=logp_N.dtype)
        loss = (coef * logp_N).sum()
        stats = {"tokens": torch.tensor(float(logp_N.numel()), dtype=torch.float64)}
        if self._pair_stats is not None:  # reported once per step, on the first call
            stats.update(self._pair_stats)
            self._pair_stats = None
        return loss, stats
