"""GRPO advantages and the decoupled PPO-clip policy loss with truncated importance weights (AReaL style).

Everything here works on flat per-token tensors, one row per (sample, completion position) pair with a loss term, so any
forward/backward strategy (naive micro-batches now, branch-replay or packed tries later) can call the
loss on whatever rows it has, with each row's own sample's advantage and behaviour log-prob. The loss is
a sum of per-token terms times per-token weights fixed by the whole step (`LossNormaliser`, in
engine/core/losses.py with the SequenceLoss call that strategies make), so the sum
over any partition of the step's rows gives the same loss and gradient. Rows are loss tokens only: a
multi-turn sample's observation tokens (loss_mask False) get no row, so every count, weight and statistic
here (normaliser, ratios, clip and truncation fractions, KL, entropy) is over the assistant's tokens.
Test: pytest tests/engine/trainer/test_loss.py
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tailrace.engine.core.losses import LossNormaliser
from tailrace.engine.core.samples import Group, TrainSample

if TYPE_CHECKING:
    from tailrace.engine.config import TrainConfig

AGGREGATIONS = ("token_mean", "sample_mean")


@dataclass(kw_only=True, frozen=True)
class LossConfig:
    """clip_eps_low/high: PPO ratio clip range [1 - low, 1 + high] (high > low is DAPO's clip-higher).
    is_cap: cap of the truncated importance weight proximal/behaviour (inf disables truncation).
    kl_coef: weight of the k3 KL estimate to the reference model (0 disables it; no reference needed).
    aggregation: "token_mean" (every completion token of the step weighs the same) or "sample_mean"
    (every sample weighs the same, its tokens share its weight).
    scale_advantages: divide r - mean(r) by std(r) + advantage_eps (GRPO); off is Dr. GRPO's choice.
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    is_cap: float = 5.0
    kl_coef: float = 0.0
    aggregation: str = "token_mean"
    scale_advantages: bool = True
    advantage_eps: float = 1e-6

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_eps_low < 1.0:
            raise ValueError(f"clip_eps_low: must be in [0, 1), got {self.clip_eps_low}")
        if not self.clip_eps_high >= 0.0:
            raise ValueError(f"clip_eps_high: must be >= 0, got {self.clip_eps_high}")
        if not self.is_cap >= 1.0:
            raise ValueError(f"is_cap: must be >= 1, got {self.is_cap}")
        if not (self.kl_coef >= 0.0 and math.isfinite(self.kl_coef)):
            raise ValueError(f"kl_coef: must be finite and >= 0, got {self.kl_coef}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation: must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if not self.advantage_eps > 0.0:
            raise ValueError(f"advantage_eps: must be > 0, got {self.advantage_eps}")


def loss_config(train: TrainConfig) -> LossConfig:
    """The loss of a run: the settings of its train section (the learner's; advantage_eps is the loss's own)."""
    return LossConfig(clip_eps_low=train.clip_eps_low, clip_eps_high=train.clip_eps_high, is_cap=train.is_cap,
                      kl_coef=train.kl_coef, aggregation=train.loss_agg, scale_advantages=train.adv_norm_std)


# --------------------------------------------------------------------------------------------- advantages


def group_advantages(rewards: Sequence[float] | torch.Tensor, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages of one group: r - mean(r), divided by (std(r) + eps) when `scale`.

    std is the population std (a group of one has std 0, not NaN). A group whose rewards are all equal
    carries no learning signal and gets exactly zero advantage (float rounding of the mean would otherwise
    leave tiny non-zero values, which `scale` would blow up). Returns float64 [G].
    """
    r = torch.as_tensor(rewards, dtype=torch.float64).reshape(-1)
    if r.numel() == 0:
        raise ValueError("rewards: empty group")
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards: non-finite reward in group")
    if bool((r == r[0]).all()):
        return torch.zeros_like(r)
    centred = r - r.mean()
    if scale:
        centred = centred / (r.std(unbiased=False) + eps)
    return centred


def assign_advantages(groups: Sequence[Group], config: LossConfig) -> None:
    """Set every sample's `advantage` from its group's rewards."""
    for group in groups:
        adv = group_advantages(group.rewards, scale=config.scale_advantages, eps=config.advantage_eps)
        for sample, a in zip(group.samples, adv.tolist(), strict=True):
            sample.advantage = a


# ---------------------------------------------------------------------------------------------- the loss

# Keys of the summed statistics. Each is a sum over rows, so statistics of micro-batches and of ranks add.
STAT_KEYS = ("loss_pg", "loss_kl", "loss", "tokens", "clipped", "is_weight", "truncated", "kl_behaviour",
             "kl_ref", "entropy", "entropy_tokens", "ratio_dev", "ratio_dev_sq")


def policy_loss(
    logp_N: torch.Tensor,
    behaviour_logp_N: torch.Tensor,
    advantages_N: torch.Tensor,
    weights_N: torch.Tensor,
    config: LossConfig,
    *,
    prox_logp_N: torch.Tensor | None = None,
    ref_logp_N: torch.Tensor | None = None,
    entropy_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO-clip: sum_i weight_i * (-w_i * min(r_i A_i, clip(r_i) A_i) + kl_coef * k3_i).

    r_i = exp(logp_i - prox_i), where the proximal policy defaults to the current one before this update
    (logp detached: r = 1 in value, its gradient is grad logp). w_i = min(exp(prox_i - behaviour_i), is_cap),
    detached: the importance weight from the policy that sampled the token (possibly several versions old,
    possibly another backend) to the proximal policy. Each row carries its own sample's advantage; nothing
    is summed across samples before the clip. Returns (loss, summed statistics, see STAT_KEYS).
    """
    cfg = config
    dtype = logp_N.dtype
    behaviour = behaviour_logp_N.to(dtype)
    adv = advantages_N.to(dtype)
    weights = weights_N.to(dtype)
    prox = logp_N.detach() if prox_logp_N is None else prox_logp_N.to(dtype).detach()

    ratio = torch.exp(logp_N - prox)
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high)
    unclipped_obj, clipped_obj = ratio * adv, clipped_ratio * adv
    objective = torch.minimum(unclipped_obj, clipped_obj)
    with torch.no_grad():
        is_raw = torch.exp(prox - behaviour)
        is_weight = is_raw.clamp(max=cfg.is_cap)
    loss_pg = -(weights * is_weight * objective).sum()

    if cfg.kl_coef > 0.0:
        if ref_logp_N is None:
            raise ValueError("kl_coef > 0 needs reference log-probs")
        delta = ref_logp_N.to(dtype).detach() - logp_N
        kl_tok = torch.exp(delta) - delta - 1.0  # k3: unbiased, always >= 0
        loss_kl = cfg.kl_coef * (weights * kl_tok).sum()
    else:
        kl_tok = None
        loss_kl = logp_N.new_zeros(())
    loss = loss_pg + loss_kl

    with torch.no_grad():
        lr_behaviour = logp_N.detach() - behaviour
        ratio_dev = ratio.detach() - 1.0  # moments of r - 1, not of r: no cancellation when r is near 1
        stats = {
            "loss_pg": loss_pg.detach(),
            "loss_kl": loss_kl.detach(),
            "loss": loss.detach(),
            "tokens": torch.tensor(float(logp_N.numel())),
            # The clipped term is the active one exactly where it is strictly smaller.
            "clipped": (clipped_obj < unclipped_obj).sum(),
            "is_weight": is_weight.sum(),
            "truncated": (is_raw > cfg.is_cap).sum(),
            "kl_behaviour": (torch.exp(lr_behaviour) - 1.0 - lr_behaviour).sum(),
            "kl_ref": kl_tok.detach().sum() if kl_tok is not None else torch.zeros(()),
            "entropy": entropy_N.detach().sum() if entropy_N is not None else torch.zeros(()),
            "entropy_tokens": torch.tensor(float(entropy_N.numel() if entropy_N is not None else 0)),
            "ratio_dev": ratio_dev.sum(),
            "ratio_dev_sq": ratio_dev.square().sum(),
        }
    return loss, {k: v.to(device="cpu", dtype=torch.float64) for k, v in stats.items()}


def finalize_metrics(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Summed statistics of a whole step -> metric values named role/group/name."""
    s = {k: float(stats[k]) for k in STAT_KEYS}
    tokens = max(s["tokens"], 1.0)
    out = {
        "trainer/loss/pg": s["loss_pg"],
        "trainer/loss/kl": s["loss_kl"],
        "trainer/loss/total": s["loss"],
        "trainer/policy/clip_frac": s["clipped"] / tokens,
        "trainer/policy/is_weight_mean": s["is_weight"] / tokens,
        "trainer/policy/is_truncated_frac": s["truncated"] / tokens,
        # k3 estimate of KL(behaviour || current): staleness plus generator/trainer numerics.
        "trainer/policy/approx_kl": s["kl_behaviour"] / tokens,
        "trainer/policy/kl_ref": s["kl_ref"] / tokens,
        # The PPO ratio current / proximal: exactly 1 with one pass per step (ppo.py).
        "trainer/policy/ratio_mean": 1.0 + s["ratio_dev"] / tokens,
        "trainer/policy/ratio_std": math.sqrt(max(s["ratio_dev_sq"] / tokens - (s["ratio_dev"] / tokens) ** 2, 0.0)),
    }
    if s["entropy_tokens"] > 0:
        out["trainer/policy/entropy"] = s["entropy"] / s["entropy_tokens"]
    return out


class StepLoss:
    """GRPO's loss of one step's samples, callable on any subset of their (sample, position) rows
    (engine/core/losses.py SequenceLoss).

    Built once per step from the samples this rank trains (index i means samples[i]); a strategy calls it
    with the log-probs it computed and which rows they are. ref/prox_logprobs: optional per-sample [T]
    tensors (reference model for KL; proximal policy when it is not the current one), read at loss rows only.
    Rows index the completion (pos in [0, T)); a row at an observation token (loss_mask False) is a
    strategy's bug and fails an assert.
    """

    def __init__(
        self,
        samples: Sequence[TrainSample],
        config: LossConfig,
        *,
        ref_logprobs: Sequence[torch.Tensor] | None = None,
        prox_logprobs: Sequence[torch.Tensor] | None = None,
    ) -> None:
        assert samples
        self.config = config
        self.lengths_S = torch.tensor([s.num_completion_tokens for s in samples], dtype=torch.int64)
        self.offsets_S = torch.cumsum(self.lengths_S, 0) - self.lengths_S
        self.loss_lengths_S = torch.tensor([s.num_loss_tokens for s in samples], dtype=torch.int64)
        self.mask_M = None if all(s.loss_mask is None for s in samples) else torch.cat(
            [torch.ones(s.num_completion_tokens, dtype=torch.bool) if s.loss_mask is None else s.loss_mask
             for s in samples])
        self.behaviour_M = torch.cat([s.behaviour_logprobs for s in samples])
        self.advantages_S = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
        self.ref_M = self._cat(ref_logprobs, len(samples))
        self.prox_M = self._cat(prox_logprobs, len(samples))

    def _cat(self, per_sample: Sequence[torch.Tensor] | None, num_samples: int) -> torch.Tensor | None:
        if per_sample is None:
            return None
        assert len(per_sample) == num_samples
        return torch.cat([t.detach().reshape(-1).cpu() for t in per_sample])

    def __call__(
        self,
        logp_N: torch.Tensor,
        sample_idx_N: torch.Tensor,
        pos_N: torch.Tensor,
        normaliser: LossNormaliser,
        *,
        entropy_N: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """logp_N: log-probs of the rows' completion tokens (with grad); sample_idx_N, pos_N: int64 [N]."""
        device = logp_N.device
        sample_idx = sample_idx_N.cpu()
        flat = self.offsets_S[sample_idx] + pos_N.cpu()
        assert self.mask_M is None or bool(self.mask_M[flat].all()), "a loss row at an observation token"
        weights = normaliser.token_weights(self.loss_lengths_S[sample_idx], self.config.aggregation)
        return policy_loss(
            logp_N,
            self.behaviour_M[flat].to(device),
            self.advantages_S[sample_idx].to(device),
            weights.to(device),
            self.config,
            prox_logp_N=None if self.prox_M is None else self.prox_M[flat].to(device),
            ref_logp_N=None if self.ref_M is None else self.ref_M[flat].to(device),
            entropy_N=entropy_N,
        )
