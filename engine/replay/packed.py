"""Packed tries: the unique tokens of whole tries as one sequence with a tree attention mask, and the
`auto` choice between that and replay.

A pack is one or more whole root subtrees of the step's trie, its forward-running nodes in DFS pre-order
(a leaf's last node is a label only and is left out), at path-depth positions; each token attends to its
ancestors and itself: kernels/tree_attention.py (Triton) on a GPU, attention.tree_attention_cpu on the
CPU (per root subtree: one masked dense call where its branches are short, else the exact pairs segment by
segment with flash kernels), attention.paths_attention for sliding windows. One forward and one
backward per pack, the loss on the same logical rows as replay, so the gradient is the same. Memory: the
whole pack's activations, where replay holds only the open path's.

`auto` rule (choose_mode), costs in FLOPs from the model's shapes:
    replay = F_tok * U + F_pair * E + F_tok * UNIT_OVERHEAD_TOKENS[device] * (replay's forward calls)
    packed = F_tok * U + F_pair * P + F_tok * SEGMENT_OVERHEAD_TOKENS[device] * (segments that run)
U forward tokens, E the exact query-key pairs (each token x its path), P what the packed attention computes
(E on the CPU; E plus a block margin of GPU_BLOCK per token on CUDA, where the Triton kernel skips only
whole invisible blocks), F_tok the linear-layer FLOPs per token, F_pair the attention FLOPs per pair; a
replay call is an inner segment or a run of sibling leaves, each a full pass through the layers. Packed
is chosen when its largest pack's activations fit the activation budget and it saves at least
PACKED_MIN_SAVING of replay's cost: many short branches (replay's per-call overhead dominates) favour
packed; a long shared prompt with long tails costs the same both ways, and replay, which holds less
memory, is kept.
Test: pytest tests/engine/replay/test_replay.py
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tailrace.engine.core.losses import LossNormaliser, SequenceLoss
from tailrace.engine.core.samples import TrainSample
from tailrace.engine.replay.attention import SegmentRows
from tailrace.engine.replay.forward import (
    DecoderSpec,
    activation_bytes_per_token,
    forward_rows,
)
from tailrace.engine.replay.replay import (
    ReplayForwardBackward,
    default_budget_bytes,
    prepare,
    trie_stats,
    unit_logprobs,
    unit_loss,
)
from tailrace.engine.replay.trie import Trie

UNIT_OVERHEAD_TOKENS = {"cpu": 64, "cuda": 1024}
"""A replay forward call's fixed cost (Python and small kernels in every layer, forward and backward), in
tokens of linear-layer work: measured order of magnitude on this CPU, a launch-bound guess on CUDA."""
SEGMENT_OVERHEAD_TOKENS = {"cpu": 8, "cuda": 0}
"""A packed segment's fixed cost: a few attention calls per layer on the CPU; nothing extra on CUDA."""
GPU_BLOCK = 64
PACKED_MIN_SAVING = 0.1


@dataclass(frozen=True)
class Pack:
    """Node range [node_start, node_stop) of whole root subtrees, and its forward-running nodes."""

    node_start: int
    node_stop: int
    nodes: torch.Tensor  # int64 [n], trie node indices in pre-order

    @property
    def num_tokens(self) -> int:
        return self.nodes.numel()


def plan_packs(trie: Trie, max_tokens: int) -> list[Pack]:
    """Consecutive root subtrees, greedily, up to max_tokens forward tokens (a bigger tree goes alone)."""
    is_input = trie.is_input_N
    cum = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(is_input.to(torch.int64), 0)])
    packs: list[tuple[int, int]] = []
    for root in trie.roots():
        a, b = int(trie.seg_start_S[root]), int(trie.seg_end_S[root])
        if packs and int(cum[b] - cum[packs[-1][0]]) <= max_tokens:
            packs[-1] = (packs[-1][0], b)
        else:
            packs.append((a, b))
    return [Pack(a, b, torch.nonzero(is_input[a:b]).flatten() + a) for a, b in packs]


def pack_segments(trie: Trie, pack: Pack) -> list[SegmentRows]:
    """The pack's segments that run forward, in order (they tile its rows), each with its ancestors' rows."""
    first = int(torch.searchsorted(trie.seg_start_S, torch.tensor(pack.node_start)))
    last = int(torch.searchsorted(trie.seg_start_S, torch.tensor(pack.node_stop)))
    input_len = trie.input_len_S.tolist()
    parents = trie.seg_parent_S.tolist()
    row_starts = torch.searchsorted(pack.nodes, trie.seg_start_S[first:last]).tolist()
    prefix: dict[int, tuple[tuple[int, int], ...]] = {}
    out = []
    for seg in range(first, last):
        if input_len[seg] == 0:
            continue
        lo = row_starts[seg - first]
        parent = parents[seg]
        prefix[seg] = () if parent < 0 else prefix[parent] + ((row_starts[parent - first],
                                                               row_starts[parent - first] + input_len[parent]),)
        out.append(SegmentRows(lo, lo + input_len[seg], prefix[seg], int(trie.seg_depth_S[seg])))
    return out


def pack_subtree_end(trie: Trie, pack: Pack) -> torch.Tensor:
    """subtree_end of the pack's tokens in pack indices (labels-only nodes dropped: nothing attends to them)."""
    seg_of_node = torch.repeat_interleave(torch.arange(trie.num_segments), trie.seg_len_S)
    end_orig = trie.seg_end_S[seg_of_node[pack.nodes]]
    # A node's subtree ends where the first node at or after end_orig would sit among the pack's nodes.
    return torch.searchsorted(pack.nodes, end_orig)


@dataclass
class PackedForwardBackward:
    """The `packed` strategy: max_tokens per pack (a root subtree larger than that is one pack)."""

    max_tokens: int = 8192
    logprob_chunk_tokens: int = 1024
    log_entropy: bool = True

    def __call__(self, model: nn.Module, samples: Sequence[TrainSample], loss_fn: SequenceLoss,
                 normaliser: LossNormaliser) -> dict[str, torch.Tensor]:
        spec, trie = prepare(model, samples, loss_fn, self.logprob_chunk_tokens)
        return self.run(model, spec, trie, loss_fn, normaliser)

    def run(self, model: nn.Module, spec: DecoderSpec, trie: Trie, loss_fn: SequenceLoss,
            normaliser: LossNormaliser) -> dict[str, torch.Tensor]:
        device = next(model.parameters()).device
        stats: dict[str, torch.Tensor] = {}
        forward_tokens = 0
        for pack in plan_packs(trie, self.max_tokens):
            loss = self._pack_loss(spec, trie, pack, loss_fn, normaliser, stats, device)
            if loss is not None:
                loss.backward()
            forward_tokens += pack.num_tokens
        return {**stats, **trie_stats(trie, forward_tokens, 0)}

    def _pack_loss(self, spec: DecoderSpec, trie: Trie, pack: Pack, loss_fn: SequenceLoss,
                   normaliser: LossNormaliser, stats: dict[str, torch.Tensor], device: torch.device):
        return pack_loss(spec, trie, pack, loss_fn, normaliser, stats, chunk_rows=self.logprob_chunk_tokens,
                         with_entropy=self.log_entropy)


def _pack_forward(spec: DecoderSpec, trie: Trie, pack: Pack, head):
    """The pack's forward and head(segments, hidden) as ONE call of the root (forward_rows' head): under
    per-layer FSDP the root (embeddings, final norm, LM head) is gathered and reduced once per pack."""
    device = next(spec.root.parameters()).device
    nodes = pack.nodes.to(device)
    segs = range(*torch.searchsorted(trie.seg_start_S, torch.tensor([pack.node_start, pack.node_stop])).tolist())
    return forward_rows(spec, trie.tokens_N.to(device)[nodes], trie.depth_N.to(device)[nodes],
                        pack_segments(trie, pack), subtree_end_N=pack_subtree_end(trie, pack).to(device),
                        head=lambda hidden: head(segs, hidden))[3]


def pack_loss(spec: DecoderSpec, trie: Trie, pack: Pack, loss_fn: SequenceLoss, normaliser: LossNormaliser,
              stats: dict[str, torch.Tensor], *, chunk_rows: int, with_entropy: bool) -> torch.Tensor | None:
    """One pack's loss (statistics added to `stats`): its forward, LM head and loss in one root call."""
    return _pack_forward(spec, trie, pack, lambda segs, hidden: unit_loss(
        spec, trie, segs, pack.nodes, hidden, loss_fn, normaliser, stats, chunk_rows=chunk_rows,
        with_entropy=with_entropy, inside_root=True))


def pack_logprobs(spec: DecoderSpec, trie: Trie, pack: Pack, *, chunk_rows: int):
    """(log-probs, loss-row slice) of one pack's rows, or None without rows (unit_logprobs), one root call."""
    return _pack_forward(spec, trie, pack, lambda segs, hidden: unit_logprobs(
        spec, trie, segs, pack.nodes, hidden, chunk_rows=chunk_rows, with_entropy=False, inside_root=True))


# ------------------------------------------------------------------------------------------------- auto


def _flops(model: nn.Module) -> tuple[float, float]:
    """(linear-layer FLOPs per token incl. the LM head, attention FLOPs per query-key pair), forward."""
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    per_layer = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    per_token = 2.0 * (per_layer * c.num_hidden_layers + c.hidden_size * c.vocab_size)
    return per_token, 4.0 * c.num_attention_heads * hd * c.num_hidden_layers


def choose_mode(model: nn.Module, trie: Trie, *, max_tokens: int, budget_bytes: int) -> str:
    """"replay" or "packed" for this trie (module doc)."""
    device = next(model.parameters()).device.type
    device = device if device in UNIT_OVERHEAD_TOKENS else "cuda"
    f_tok, f_pair = _flops(model)
    sizes = [p.num_tokens for p in plan_packs(trie, max_tokens)]
    if max(sizes) * activation_bytes_per_token(model) > budget_bytes:
        return "replay"
    exact = trie.attention_pairs()
    input_len = trie.input_len_S
    running = input_len > 0
    inner = torch.zeros_like(running)
    parents = trie.seg_parent_S[running & (trie.seg_parent_S >= 0)]
    inner[parents] = True
    leaf_parents = trie.seg_parent_S[running & ~inner]
    replay_calls = int(inner.sum()) + torch.unique(leaf_parents).numel()
    common = f_tok * trie.num_forward_tokens
    replay = common + f_pair * exact + f_tok * UNIT_OVERHEAD_TOKENS[device] * replay_calls
    packed_pairs = exact if device == "cpu" else exact + GPU_BLOCK * sum(sizes)
    packed = common + f_pair * packed_pairs + f_tok * SEGMENT_OVERHEAD_TOKENS[device] * int(running.sum())
    return "packed" if packed < (1.0 - PACKED_MIN_SAVING) * replay else "replay"


@dataclass
class AutoForwardBackward:
    """The `auto` strategy: replay or packed per call, by choose_mode. Adds stat "packed_calls"."""

    replay: ReplayForwardBackward
    packed: PackedForwardBackward

    def __call__(self, model: nn.Module, samples: Sequence[TrainSample], loss_fn: SequenceLoss,
                 normaliser: LossNormaliser) -> dict[str, torch.Tensor]:
        spec, trie = prepare(model, samples, loss_fn, self.packed.logprob_chunk_tokens)
        device = next(model.parameters()).device
        budget = self.replay.activation_budget_bytes
        budget = default_budget_bytes(device) if budget is None else budget
        mode = choose_mode(model, trie, max_tokens=self.packed.max_tokens, budget_bytes=budget)
        strategy = self.packed if mode == "packed" else self.replay
        stats = strategy.run(model, spec, trie, loss_fn, normaliser)
        stats["packed_calls"] = torch.tensor(float(mode == "packed"), dtype=torch.float64)
        return stats
