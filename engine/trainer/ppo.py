"""PPO epochs and mini-batches of one learner step: the split, the proximal policy, the per-epoch metrics.

    step(batch) -> GRPO advantages over whole groups -> train.minibatches parts (whole groups, in order)
        -> [more than one part] proximal log-probs of parts 2.., one forward without autograd before any
           update (the strategy's own kind of forward: the trie under branch-replay)
        -> for each of train.ppo_epochs epochs, for each part: forward/backward with the part's own loss
           normaliser -> clip -> AdamW                 (LR schedule and policy_version: once per step)

The ratio exp(logp - prox) is clipped against the proximal policy, the policy at the start of the step
(decoupled PPO as in AReaL; TRL's old_per_token_logps with num_iterations > 1), and the truncated
importance weight exp(prox - behaviour) still corrects the generator's staleness. The first part's first
pass runs that policy itself: its ratio is exactly 1 and its log-probs are recorded there (RecordingLoss)
for the later epochs, so with one part no extra forward runs; with one update per step nothing changes.
Test: pytest tests/engine/trainer/test_ppo.py
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from tailrace.engine.core.losses import LossNormaliser
from tailrace.engine.trainer import dist
from tailrace.engine.trainer.loss import STAT_KEYS, StepLoss, finalize_metrics

T = TypeVar("T")
_LOSS_KEYS = ("loss_pg", "loss_kl", "loss")
_EPOCH_KEYS = ("clip_frac", "ratio_mean", "ratio_std", "is_weight_mean", "approx_kl")


def split_minibatches(units: Sequence[T], num_parts: int) -> list[list[T]]:
    """units (groups, or bare samples) in min(num_parts, len(units)) consecutive parts whose sizes differ
    by at most one, the larger first. A group is never split: its advantages belong together."""
    n = min(num_parts, len(units))
    size, extra = divmod(len(units), n)
    parts, start = [], 0
    for i in range(n):
        stop = start + size + (i < extra)
        parts.append(list(units[start:stop]))
        start = stop
    return parts


def split_like(flat: Sequence[T] | None, parts: Sequence[Sequence[object]]) -> list[list[T] | None]:
    """A flat per-sample list cut back into the lengths of `parts` (None stays None for every part)."""
    if flat is None:
        return [None] * len(parts)
    out, start = [], 0
    for part in parts:
        out.append(list(flat[start:start + len(part)]))
        start += len(part)
    assert start == len(flat)
    return out


class RecordingLoss:
    """A StepLoss (engine/core/losses.py SequenceLoss) that also keeps the detached log-prob of every row it is
    called on; a strategy computes each loss row (sample, position) once per pass. Observation tokens of a
    multi-turn sample (loss_mask False) have no row; their recorded log-prob is 0.0 and never read."""

    def __init__(self, loss_fn: StepLoss) -> None:
        self.loss_fn = loss_fn
        self.logp_M = torch.full((int(loss_fn.lengths_S.sum()),), float("nan"), dtype=torch.float64)
        if loss_fn.mask_M is not None:
            self.logp_M[~loss_fn.mask_M] = 0.0

    def __call__(self, logp_N: torch.Tensor, sample_idx_N: torch.Tensor, pos_N: torch.Tensor,
                 normaliser: LossNormaliser, *, entropy_N: torch.Tensor | None = None):
        flat = self.loss_fn.offsets_S[sample_idx_N.cpu()] + pos_N.cpu()
        self.logp_M[flat] = logp_N.detach().to(device="cpu", dtype=torch.float64)
        return self.loss_fn(logp_N, sample_idx_N, pos_N, normaliser, entropy_N=entropy_N)

    def per_sample(self) -> list[torch.Tensor]:
        """The recorded log-probs, per sample [T] (float64, CPU)."""
        assert not bool(self.logp_M.isnan().any()), "a row the strategy never computed"
        return list(self.logp_M.split(self.loss_fn.lengths_S.tolist()))


def reduce_epochs(epoch_stats: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Each epoch's summed statistics, summed across ranks in one collective."""
    flat = {f"{e}/{k}": v for e, stats in enumerate(epoch_stats) for k, v in stats.items()}
    flat = dist.all_reduce_stats_(flat)
    out: list[dict[str, torch.Tensor]] = [{} for _ in epoch_stats]
    for key, value in flat.items():
        e, _, k = key.partition("/")
        out[int(e)][k] = value
    return out


def step_stats(epoch_stats: list[dict[str, torch.Tensor]], num_updates: int) -> dict[str, torch.Tensor]:
    """What the step reports as trainer/loss/* and trainer/policy/*: the statistics of every pass summed
    (fractions over all passes' tokens), losses as the mean over the updates (each part's loss is a mean
    over its own tokens). Strategy counts (tokens run, trie saving) are those of one pass over the data."""
    total = {k: sum(stats[k] for stats in epoch_stats) for k in STAT_KEYS}
    for k in _LOSS_KEYS:
        total[k] = total[k] / num_updates
    first = epoch_stats[0]
    total.update({k: v for k, v in first.items() if k not in STAT_KEYS})
    if float(first.get("unique_tokens", 0.0)) > 0:
        # A ratio does not add over parts or ranks: recomputed from the summed counts.
        total["saving"] = first["logical_tokens"] / first["unique_tokens"]
    return total


def epoch_metrics(epoch_stats: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """trainer/ppo/epoch<e>/<name> for e = 1..ppo_epochs (only with more than one epoch): how far the
    policy moved from the proximal one in each pass, and how much the clip acted."""
    if len(epoch_stats) < 2:
        return {}
    out = {}
    for e, stats in enumerate(epoch_stats, start=1):
        metrics = finalize_metrics(stats)
        out.update({f"trainer/ppo/epoch{e}/{k}": metrics[f"trainer/policy/{k}"] for k in _EPOCH_KEYS})
    return out


def update_metrics(updates: Sequence[tuple[float, bool]]) -> dict[str, float]:
    """Gradient norms (before clipping) of the step's optimizer updates: mean and max; skipped updates
    (non-finite norm) counted."""
    norms = [norm for norm, _ in updates]
    return {
        "trainer/grad/norm": sum(norms) / len(norms),
        "trainer/grad/norm_max": max(norms),
        "trainer/grad/skipped": float(sum(skipped for _, skipped in updates)),
        "trainer/ppo/updates": float(len(updates)),
    }
