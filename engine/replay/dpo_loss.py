"""DPO over chosen/rejected pairs that share their prompt, as a loss the replay and packed strategies run.

    loss = mean over pairs of -log sigmoid(beta * ((S_c - R_c) - (S_r - R_r)))

S: a sample's summed completion log-prob under the policy, R: under the reference. The loss is not a sum
over tokens, so a strategy first runs one forward without autograd for every S (set_sequence_logprobs),
then the usual forward/backward with the per-token linearisation sum_rows c_sample * logp_row, where
c_s = d loss / d S_s: the same gradient as backpropagating the DPO loss itself, since dS_s = sum of the
sample's d logp. In the trie, chosen and rejected share their prompt, which runs once; the reference
model's S come from the same trie walk (sequence_logprobs). On several trainer ranks each rank holds some
of the pairs and the mean is over all ranks' pairs (num_pairs), so the ranks' gradients sum to one rank's.
The `train.algorithm = "dpo"` trainer mode (engine/trainer/dpo_loop.py) runs this loss.
Test: pytest tests/engine/replay/test_replay.py -k dpo; pytest tests/engine/trainer/test_dpo.py
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tailrace.engine.core.losses import LossNormaliser
from tailrace.engine.core.samples import TrainSample
from tailrace.engine.replay.forward import decoder_spec
from tailrace.engine.replay.replay import summed_logprobs
from tailrace.engine.replay.trie import build_trie

# Keys of DPOLoss's pair statistics (sums over pairs, except loss_dpo: already the mean, or a rank's share).
PAIR_STAT_KEYS = ("loss_dpo", "pairs", "accuracy", "chosen_reward", "rejected_reward")


def dpo_loss(chosen_S: torch.Tensor, rejected_S: torch.Tensor, ref_chosen_S: torch.Tensor,
             ref_rejected_S: torch.Tensor, beta: float, num_pairs: int | None = None) -> torch.Tensor:
    """DPO loss of pairs from summed log-probs (differentiable in chosen_S and rejected_S), summed over them
    and divided by num_pairs (None: their number, the mean)."""
    margin = beta * ((chosen_S - ref_chosen_S) - (rejected_S - ref_rejected_S))
    return -F.logsigmoid(margin).sum() / (margin.numel() if num_pairs is None else num_pairs)


class DPOLoss:
    """A strategy loss (engine/core/losses.py SequenceLoss) for pairs of sample indices (chosen, rejected).

    ref_logprobs_S: each sample's summed completion log-prob under the reference model (float64 [S]).
    num_pairs: the pairs the loss is the mean over, these and the other ranks' (None: these alone); the
    loss and its statistic loss_dpo are this rank's share, which sums over ranks to the mean.
    """

    def __init__(self, pairs: Sequence[tuple[int, int]], ref_logprobs_S: torch.Tensor, *,
                 beta: float = 0.1, num_pairs: int | None = None) -> None:
        if not pairs:
            raise ValueError("pairs: no chosen/rejected pair")
        if not beta > 0.0:
            raise ValueError(f"beta: must be > 0, got {beta}")
        if num_pairs is not None and num_pairs < len(pairs):
            raise ValueError(f"num_pairs: {num_pairs} is fewer than this rank's {len(pairs)} pairs")
        self.num_pairs = len(pairs) if num_pairs is None else num_pairs
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
                        self.beta, self.num_pairs)
        (self.coef_S,) = torch.autograd.grad(loss, seq)
        self.value = float(loss.detach())
        with torch.no_grad():
            # The implicit rewards beta * (S - R) of chosen and rejected samples; accuracy counts positive margins.
            reward = self.beta * (seq.detach() - self.ref_S)
            chosen, rejected = reward[self.chosen], reward[self.rejected]
            self._pair_stats = {"loss_dpo": loss.detach(), "pairs": torch.tensor(float(self.chosen.numel())),
                                "accuracy": (chosen > rejected).sum().to(torch.float64),
                                "chosen_reward": chosen.sum(), "rejected_reward": rejected.sum()}

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


def pair_metrics(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """DPOLoss's pair statistics of a step -> metrics named trainer/dpo/<name>. reward_margin is the mean of
    beta * (chosen log-ratio - rejected log-ratio); accuracy the share of pairs where it is positive."""
    num_pairs = float(stats["pairs"])
    chosen, rejected = float(stats["chosen_reward"]) / num_pairs, float(stats["rejected_reward"]) / num_pairs
    return {
        "trainer/dpo/loss": float(stats["loss_dpo"]),
        "trainer/dpo/reward_margin": chosen - rejected,
        "trainer/dpo/accuracy": float(stats["accuracy"]) / num_pairs,
        "trainer/dpo/chosen_reward": chosen,
        "trainer/dpo/rejected_reward": rejected,
        "trainer/dpo/pairs": num_pairs,
    }


def sequence_logprobs(model: nn.Module, samples: Sequence[TrainSample], chunk_rows: int) -> torch.Tensor:
    """Each sample's summed completion log-prob under `model` (float64 [S], CPU, no autograd), over the
    samples' trie: a pair's shared prompt runs once, as in the policy's forward."""
    return summed_logprobs(model, decoder_spec(model), build_trie(samples), chunk_rows)
