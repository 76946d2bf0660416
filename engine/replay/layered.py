"""The trie strategies (replay, packed, auto) on several ranks under per-layer FSDP2 residency.

    train.fsdp.step_residency = "layer": every FSDP unit all-gathers in its forward and reduce-scatters in
    its backward, so each rank must call each unit equally often (engine/core/lockstep.py). Here:
        packs of whole root subtrees (packed.plan_packs), each ONE root call (forward, LM head, loss) and
        one backward; the pack count agreed across ranks, short ranks pad with zero-weight micro-batches
        auto: replay-or-packed decided once for all ranks (any rank's "replay" wins)
        replay (chosen or agreed): tries that fit a pack run as packs, the gradient is the same; when some
        rank's root subtree is larger than one pack, every rank runs its whole trie as one layer-major
        micro-batch instead (layer_major_pass: exact, each unit gathered and reduced once)
        DPO (a sequence loss): its no-grad sequence log-probs by packs too, count agreed

Depth-first replay (replay.py) cannot run here: its order of forwards and backwards depends on each rank's
tries, so per-layer collectives would not line up. Test: pytest tests/engine/trainer/test_dist.py
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tailrace.engine.core.lockstep import Lockstep
from tailrace.engine.core.losses import LossNormaliser, SequenceLoss
from tailrace.engine.core.samples import TrainSample
from tailrace.engine.replay.forward import DecoderSpec, decoder_spec
from tailrace.engine.replay.layer_major import LayerMajorForwardBackward
from tailrace.engine.replay.packed import (
    AutoForwardBackward,
    Pack,
    PackedForwardBackward,
    choose_mode,
    pack_logprobs,
    pack_loss,
    plan_packs,
)
from tailrace.engine.replay.replay import ReplayForwardBackward, default_budget_bytes, trie_stats
from tailrace.engine.replay.trie import Trie, build_trie


def layer_major_pass(model: nn.Module, samples: Sequence[TrainSample], loss_fn: SequenceLoss | None,
                     normaliser: LossNormaliser, *, max_tokens: int, chunk_rows: int,
                     with_entropy: bool) -> dict[str, torch.Tensor]:
    """Replay when some rank's root subtree is larger than one pack: this rank's whole trie as ONE
    layer-major micro-batch (layer_major.py: every unit through layer l before l+1, so each FSDP unit is
    gathered and reduce-scattered once, in the same order on every rank; a rank without samples runs the
    padding unit). Its own collectives; its gradient is replay's (exact). Every rank calls it once."""
    strategy = LayerMajorForwardBackward(chunk_rows, with_entropy, max_unit_tokens=max_tokens)
    return strategy(model, samples, loss_fn, normaliser)


def _settings(strategy) -> tuple[str, int, int, bool]:
    """(mode, pack tokens, activation budget or -1, log entropy) of a trie strategy."""
    if isinstance(strategy, AutoForwardBackward):
        budget = strategy.replay.activation_budget_bytes
        return "auto", strategy.packed.max_tokens, -1 if budget is None else budget, strategy.packed.log_entropy
    if isinstance(strategy, PackedForwardBackward):
        return "packed", strategy.max_tokens, -1, strategy.log_entropy
    assert isinstance(strategy, ReplayForwardBackward)
    return "replay", strategy.max_batch_tokens, -1, strategy.log_entropy


def _packs(trie: Trie | None, max_tokens: int) -> list[Pack]:
    """The trie's packs that have loss rows (a pack of samples whose completion tokens are all observation
    tokens, loss_mask False, has none: it would add nothing, and a forward without a backward would break
    the lock step)."""
    if trie is None:
        return []
    packs = []
    for pack in plan_packs(trie, max_tokens):
        segs = torch.searchsorted(trie.seg_start_S, torch.tensor([pack.node_start, pack.node_stop])).tolist()
        if int(trie.seg_lm_ptr_S1[segs[1]]) > int(trie.seg_lm_ptr_S1[segs[0]]):
            packs.append(pack)
    return packs


def is_trie_strategy(strategy) -> bool:
    return isinstance(strategy, (AutoForwardBackward, PackedForwardBackward, ReplayForwardBackward))


def run_in_lockstep(strategy, model: nn.Module, samples: Sequence[TrainSample], loss_fn: SequenceLoss | None,
                    normaliser: LossNormaliser, lockstep: Lockstep, *, chunk_rows: int) -> dict[str, torch.Tensor]:
    """A trie strategy's forward/backward of this rank's `samples` (possibly none: loss_fn None) in lock
    step with the other ranks (module doc); the strategy's statistics, padding packs' dropped."""
    mode, max_tokens, budget, with_entropy = _settings(strategy)
    spec = decoder_spec(model)
    trie = build_trie(samples) if samples else None
    packs = _packs(trie, max_tokens)
    wants_replay = mode == "replay"
    if mode == "auto" and trie is not None:
        budget = default_budget_bytes(next(model.parameters()).device) if budget < 0 else budget
        wants_replay = choose_mode(model, trie, max_tokens=max_tokens, budget_bytes=budget) == "replay"
    sequence = hasattr(loss_fn, "set_sequence_logprobs")
    largest = max((p.num_tokens for p in packs), default=0)
    num_packs, num_sequence_packs, replay, largest = lockstep.agree(
        f"{mode} pass", [len(packs), int(sequence) * len(packs), int(wants_replay), largest], backward=True)
    if replay and largest > max_tokens:  # agreed: every rank takes this branch
        stats = layer_major_pass(model, samples, loss_fn, normaliser, max_tokens=max_tokens, chunk_rows=chunk_rows,
                                 with_entropy=with_entropy)
        if mode == "auto":
            stats["packed_calls"] = torch.zeros((), dtype=torch.float64)
        return stats
    if num_sequence_packs:  # DPO: every sample's summed log-prob first, without autograd
        rows = packs_logprobs(spec, trie, packs, lockstep, num_sequence_packs, chunk_rows=chunk_rows)
        if trie is not None:
            loss_fn.set_sequence_logprobs(torch.zeros(len(trie.sample_path), dtype=torch.float64)
                                          .index_add_(0, trie.row_sample_R, rows))
    stats: dict[str, torch.Tensor] = {}
    for pack in packs:
        loss = pack_loss(spec, trie, pack, loss_fn, normaliser, stats, chunk_rows=chunk_rows,
                         with_entropy=with_entropy)
        assert loss is not None, "_packs keeps packs with loss rows"
        loss.backward()  # unconditional: every rank reduce-scatters every unit once per micro-batch
    lockstep.pad_to(len(packs), num_packs, backward=True)
    if trie is not None:
        stats.update(trie_stats(trie, sum(p.num_tokens for p in packs), 0))
    if mode == "auto":
        stats["packed_calls"] = torch.tensor(float(not replay and trie is not None), dtype=torch.float64)
    return stats


@torch.no_grad()
def packs_logprobs(spec: DecoderSpec, trie: Trie | None, packs: Sequence[Pack], lockstep: Lockstep, agreed: int,
                   *, chunk_rows: int) -> torch.Tensor:
    """Log-prob of every loss row of `trie` (float64 [R], CPU) by its packs without autograd, then padding
    forwards up to the `agreed` count."""
    out = torch.zeros(0 if trie is None else trie.row_lm_R.numel(), dtype=torch.float64)
    for pack in packs:
        rows = pack_logprobs(spec, trie, pack, chunk_rows=chunk_rows)
        if rows is not None:
            out[rows[2]] = rows[0].double().cpu()
    lockstep.pad_to(len(packs), agreed, backward=False)
    return out


def sample_logprobs(model: nn.Module, samples: Sequence[TrainSample], lockstep: Lockstep, *, max_tokens: int,
                    chunk_rows: int) -> list[torch.Tensor]:
    """Per-sample completion log-probs (float64 [T] each, CPU) by packs, no autograd, in lock step with the
    other ranks (replay.sample_logprobs' counterpart; this rank's samples may be none)."""
    trie = build_trie(samples) if samples else None
    packs = _packs(trie, max_tokens)
    (agreed,) = lockstep.agree("log-probs by packs", [len(packs)], backward=False)
    rows = packs_logprobs(decoder_spec(model), trie, packs, lockstep, agreed, chunk_rows=chunk_rows)
    if trie is None:
        return []
    lengths = [s.num_completion_tokens for s in samples]
    offsets_S = torch.tensor([0, *lengths[:-1]], dtype=torch.int64).cumsum(0)
    flat = torch.zeros(sum(lengths), dtype=torch.float64)
    flat[offsets_S[trie.row_sample_R] + trie.row_pos_R] = rows
    return list(flat.split(lengths))
