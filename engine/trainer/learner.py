"""The learner: one step (one policy version) per batch of scored samples, over a Hugging Face causal LM.

    step(batch) -> advantages (GRPO, when given groups) -> minibatches of whole groups (ppo.py) -> per
    epoch, per minibatch: its whole groups to ranks by cost -> forward/backward strategy (every completion
    token once, the minibatch's loss normaliser) under dist.step_pass: per-layer FSDP with the strategy's
    micro-batches in lock step across ranks (train.fsdp.step_residency = "layer"), or every unit gathered
    and a zero-weight unit that reduce-scatters at the end ("full") -> clip -> AdamW;  then LR schedule ->
    policy_version + 1 -> metrics

The forward/backward over a batch is a replaceable strategy (`ForwardBackward`): `naive` (padded
micro-batches) lives here; branch-replay and packed tries register themselves in STRATEGIES.
Test: pytest tests/engine/trainer/test_learner.py
"""

from __future__ import annotations

import math
import random
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from tailrace.engine.config import LoRAConfig, TrainConfig
from tailrace.engine.core.lockstep import Lockstep
from tailrace.engine.core.losses import LossNormaliser, SequenceLoss, add_stats
from tailrace.engine.core.models import run_as_forward
from tailrace.engine.core.samples import Group, TrainSample, flatten_samples
from tailrace.engine.replay import STRATEGIES as REPLAY_STRATEGIES
from tailrace.engine.replay import layered
from tailrace.engine.replay.layer_major import LayerMajorForwardBackward
from tailrace.engine.replay.layer_major import sample_logprobs as layer_major_sample_logprobs
from tailrace.engine.replay.replay import sample_logprobs as replay_sample_logprobs
from tailrace.engine.replay.trie import build_trie
from tailrace.engine.trainer import dist, lora, ppo
from tailrace.engine.trainer.loss import STAT_KEYS, StepLoss, assign_advantages, finalize_metrics, loss_config
from tailrace.kernels.logprobs import chunked_logprobs


@dataclass
class LRSchedule:
    """LR multiplier per optimizer step. A plain object (not a lambda) so LambdaLR's state_dict keeps it."""

    kind: str
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.kind == "cosine" else 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------------------- log-probs


def _check_plain_lm_head(model: nn.Module) -> None:
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(model.config, attr, None) not in (None, 1.0):
            raise ValueError(f"model: config.{attr} transforms the logits; supported families are "
                             "Llama, Qwen2, Qwen3 and Mistral (plain LM head)")


# ---------------------------------------------------------------------------------------- micro-batches


@dataclass
class MicroBatch:
    """Right-padded rows plus, for each loss row, where its predicting hidden state is.

    A row holds prompt + completion[:-1]: the last completion token is a label only. Loss row n is the
    completion token pos_N[n] of samples[sample_idx_N[n]], predicted by hidden state (row_N, col_N); only
    loss tokens have one (a multi-turn sample's observation tokens are inputs, never labels).
    """

    input_ids_BL: torch.Tensor
    attention_mask_BL: torch.Tensor
    position_ids_BL: torch.Tensor
    row_N: torch.Tensor
    col_N: torch.Tensor
    labels_N: torch.Tensor
    temperature_N: torch.Tensor
    sample_idx_N: torch.Tensor
    pos_N: torch.Tensor

    @property
    def num_padded_tokens(self) -> int:
        return self.input_ids_BL.numel()


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices per micro-batch, longest first, so that rows x longest row <= max_tokens (a row longer
    than max_tokens goes alone). Deterministic: ties keep input order."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for i in order:
        # Sorted longest first, so a batch's first row is its longest.
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def collate(samples: Sequence[TrainSample], indices: Sequence[int], device: torch.device, pad_id: int = 0) -> MicroBatch:
    rows = [torch.cat([samples[i].prompt_ids, samples[i].completion_ids[:-1]]) for i in indices]
    width = max(r.numel() for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    fields: dict[str, list[torch.Tensor]] = {k: [] for k in ("row", "col", "labels", "temp", "sample", "pos")}
    for b, (i, row) in enumerate(zip(indices, rows, strict=True)):
        s = samples[i]
        input_ids[b, : row.numel()] = row
        mask[b, : row.numel()] = 1
        pos = s.loss_positions
        t = pos.numel()
        fields["row"].append(torch.full((t,), b, dtype=torch.int64))
        fields["col"].append(pos + (s.num_prompt_tokens - 1))
        fields["labels"].append(s.completion_ids[pos])
        fields["temp"].append(torch.full((t,), s.temperature, dtype=torch.float64))
        fields["sample"].append(torch.full((t,), i, dtype=torch.int64))
        fields["pos"].append(pos)
    cat = {k: torch.cat(v).to(device) for k, v in fields.items()}
    positions = torch.arange(width, dtype=torch.int64).expand(len(rows), width)
    return MicroBatch(input_ids.to(device), mask.to(device), positions.to(device), cat["row"], cat["col"],
                      cat["labels"], cat["temp"], cat["sample"], cat["pos"])


def forward_logprobs(
    model: nn.Module, mb: MicroBatch, *, chunk_rows: int, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of a micro-batch's loss rows: decoder forward, then the LM head on those rows only (as the
    root's forward, so that FSDP2 sees the LM head's use)."""

    def body(input_ids_BL: torch.Tensor):
        out = model.get_decoder()(
            input_ids=input_ids_BL, attention_mask=mb.attention_mask_BL, position_ids=mb.position_ids_BL,
            use_cache=False,
        )
        hidden_NH = out.last_hidden_state[mb.row_N, mb.col_N]
        head = model.get_output_embeddings()
        # Only the loss rows reach the LM head, a chunk at a time (tailrace.kernels.logprobs): at most one
        # [chunk, V] block of logits is alive, never the [B, T, V] tensor.
        return chunked_logprobs(hidden_NH, head.weight, mb.labels_N, bias_V=getattr(head, "bias", None),
                                temperature=mb.temperature_N, chunk_size=chunk_rows, return_entropy=with_entropy)

    out = run_as_forward(model, body, mb.input_ids_BL)
    if not with_entropy:
        return out, None
    return out[0], out[1].detach()


@torch.no_grad()
def sample_logprobs(model: nn.Module, samples: Sequence[TrainSample], *, micro_batch_tokens: int,
                    chunk_rows: int, lockstep: Lockstep | None = None) -> list[torch.Tensor]:
    """Per-sample completion log-probs [T] on the CPU, without gradient (reference or proximal policy);
    0.0 at observation tokens (loss_mask False), which get no loss row. With a lockstep (per-layer FSDP on
    several ranks): the micro-batch count agreed, padded forwards."""
    device = next(model.parameters()).device
    out: list[torch.Tensor] = [torch.empty(0)] * len(samples)
    lengths = [s.num_tokens - 1 for s in samples]
    plan = plan_micro_batches(lengths, micro_batch_tokens)
    agreed = lockstep.agree("naive log-probs", [len(plan)], backward=False)[0] if lockstep else len(plan)
    for indices in plan:
        mb = collate(samples, indices, device)
        logp_N, _ = forward_logprobs(model, mb, chunk_rows=chunk_rows)
        logp_N = logp_N.cpu()
        sample_idx = mb.sample_idx_N.cpu()
        for i in indices:
            out[i] = torch.zeros(samples[i].num_completion_tokens, dtype=logp_N.dtype)
            out[i][mb.pos_N.cpu()[sample_idx == i]] = logp_N[sample_idx == i]
    if lockstep:
        lockstep.pad_to(len(plan), agreed, backward=False)
    return out


def zero_weight_loss(model: nn.Module) -> torch.Tensor:
    """A one-token forward (one root call: every unit once) whose loss is 0 x log-prob: every parameter
    gets a (zero) gradient from its backward."""
    device = next(model.parameters()).device
    one = torch.zeros((1, 1), dtype=torch.int64, device=device)
    index = torch.zeros(1, dtype=torch.int64, device=device)
    mb = MicroBatch(one, torch.ones_like(one), one, index, index, index,
                    torch.ones(1, dtype=torch.float64, device=device), index, index)
    logp_N, _ = forward_logprobs(model, mb, chunk_rows=1)
    return logp_N.sum() * 0.0


def make_lockstep(model: nn.Module, check_schedule: bool) -> Lockstep:
    """The Lockstep (engine/core/lockstep.py) of `model` on this process group: padding micro-batches are
    zero_weight_loss forwards (and backwards); check_schedule: train.fsdp.check_schedule."""
    num_units = len(dist.fsdp_modules(model))

    def pad(backward: bool) -> None:
        with torch.set_grad_enabled(backward):
            loss = zero_weight_loss(model)
        if backward:
            loss.backward()

    def check(entries: Sequence[object]) -> None:
        if check_schedule:
            dist.check_schedule((*entries, num_units))

    return Lockstep(agree_max=dist.agree_max, pad=pad, check=check)


# ------------------------------------------------------------------------------------------- strategies


class ForwardBackward(Protocol):
    """Runs forward and backward for every loss token of `samples` (logically) exactly once: every completion
    token but a multi-turn sample's observation tokens (loss_mask False), which are inputs only.

    Calls loss_fn(logp_N, sample_idx_N, pos_N, normaliser, entropy_N=...) on the rows it computes and
    backpropagates the returned losses; gradients accumulate into .grad (the learner zeroes and steps).
    Returns the summed loss statistics (loss.STAT_KEYS) plus its own counts ("padded_tokens", ...), as
    float64 scalars; extra keys must be the same on every rank (they are all-reduced by name) and are
    reported as trainer/strategy/<key>.
    """

    def __call__(self, model: nn.Module, samples: Sequence[TrainSample], loss_fn: SequenceLoss,
                 normaliser: LossNormaliser) -> dict[str, torch.Tensor]: ...


@dataclass
class NaiveForwardBackward:
    """Every sample as its own right-padded row, in micro-batches of at most micro_batch_tokens."""

    micro_batch_tokens: int
    logprob_chunk_tokens: int
    log_entropy: bool = True

    def __call__(self, model: nn.Module, samples: Sequence[TrainSample], loss_fn: SequenceLoss,
                 normaliser: LossNormaliser, *, lockstep: Lockstep | None = None) -> dict[str, torch.Tensor]:
        """lockstep (per-layer FSDP on several ranks): the micro-batch count agreed across ranks, zero-weight
        padding micro-batches after this rank's own (samples may then be empty, loss_fn None)."""
        device = next(model.parameters()).device
        stats: dict[str, torch.Tensor] = {}
        lengths = [s.num_tokens - 1 for s in samples]
        plan = plan_micro_batches(lengths, self.micro_batch_tokens)
        if lockstep:
            # A micro-batch without loss tokens (all observations) would give some parameters no gradient
            # (the LM head) on this rank only, unlike the others' reduce-scatters: left out, it adds nothing.
            plan = [ix for ix in plan if any(samples[i].num_loss_tokens for i in ix)]
        agreed = lockstep.agree("naive pass", [len(plan)], backward=True)[0] if lockstep else len(plan)
        for indices in plan:
            mb = collate(samples, indices, device)
            logp_N, entropy_N = forward_logprobs(model, mb, chunk_rows=self.logprob_chunk_tokens,
                                                 with_entropy=self.log_entropy)
            loss, part = loss_fn(logp_N, mb.sample_idx_N, mb.pos_N, normaliser, entropy_N=entropy_N)
            loss.backward()
            part["padded_tokens"] = torch.tensor(float(mb.num_padded_tokens), dtype=torch.float64)
            add_stats(stats, part)
        if lockstep:
            lockstep.pad_to(len(plan), agreed, backward=True)
        return stats


def _naive(config: TrainConfig) -> ForwardBackward:
    return NaiveForwardBackward(config.micro_batch_tokens, config.logprob_chunk_tokens, config.log_entropy)


# train.replay -> factory from the train config; engine/replay adds "replay", "packed" and "auto".
STRATEGIES: dict[str, Callable[[TrainConfig], ForwardBackward]] = {"naive": _naive, **REPLAY_STRATEGIES}


# ---------------------------------------------------------------------------------------------- learner


def _clip_grad_norm(params: Sequence[nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm (over all ranks' shards when sharded); returns the norm before."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def _fused_adamw(params: Sequence[torch.Tensor]) -> bool:
    """AdamW's fused kernel: one call per step instead of a dozen ops per parameter, the same update.
    PyTorch's default on a CPU is the per-parameter loop (its foreach path is CUDA's), which costs a
    small model's step several times the fused call (docs/benchmarks.md). Plain CPU or CUDA float
    tensors only; FSDP2's sharded DTensors keep PyTorch's default."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(
        not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and norm gains (1-D) are not pulled toward zero."""
    decay, no_decay = [], []
    for p in model.parameters():  # deduplicated: a tied embedding appears once
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _scaled_loss_stats(stats: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """Statistics summed under normaliser 1, brought to the step's: the loss terms carry the weight."""
    return {k: v * scale if k in ("loss_pg", "loss_kl", "loss") else v for k, v in stats.items()}


def _batch_metrics(samples: Sequence[TrainSample], normaliser: LossNormaliser, staleness: Sequence[int],
                   stats: dict[str, torch.Tensor]) -> dict[str, float]:
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    return {
        "trainer/tokens/logical": float(sum(s.num_tokens for s in samples)),
        "trainer/tokens/loss": float(normaliser.num_tokens),
        "trainer/tokens/padded": float(stats["padded_tokens"]),
        "trainer/samples": float(len(samples)),
        "trainer/reward/mean": float(rewards.mean()),
        "trainer/reward/std": float(rewards.std(unbiased=False)),
        # Samples of groups whose rewards were all equal: no learning signal in this step.
        "trainer/advantage/zero_frac": sum(s.advantage == 0.0 for s in samples) / len(samples),
        "trainer/staleness/max": float(max(staleness)),
        "trainer/staleness/mean": sum(staleness) / len(staleness),
    }


class Learner:
    """Owns the policy model, AdamW, the LR schedule and an optional frozen reference model.

    Its settings are the run's `train` section (engine/config.py TrainConfig: optimizer, schedule over
    train.steps, loss, forward/backward strategy, sharding) and the adapters of `model.lora` (none when
    lora_config is None). Every rank constructs one and calls step() with the same whole batch; see
    engine/trainer/dist.py. Under torchrun the model (and the reference model) are sharded with FSDP2 here,
    before AdamW sees them. policy_version counts optimizer steps from `initial_policy_version` (the
    weights it starts with).
    """

    def __init__(
        self,
        model: nn.Module,
        config: TrainConfig,
        *,
        lora_config: LoRAConfig | None = None,
        ref_model: nn.Module | None = None,
        forward_backward: ForwardBackward | None = None,
        initial_policy_version: int = 0,
    ) -> None:
        if config.replay not in STRATEGIES:
            raise ValueError(f"replay: must be one of {sorted(STRATEGIES)}, got {config.replay!r}")
        if config.kl_coef > 0.0 and ref_model is None:
            raise ValueError("train.kl_coef: > 0 needs a reference model")
        _check_plain_lm_head(model)
        seed_everything(config.seed)
        self.lora = lora.attach(model, lora_config) if lora_config is not None else None  # a PeftModel or None
        self.model = dist.shard_model(model, config.fsdp, checkpointing=config.gradient_checkpointing)
        self.config = config
        self.loss = loss_config(config)
        self.ref_model = ref_model
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
            dist.shard_model(ref_model, config.fsdp, train=False)
        # Per-layer FSDP on several ranks: the strategies' micro-batches in lock step (engine/core/lockstep.py).
        self._lockstep = make_lockstep(model, config.fsdp.check_schedule) \
            if dist.layer_residency(model, config.fsdp) else None
        self._ref_lockstep = make_lockstep(ref_model, config.fsdp.check_schedule) \
            if ref_model is not None and dist.layer_residency(ref_model, config.fsdp) else None
        self.forward_backward = forward_backward or STRATEGIES[config.replay](config)
        if isinstance(self.forward_backward, LayerMajorForwardBackward) and dist.fsdp_modules(self.model) \
                and self._lockstep is None:
            raise ValueError('train.replay = "layer_major" runs FSDP\'s per-layer schedule itself; it cannot run '
                             'with train.fsdp.step_residency = "full" (the whole model gathered): use "layer"')
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            _param_groups(model, config.weight_decay), lr=config.lr, betas=config.betas, eps=config.adam_eps,
            fused=_fused_adamw(self.params) or None,
        )
        schedule = LRSchedule(config.lr_schedule, config.warmup_steps, config.steps, config.min_lr_ratio)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.step_count = 0
        self.policy_version = initial_policy_version
        self._accumulated: set[int] = set()  # group ids accumulate() ran for the coming step
        self._accumulated_stats: dict[str, torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def accumulated_group_ids(self) -> frozenset[int]:
        """Groups whose forward/backward accumulate() ran for the coming step."""
        return frozenset(self._accumulated)

    def accumulate(self, groups: Sequence[Group]) -> bool:
        """Run the forward/backward of some groups of the coming step now, while the rest of its groups are
        still being generated; step() then runs only the others and the optimizer step. The gradient is the
        same: the step-wide normaliser is a scalar factor, so the increments are summed unnormalised
        (normaliser 1) and scaled once all are in. Returns False (nothing done) on several ranks, where every
        rank must run the same calls, and with several passes or updates per step (ppo_epochs, minibatches):
        there the whole step runs in step()."""
        if dist.world_size() > 1 or dist.fsdp_modules(self.model) or not groups or \
                self.config.ppo_epochs > 1 or self.config.minibatches > 1:
            return False
        assign_advantages(groups, self.loss)
        if not self._accumulated:
            self.optimizer.zero_grad(set_to_none=True)
        self.model.train()
        samples = flatten_samples(groups)
        stats = self._forward_backward(samples, LossNormaliser(num_tokens=1, num_samples=1))
        add_stats(self._accumulated_stats, stats)
        self._accumulated.update(g.group_id for g in groups)
        return True

    def step(self, batch: Sequence[Group] | Sequence[TrainSample]) -> dict[str, float]:
        """One step on a batch: train.ppo_epochs passes of train.minibatches optimizer updates each
        (engine/trainer/ppo.py), one policy version. Groups get GRPO advantages from their rewards; bare
        samples are trained with the advantage they carry. Groups already run by accumulate() (by group id)
        are not run again (one pass, one update). Returns metrics named trainer/<group>/<name>."""
        with dist.rank_errors():
            return self._step(batch)

    def _step(self, batch: Sequence[Group] | Sequence[TrainSample]) -> dict[str, float]:
        start_s = time.monotonic()
        samples = flatten_samples(batch)
        if not samples:
            raise ValueError("batch: no samples")
        done = [u for u in batch if isinstance(u, Group) and u.group_id in self._accumulated]
        if len(done) != len(self._accumulated):
            raise ValueError("batch: it lacks groups that accumulate() already ran for this step")
        rest = [u for u in batch if not (isinstance(u, Group) and u.group_id in self._accumulated)]
        assign_advantages([g for g in batch if isinstance(g, Group)], self.loss)
        parts = [batch] if done else ppo.split_minibatches(batch, self.config.minibatches)
        staleness = [self.policy_version - s.min_policy_version for s in samples]
        epoch_stats, updates = self._finish_accumulated(samples, rest) if done else self._passes(parts)
        num_updates = len(updates)
        stats = ppo.step_stats(epoch_stats, num_updates)

        metrics = finalize_metrics(stats)
        metrics.update(_batch_metrics(samples, LossNormaliser.from_samples(samples), staleness, stats))
        # A strategy's own counts (e.g. unique tokens under branch-replay) pass through by name.
        metrics.update({f"trainer/strategy/{k}": float(v) for k, v in stats.items()
                        if k not in STAT_KEYS and k != "padded_tokens"})
        metrics.update(ppo.epoch_metrics(epoch_stats))
        metrics.update(ppo.update_metrics(updates))
        metrics["trainer/ppo/minibatches"] = float(len(parts))
        metrics["trainer/accumulated_groups"] = float(len(done))
        metrics.update(self._count_step())
        metrics["trainer/time/step_s"] = time.monotonic() - start_s
        return metrics

    def _passes(self, parts: list[list]) -> tuple[list[dict[str, torch.Tensor]], list[tuple[float, bool]]]:
        """Every epoch's forward/backward and update of every part; per epoch its summed statistics (all
        ranks), and each update's (gradient norm, skipped)."""
        # Every rank holds the whole batch, so each part's normaliser is its step-wide logical count on each.
        normalisers = [LossNormaliser.from_samples(flatten_samples(part)) for part in parts]
        mine = [flatten_samples(dist.shard(part, self._unit_cost, dist.rank(), dist.world_size())) for part in parts]
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        ref = ppo.split_like(self._ref_logprobs([s for part in mine for s in part]), mine)
        # Proximal log-probs (ppo.py): None is the current policy; the first part's first pass runs the step's
        # starting policy and records them, the other parts' come from a forward before the first update.
        prox: list[list | None] = [None] * len(parts)
        epoch_stats, updates = [], []
        for epoch in range(self.config.ppo_epochs):
            stats = {k: torch.zeros((), dtype=torch.float64) for k in (*STAT_KEYS, "padded_tokens")}
            for i in range(len(parts)):
                first = epoch == 0 and i == 0
                if first and len(parts) > 1:
                    with dist.forward_only(self.model, self.config.fsdp):
                        prox[1:] = ppo.split_like(self._policy_logprobs([s for p in mine[1:] for s in p]), mine[1:])
                with dist.step_pass(self.model, self.config.fsdp, self._zero_weight_loss):
                    loss_fn = None
                    if mine[i]:
                        loss_fn = StepLoss(mine[i], self.loss, ref_logprobs=ref[i], prox_logprobs=prox[i])
                        if first and self.config.ppo_epochs > 1:
                            loss_fn = ppo.RecordingLoss(loss_fn)
                    add_stats(stats, self._run_strategy(mine[i], loss_fn, normalisers[i]))
                    if isinstance(loss_fn, ppo.RecordingLoss):
                        prox[0] = loss_fn.per_sample()
                updates.append(self._update())
            epoch_stats.append(stats)
        return ppo.reduce_epochs(epoch_stats), updates

    def _finish_accumulated(self, samples: list[TrainSample], rest: list) -> tuple[list, list]:
        """The step's single pass when accumulate() ran some of its groups: their gradient brought to the
        step's normaliser, the rest's forward/backward added, one update (as _passes returns them)."""
        normaliser = LossNormaliser.from_samples(samples)
        scale = float(normaliser.token_weights(torch.ones(1), self.loss.aggregation)[0])
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(scale)
        self.model.train()
        stats = self._forward_backward(flatten_samples(rest), normaliser)
        add_stats(stats, _scaled_loss_stats(self._accumulated_stats, scale))
        self._accumulated, self._accumulated_stats = set(), {}
        return ppo.reduce_epochs([stats]), [self._update()]

    def _forward_backward(self, mine: list[TrainSample], normaliser: LossNormaliser) -> dict[str, torch.Tensor]:
        """This rank's samples' forward/backward (gradients add up in .grad) and summed statistics."""
        stats = {k: torch.zeros((), dtype=torch.float64) for k in (*STAT_KEYS, "padded_tokens")}
        ref_logprobs = self._ref_logprobs(mine)
        with dist.step_pass(self.model, self.config.fsdp, self._zero_weight_loss):
            loss_fn = StepLoss(mine, self.loss, ref_logprobs=ref_logprobs) if mine else None
            add_stats(stats, self._run_strategy(mine, loss_fn, normaliser))
        return stats

    def _run_strategy(self, mine: list[TrainSample], loss_fn: SequenceLoss | None,
                      normaliser: LossNormaliser) -> dict[str, torch.Tensor]:
        """The strategy on this rank's samples. In lock step with the other ranks under per-layer FSDP (it
        then runs even without samples: padding micro-batches); otherwise only when there are samples."""
        if isinstance(self.forward_backward, LayerMajorForwardBackward):
            # Runs its own per-layer collectives on every rank (a rank without samples: one padding unit).
            return self.forward_backward(self.model, mine, loss_fn, normaliser)
        if self._lockstep is None:
            return self.forward_backward(self.model, mine, loss_fn, normaliser) if mine else {}
        if layered.is_trie_strategy(self.forward_backward):
            return layered.run_in_lockstep(self.forward_backward, self.model, mine, loss_fn, normaliser,
                                           self._lockstep, chunk_rows=self.config.logprob_chunk_tokens)
        return self.forward_backward(self.model, mine, loss_fn, normaliser, lockstep=self._lockstep)

    def _unit_cost(self, unit: Group | TrainSample) -> float:
        """What a group (or bare sample) costs a rank: its unique tokens under the shared-prefix modes."""
        samples = unit.samples if isinstance(unit, Group) else [unit]
        if self.config.replay == "naive":
            return float(sum(s.num_tokens for s in samples))
        return float(build_trie(samples).num_unique_tokens)

    def _zero_weight_loss(self) -> torch.Tensor:
        return zero_weight_loss(self.model)

    def apply_gradients(self) -> dict[str, float]:
        """One update that is the whole step (DPO): clip, AdamW, LR schedule, count the step; its metrics."""
        return ppo.update_metrics([self._update()]) | self._count_step()

    def _update(self) -> tuple[float, bool]:
        """Clip the (reduced) gradients, AdamW, zero them; (gradient norm before clipping, skipped)."""
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else math.inf
        grad_norm = _clip_grad_norm(self.params, max_norm)
        # A non-finite gradient would poison the weights and Adam's moments for good: skip the update,
        # but keep the step count so schedule, versions and data position stay aligned.
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped

    def _count_step(self) -> dict[str, float]:
        """After a step's updates: the LR schedule moves and policy_version counts once per step."""
        lr = self.optimizer.param_groups[0]["lr"]
        with warnings.catch_warnings():
            # LambdaLR warns when the optimizer did not step, which is exactly the skipped case.
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*before.*optimizer.step", category=UserWarning)
            self.scheduler.step()
        self.step_count += 1
        self.policy_version += 1
        return {
            "trainer/step": float(self.step_count),
            "trainer/policy_version": float(self.policy_version),
            "trainer/lr": lr,
        }

    def _policy_logprobs(self, samples: Sequence[TrainSample]) -> list[torch.Tensor]:
        """The current policy's per-sample log-probs without autograd, by the strategy's kind of forward
        (the trie under the shared-prefix modes). Inside dist.forward_only(self.model); every rank calls it."""
        chunk = self.config.logprob_chunk_tokens
        if self.config.replay == "naive":
            return sample_logprobs(self.model, samples, micro_batch_tokens=self.config.micro_batch_tokens,
                                   chunk_rows=chunk, lockstep=self._lockstep)
        if isinstance(self.forward_backward, LayerMajorForwardBackward):  # every rank, samples or none
            return layer_major_sample_logprobs(self.model, samples, chunk,
                                               max_unit_tokens=self.config.micro_batch_tokens)
        if self._lockstep is not None:
            return layered.sample_logprobs(self.model, samples, self._lockstep,
                                           max_tokens=self.config.micro_batch_tokens, chunk_rows=chunk)
        return replay_sample_logprobs(self.model, samples, chunk) if samples else []

    def _ref_logprobs(self, samples: Sequence[TrainSample]) -> list[torch.Tensor] | None:
        """Every rank calls this (the sharded reference model is gathered once, whatever its share)."""
        if self.ref_model is None or self.loss.kl_coef == 0.0:
            return None
        with dist.forward_only(self.ref_model, self.config.fsdp):
            if not samples and self._ref_lockstep is None:
                return []
            return sample_logprobs(self.ref_model, samples, micro_batch_tokens=self.config.micro_batch_tokens,
                                   chunk_rows=self.config.logprob_chunk_tokens, lockstep=self._ref_lockstep)

    def state_dict_for_broadcast(self) -> dict[str, torch.Tensor]:
        """CPU copy of the weights (name -> tensor) that later optimizer steps cannot change.

        Tied parameters (embedding and LM head) keep both names but share one copy. Under torchrun every
        rank calls this: rank 0 gets the gathered full weights, the other ranks an empty dict. With LoRA: the
        merged weights, by the base model's names.
        """
        if dist.world_size() > 1:
            full = dist.gather_full_state_dict(self.model)
            return lora.merge(full, lora.scalings(self.model)) if self.lora is not None and full else full
        if self.lora is not None:
            return lora.merge(lora.local_state_dict(self.model), lora.scalings(self.model))
        out: dict[str, torch.Tensor] = {}
        copies: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        for name, tensor in self.model.state_dict().items():
            key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
            if tensor.numel() == 0 or key not in copies:
                copies[key] = tensor.detach().to("cpu", copy=True)
            out[name] = copies[key]
        return out

    def state_dict(self) -> dict:
        """Optimizer, scheduler and counters (the model's weights are saved separately, in safetensors)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step_count": self.step_count,
            "policy_version": self.policy_version,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_count = int(state["step_count"])
        self.policy_version = int(state["policy_version"])
