"""Layer-major replay: the prefix trie's segments run layer by layer, so each FSDP2 unit gathers once.

Branch-replay (replay.py) walks the trie depth-first: its order of forwards and backwards, hence of
per-layer FSDP2 collectives, depends on each rank's trie. Here every unit (an inner segment, or a run of
sibling leaves, as in replay.py) goes through layer l before any goes through layer l+1:

    forward, no autograd   embedding (the root's forward); per layer l: unshard it, run every unit in
                           pre-order against its ancestors' layer-l keys/values, reshard it; keep each
                           unit's layer-l input h_l and the inner units' layer-l keys/values
    losses                 final norm + LM head + loss per unit with its h_L as a leaf; backward gives dL/dh_L
    backward, top down     per layer l: unshard it; per unit in reverse pre-order recompute its layer l with
                           h_l and the ancestors' keys/values as autograd leaves, ONE backward seeded with
                           dL/dh_{l+1} and, for an inner unit, the gradient its descendants put in its
                           keys/values leaves; gradient sync only on the last unit's backward (one
                           reduce-scatter), then resharded. Then the embedding's backward (the root's
                           reduce-scatter).

Exactness is replay's argument applied per layer: reverse pre-order puts every descendant's backward before
its ancestor's, and a descendant's attention reads the ancestors' leaves directly, so a unit's keys/values
gradient is complete when its own backward runs; dL/dh_{l+1} of every unit is complete after layer l+1.
The parameter gradient is the naive per-sample one up to rounding (float64: ~1e-15 relative).

FSDP2 (explicit FSDPModule.unshard/reshard and the per-module flags; nothing depends on the trie):
per micro-batch the root is all-gathered once (the embedding's forward) and reduce-scattered once (the
embedding's backward); each decoder layer is all-gathered once in forward, once in backward and
reduce-scattered once, in the same order on every rank:
    AG root, AG L0 .. AG L(n-1), AG L(n-1) RS L(n-1), .., AG L0 RS L0, RS root.
The forward pass calls the layers' submodules directly (no hooks), so FSDP records nothing to prefetch;
the backward pass calls them as the layer's forward (hooks on, reshard_after_forward and gradient sync
off until the last unit), so activation checkpointing composes (it recomputes once more). A rank without
samples runs one padding token with a zero loss through every layer: the same collectives.
Memory per rank: the units' layer inputs for all layers ((L+1) x N x hidden) and the inner units' keys
and values (L x N_inner x 2 x kv_dim), one unit's activations of one layer at a time, one layer unsharded.
sample_logprobs is the same forward without autograd (the learner's proximal and reference log-probs):
AG root, AG L0 .. AG L(n-1).
Call it outside dist.gathered(): it runs the micro-batch's collectives itself and leaves every FSDP module
resharded with requires_gradient_sync and reshard_after_backward on, the layers' reshard_after_forward as
configured, the root's off (as FSDP2 sets a root's by default).
Test: pytest tests/engine/replay/test_layer_major.py
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tailrace.engine.core.losses import LossNormaliser, SequenceLoss
from tailrace.engine.core.models import run_as_forward
from tailrace.engine.core.samples import TrainSample
from tailrace.engine.replay.attention import SegmentRows, paths_attention
from tailrace.engine.replay.forward import DecoderSpec, decoder_layer, decoder_spec, rope, row_logprobs
from tailrace.engine.replay.replay import _PrefixLeaf, segment_nodes, trie_stats, unit_logprobs, unit_loss
from tailrace.engine.replay.trie import Trie, build_trie


@dataclass
class Unit:
    """Segments that run as one call per layer: one inner segment, or a run of sibling leaves (`segs`,
    consecutive in pre-order) with the same ancestors outside the call (root first). nodes: its forward
    rows' trie nodes; rows: its SegmentRows; inner: its keys/values feed descendants."""

    segs: list[int]
    nodes: torch.Tensor
    rows: list[SegmentRows]
    ancestors: list[int]
    inner: bool
    masks: dict = field(default_factory=dict)  # paths_attention's per-call cache, shared by the layers


def plan_units(trie: Trie, max_unit_tokens: int) -> list[Unit]:
    """replay.py's units in pre-order: an inner segment alone; adjacent sibling leaves together up to
    max_unit_tokens forward tokens (a longer leaf goes alone)."""
    input_len = trie.input_len_S.tolist()
    parents = trie.seg_parent_S.tolist()
    inner = [False] * trie.num_segments
    for seg, parent in enumerate(parents):
        if parent >= 0 and input_len[seg] > 0:
            inner[parent] = True
    running = [s for s in range(trie.num_segments) if input_len[s] > 0]
    groups, i = [], 0
    while i < len(running):
        j, tokens = i + 1, input_len[running[i]]
        while (not inner[running[i]] and j < len(running) and not inner[running[j]]
               and parents[running[j]] == parents[running[i]] and tokens + input_len[running[j]] <= max_unit_tokens):
            tokens += input_len[running[j]]
            j += 1
        groups.append(running[i:j])
        i = j
    units = []
    for segs in groups:
        ancestors, a = [], parents[segs[0]]
        while a >= 0:
            ancestors.append(a)
            a = parents[a]
        rows, lo = [], 0
        for s in segs:
            rows.append(SegmentRows(lo, lo + input_len[s], (), int(trie.seg_depth_S[s]), external=bool(ancestors)))
            lo += input_len[s]
        units.append(Unit(segs, segment_nodes(trie, segs, input_len), rows, ancestors[::-1], inner[segs[0]]))
    return units


# ------------------------------------------------------------------------------------------------ FSDP2


class _Shards:
    """The FSDP2 modules of a decoder (root, layers; None at world size 1) and their per-pass flags."""

    def __init__(self, spec: DecoderSpec, reshard_after_forward: bool) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.root = spec.root if isinstance(spec.root, FSDPModule) else None
        self.layers = [m if isinstance(m, FSDPModule) else None for m in spec.decoder.layers]
        self.reshard_after_forward = reshard_after_forward

    def _all(self) -> list[Any]:
        return [m for m in (*self.layers, self.root) if m is not None]

    @contextmanager
    def micro_batch(self):
        """Gradient sync and resharding only where this module asks for them; on exit (also on error)
        every module resharded with the flags FSDP2 trains with by default."""
        for m in self._all():
            m.set_requires_gradient_sync(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
        for m in self.layers:
            if m is not None:
                m.set_reshard_after_forward(False, recurse=False)
        if self.root is not None:  # the root stays gathered from the embedding to its backward
            self.root.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for m in self._all():
                m.set_requires_gradient_sync(True, recurse=False)
                m.set_reshard_after_backward(True, recurse=False)
                m.reshard()
            for m in self.layers:
                if m is not None:
                    m.set_reshard_after_forward(self.reshard_after_forward, recurse=False)

    @staticmethod
    def unshard(m: Any) -> None:
        if m is not None:
            m.unshard()

    @staticmethod
    def reshard(m: Any) -> None:
        if m is not None:
            m.reshard()

    @staticmethod
    def last_backward(m: Any, sync: bool) -> None:
        """The next backward reaching m is its last in this pass: reduce-scatter (if sync) and reshard."""
        if m is not None:
            m.set_requires_gradient_sync(sync, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)

    @staticmethod
    def accumulate(m: Any) -> None:
        if m is not None:
            m.set_requires_gradient_sync(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)


# -------------------------------------------------------------------------------------------- the passes

UnitLoss = Callable[[int, torch.Tensor], "torch.Tensor | None"]
"""unit_loss(unit index, final-normed hidden [n, D]) -> the unit's loss (None: no loss rows)."""


def _embed(spec: DecoderSpec, tokens_N: torch.Tensor) -> torch.Tensor:
    return run_as_forward(spec.root, spec.decoder.embed_tokens, tokens_N)


def _unit_layer(spec: DecoderSpec, i: int, unit: Unit, h: torch.Tensor, cos_sin, external, *, as_forward: bool):
    """Layer i of one unit against its ancestors' layer-i keys/values `external` ((keys, values) or None)."""

    def attend(i: int, q, k, v):
        return paths_attention(q, k, v, unit.rows, scale=spec.scale, window=spec.windows[i], external=external,
                               masks=unit.masks)

    return decoder_layer(spec, i, h, *cos_sin, attend, as_forward=as_forward)


def layer_major(spec: DecoderSpec, tokens_N: torch.Tensor, depth_N: torch.Tensor, units: Sequence[Unit],
                unit_loss_fn: UnitLoss, *, sync_gradients: bool = True, reshard_after_forward: bool = True,
                before_losses: Callable[[list[torch.Tensor]], None] | None = None) -> None:
    """Forward and backward of `units` (their nodes index tokens_N/depth_N, on the model's device), layer
    by layer (module doc); parameter gradients accumulate in .grad (reduce-scattered under FSDP2 when
    sync_gradients). before_losses(final-normed hidden per unit, no autograd) runs before any loss."""
    shards = _Shards(spec, reshard_after_forward)
    at = [u.nodes.to(tokens_N.device) for u in units]
    tokens = torch.cat([tokens_N[a] for a in at])
    with shards.micro_batch():
        inputs, kv, cos_sin = _forward_pass(spec, tokens, depth_N, at, units, shards, keep=True)
        if before_losses is not None:
            with torch.no_grad():
                finals = [spec.decoder.norm(x) for x in inputs[-1]]
            before_losses(finals)
        grads = _losses(spec, inputs.pop(), unit_loss_fn)
        for i in reversed(range(spec.num_layers)):
            grads = _backward_layer(spec, i, units, inputs.pop(), grads, kv.pop(), cos_sin, shards, sync_gradients)
        shards.last_backward(shards.root, sync_gradients)
        with torch.enable_grad():
            h0 = _embed(spec, tokens)
        if h0.requires_grad:  # else (frozen embedding, e.g. LoRA) nothing below the layers trains
            h0.backward(torch.cat(grads))


@torch.no_grad()
def _forward_pass(spec: DecoderSpec, tokens: torch.Tensor, depth_N: torch.Tensor, at: list[torch.Tensor],
                  units: Sequence[Unit], shards: _Shards, *, keep: bool):
    """Embedding (the root's forward: its all-gather) and every layer over every unit: (layer inputs per
    layer, the last layer's output last; inner keys/values per layer; cos/sin per unit). Without `keep`
    only the last layer's output (and no keys/values) is returned."""
    h = list(_embed(spec, tokens).split([a.numel() for a in at]))
    cos_sin = [rope(spec, h[k], depth_N[a]) for k, a in enumerate(at)]
    inputs: list[list[torch.Tensor]] = [h]
    kv: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = []
    for i in range(spec.num_layers):
        h, kv_i = _forward_layer(spec, i, units, inputs[-1], cos_sin, shards)
        inputs = [*inputs, h] if keep else [h]
        if keep:
            kv.append(kv_i)
    return inputs, kv, cos_sin


def _forward_layer(spec: DecoderSpec, i: int, units: Sequence[Unit], h: list[torch.Tensor], cos_sin: list,
                   shards: _Shards):
    """Layer i over every unit in pre-order (ancestors first), no autograd: (outputs, inner keys/values)."""
    layer = shards.layers[i]
    shards.unshard(layer)
    out, kv = [], {}
    for k, unit in enumerate(units):
        ext = _external(kv, unit)
        h_next, keys, values = _unit_layer(spec, i, unit, h[k], cos_sin[k], ext, as_forward=False)
        out.append(h_next)
        if unit.inner:
            kv[unit.segs[0]] = (keys, values)
    shards.reshard(layer)
    return out, kv


def _external(kv: dict, unit: Unit):
    if not unit.ancestors:
        return None
    return [kv[a][0] for a in unit.ancestors], [kv[a][1] for a in unit.ancestors]


def _losses(spec: DecoderSpec, h_last: list[torch.Tensor], unit_loss_fn: UnitLoss) -> list[torch.Tensor]:
    """Each unit's loss from its last layer's output as a leaf, backward at once: dL/dh_L per unit."""
    grads = []
    for k, h in enumerate(h_last):
        leaf = h.detach().requires_grad_()
        with torch.enable_grad():
            loss = unit_loss_fn(k, spec.decoder.norm(leaf))
        if loss is not None and loss.requires_grad:
            loss.backward()
        grads.append(leaf.grad if leaf.grad is not None else torch.zeros_like(h))
    return grads


def _backward_layer(spec: DecoderSpec, i: int, units: Sequence[Unit], h: list[torch.Tensor],
                    grads: list[torch.Tensor], kv: dict, cos_sin: list, shards: _Shards, sync: bool):
    """Layer i recomputed unit by unit in reverse pre-order, each with one backward; returns dL/dh_i."""
    layer = shards.layers[i]
    shards.unshard(layer)
    leaves = {seg: (_PrefixLeaf(k), _PrefixLeaf(v)) for seg, (k, v) in kv.items()}
    leaf_kv = {seg: (k.tensor, v.tensor) for seg, (k, v) in leaves.items()}
    out: list[torch.Tensor] = [torch.empty(0)] * len(units)
    for k in reversed(range(len(units))):
        unit = units[k]
        if k == 0:
            shards.last_backward(layer, sync)
        x = h[k].detach().requires_grad_()
        with torch.enable_grad():
            h_next, keys, values = _unit_layer(spec, i, unit, x, cos_sin[k], _external(leaf_kv, unit), as_forward=True)
        tensors, seeds = [h_next], [grads[k]]
        if unit.inner:
            for t, leaf in zip((keys, values), leaves[unit.segs[0]], strict=True):
                # Keys/values that no trainable parameter reaches (frozen layers below LoRA adapters) have no graph.
                if leaf.grad is not None and t.requires_grad:
                    tensors.append(t)
                    seeds.append(leaf.grad.to(t.dtype))
        torch.autograd.backward(tensors, seeds)
        out[k] = x.grad
    shards.accumulate(layer)
    shards.reshard(layer)
    return out


# ----------------------------------------------------------------------------------------------- strategy


@dataclass
class LayerMajorForwardBackward:
    """The `layer_major` strategy (module doc); the learner's ForwardBackward interface. max_unit_tokens:
    sibling leaves run as one call up to this many tokens. sync_gradients False leaves the gradient
    unreduced (FSDP2 accumulation without communication) for a later micro-batch's reduce-scatter."""

    logprob_chunk_tokens: int = 1024
    log_entropy: bool = True
    max_unit_tokens: int = 8192
    sync_gradients: bool = True
    reshard_after_forward: bool = True

    def __call__(self, model: nn.Module, samples: Sequence[TrainSample], loss_fn: SequenceLoss | None,
                 normaliser: LossNormaliser | None) -> dict[str, torch.Tensor]:
        spec = decoder_spec(model)
        if not samples:
            return self._padding(spec)
        trie = build_trie(samples)
        device = next(model.parameters()).device
        units = plan_units(trie, self.max_unit_tokens)
        stats: dict[str, torch.Tensor] = {}

        def loss_of(k: int, hidden: torch.Tensor):
            u = units[k]
            return unit_loss(spec, trie, range(u.segs[0], u.segs[-1] + 1), u.nodes, hidden, loss_fn, normaliser,
                             stats, chunk_rows=self.logprob_chunk_tokens, with_entropy=self.log_entropy)

        def sequence_logprobs(hidden: list[torch.Tensor]) -> None:
            loss_fn.set_sequence_logprobs(_summed_logprobs(spec, trie, units, hidden, self.logprob_chunk_tokens))

        layer_major(spec, trie.tokens_N.to(device), trie.depth_N.to(device), units, loss_of,
                    sync_gradients=self.sync_gradients, reshard_after_forward=self.reshard_after_forward,
                    before_losses=sequence_logprobs if hasattr(loss_fn, "set_sequence_logprobs") else None)
        # Every forward token runs twice: in the forward pass and recomputed in the backward pass (as replay
        # counts its recomputed segments in padded_tokens too).
        return {**stats, **trie_stats(trie, 2 * trie.num_forward_tokens, trie.num_forward_tokens)}

    def _padding(self, spec: DecoderSpec) -> dict[str, torch.Tensor]:
        """No samples on this rank: one token through every layer with a zero loss, so its collectives are
        every other rank's; the strategy's counts are 0."""
        device = next(spec.root.parameters()).device
        zero = torch.zeros(1, dtype=torch.int64)
        unit = _padding_unit()

        def zero_loss(k: int, hidden: torch.Tensor) -> torch.Tensor:
            one = torch.ones(1, dtype=torch.float64, device=device)
            logp, _ = row_logprobs(spec, hidden, zero.to(device), one, chunk_rows=1, with_entropy=False)
            return logp.sum() * 0.0

        layer_major(spec, zero.to(device), zero.to(device), [unit], zero_loss, sync_gradients=self.sync_gradients,
                    reshard_after_forward=self.reshard_after_forward)
        keys = ("padded_tokens", "logical_tokens", "unique_tokens", "recomputed_tokens", "segments", "saving")
        return {k: torch.zeros((), dtype=torch.float64) for k in keys}


def sample_logprobs(model: nn.Module, samples: Sequence[TrainSample], chunk_rows: int, *,
                    max_unit_tokens: int = 8192, reshard_after_forward: bool = True) -> list[torch.Tensor]:
    """Per-sample completion log-probs (float64 [T] each, CPU), no autograd, layer by layer: under FSDP2
    the root and each layer are all-gathered once, in the same order on every rank (a rank without
    samples runs the padding token and gets []). replay.sample_logprobs' layer-major twin."""
    spec = decoder_spec(model)
    device = next(model.parameters()).device
    if samples:
        trie = build_trie(samples)
        units = plan_units(trie, max_unit_tokens)
        tokens_N, depth_N = trie.tokens_N.to(device), trie.depth_N.to(device)
    else:
        units = [_padding_unit()]
        tokens_N = depth_N = torch.zeros(1, dtype=torch.int64, device=device)
    shards = _Shards(spec, reshard_after_forward)
    at = [u.nodes.to(device) for u in units]
    with shards.micro_batch():
        (last,), _, _ = _forward_pass(spec, torch.cat([tokens_N[a] for a in at]), depth_N, at, units, shards,
                                      keep=False)
        if not samples:
            return []
        with torch.no_grad():
            hidden = [spec.decoder.norm(x) for x in last]
            rows = _row_logprobs(spec, trie, units, hidden, chunk_rows)
    lengths = [s.num_completion_tokens for s in samples]
    offsets_S = torch.tensor([0, *lengths[:-1]], dtype=torch.int64).cumsum(0)
    flat = torch.zeros(sum(lengths), dtype=torch.float64)
    flat[offsets_S[trie.row_sample_R] + trie.row_pos_R] = rows
    return list(flat.split(lengths))


def _padding_unit() -> Unit:
    return Unit([0], torch.zeros(1, dtype=torch.int64), [SegmentRows(0, 1, (), 0)], [], False)


def _row_logprobs(spec: DecoderSpec, trie: Trie, units: Sequence[Unit], hidden: list[torch.Tensor],
                  chunk_rows: int) -> torch.Tensor:
    """Every loss row's log-prob (float64 [R], CPU) from the units' final-normed hidden states."""
    rows = torch.zeros(trie.row_lm_R.numel(), dtype=torch.float64)
    for u, h in zip(units, hidden, strict=True):
        out = unit_logprobs(spec, trie, range(u.segs[0], u.segs[-1] + 1), u.nodes, h, chunk_rows=chunk_rows,
                            with_entropy=False)
        if out is not None:
            rows[out[2]] = out[0].double().cpu()
    return rows


def _summed_logprobs(spec: DecoderSpec, trie: Trie, units: Sequence[Unit], hidden: list[torch.Tensor],
                     chunk_rows: int) -> torch.Tensor:
    """Each sample's summed completion log-prob (float64 [S], CPU) from the units' final hidden states."""
    rows = _row_logprobs(spec, trie, units, hidden, chunk_rows)
    return torch.zeros(len(trie.sample_path), dtype=torch.float64).index_add_(0, trie.row_sample_R, rows)
