"""Branch-replay: forward and backward over the step's prefix trie, every segment once, exact gradients.

    for each segment in DFS pre-order             (only the root-to-current path is open)
        close the open segments that are not its ancestors (all their children are done)
        inner segment: forward against the open path's keys/values, kept under autograd, or (memory
                       budget) run without it and recomputed at close; its per-layer keys/values become
                       autograd leaves (detached copies) that its descendants attend to
        leaf segment:  with its adjacent leaf siblings, one forward against the open path, their own
                       losses, backward at once (their gradient lands in the path's leaves)
    close(segment): ONE backward through its forward, seeded with its own loss and, for its keys/values,
                    the gradient all its descendants accumulated into their leaves (float32 or wider)

A descendant's backward reaches every ancestor's leaves directly (its attention reads the whole path), and
an ancestor closes only after all its descendants, so each leaf holds its full gradient when its segment
closes: the parameter gradient is the naive per-sample one, up to rounding. Memory: the open path's
keys/values and the kept forwards the budget allows (ReplayForwardBackward.activation_budget_bytes:
keep an inner segment iff the kept ones + it + the largest single segment still fit; otherwise recompute
it once at close). The loss is a SequenceLoss (engine/core/losses.py: the learner's StepLoss, or DPOLoss) on
logical rows (one per sample and completion position with a loss term: a multi-turn sample's observation
tokens run forward as prefix but have no row), so advantages, behaviour log-probs and normalisation are per
original sample, as in the naive loss; log-probs come from kernels/logprobs.py,
never a [tokens, vocab] tensor.
Test: pytest tests/engine/replay/test_replay.py
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tailrace.engine.core.losses import LossNormaliser, SequenceLoss, add_stats
from tailrace.engine.core.samples import TrainSample
from tailrace.engine.replay.attention import SegmentRows
from tailrace.engine.replay.forward import (
    DecoderSpec,
    activation_bytes_per_token,
    decoder_spec,
    forward_rows,
    kv_bytes_per_token,
    row_logprobs,
    segment_forward,
)
from tailrace.engine.replay.trie import Trie, build_trie

_EXACT_DTYPES = (torch.float32, torch.float64)


def default_budget_bytes(device: torch.device) -> int:
    """Half the memory free now on `device` (CUDA: mem_get_info; CPU: MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] // 2
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024 // 2
    except (OSError, KeyError, ValueError):
        return 8 << 30


class _PrefixLeaf:
    """One layer's keys or values of an open segment, as an autograd leaf its descendants attend to.

    The gradient of all descendants accumulates in float32 or wider: in .grad for float32/float64, and in
    a float32 buffer (moved there by a post-accumulate hook) for half-precision models."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach().requires_grad_()
        self._grad32: torch.Tensor | None = None
        if tensor.dtype not in _EXACT_DTYPES:
            self.tensor.register_post_accumulate_grad_hook(self._accumulate)

    def _accumulate(self, leaf: torch.Tensor) -> None:
        grad = leaf.grad.float()
        self._grad32 = grad if self._grad32 is None else self._grad32.add_(grad)
        leaf.grad = None

    @property
    def grad(self) -> torch.Tensor | None:
        return self.tensor.grad if self._grad32 is None else self._grad32


@dataclass
class _Open:
    """A segment on the current path: its leaves for descendants and, when kept, its live forward."""

    seg: int
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    leaves: list[_PrefixLeaf]
    outputs: list[torch.Tensor] | None  # keys/values with autograd history (None: recompute at close)
    loss: torch.Tensor | None
    kept_bytes: int


@dataclass
class ReplayForwardBackward:
    """The `replay` strategy (see module doc). activation_budget_bytes: what kept forwards of open inner
    segments may hold; None derives half the device's free memory at each call. max_batch_tokens: tokens
    of sibling leaves run as one forward call."""

    logprob_chunk_tokens: int = 1024
    log_entropy: bool = True
    activation_budget_bytes: int | None = None
    max_batch_tokens: int = 8192

    def __call__(self, model: nn.Module, samples: Sequence[TrainSample], loss_fn: SequenceLoss,
                 normaliser: LossNormaliser) -> dict[str, torch.Tensor]:
        spec, trie = prepare(model, samples, loss_fn, self.logprob_chunk_tokens)
        return self.run(model, spec, trie, loss_fn, normaliser)

    def run(self, model: nn.Module, spec: DecoderSpec, trie: Trie, loss_fn: SequenceLoss,
            normaliser: LossNormaliser) -> dict[str, torch.Tensor]:
        device = next(model.parameters()).device
        budget = self.activation_budget_bytes
        run = _Replay(model, spec, trie, loss_fn, normaliser, chunk_rows=self.logprob_chunk_tokens,
                      with_entropy=self.log_entropy,
                      budget_bytes=default_budget_bytes(device) if budget is None else budget,
                      max_batch_tokens=self.max_batch_tokens)
        run.run()
        return {**run.stats, **trie_stats(trie, run.forward_tokens, run.recomputed_tokens)}


def trie_stats(trie: Trie, forward_tokens: int, recomputed_tokens: int) -> dict[str, torch.Tensor]:
    """Strategy counts, reported as trainer/strategy/<key>. saving = logical / unique tokens."""
    values = {
        "padded_tokens": forward_tokens,  # tokens the forward passes ran (the learner's "padded" count)
        "logical_tokens": trie.num_logical_tokens,
        "unique_tokens": trie.num_unique_tokens,
        "recomputed_tokens": recomputed_tokens,
        "segments": trie.num_segments,
        "saving": trie.num_logical_tokens / trie.num_unique_tokens,
    }
    return {k: torch.tensor(float(v), dtype=torch.float64) for k, v in values.items()}


def unit_logprobs(spec: DecoderSpec, trie: Trie, segs: range, nodes: torch.Tensor, hidden_ND: torch.Tensor, *,
                  chunk_rows: int, with_entropy: bool, inside_root: bool = False):
    """Log-probs of the loss rows of trie segments `segs` (consecutive) from the hidden states of their
    nodes `nodes` (ascending): one per distinct (node, label, temperature), read by every sample row that
    shares it. Returns (logp_R, entropy_R or None, loss-row slice), or None when they have no rows.
    inside_root: called inside the root's forward (forward_rows' head), see row_logprobs."""
    lm = slice(int(trie.seg_lm_ptr_S1[segs.start]), int(trie.seg_lm_ptr_S1[segs.stop]))
    rows = slice(int(trie.seg_row_ptr_S1[segs.start]), int(trie.seg_row_ptr_S1[segs.stop]))
    if lm.start == lm.stop:
        return None
    device = hidden_ND.device
    at = torch.searchsorted(nodes, trie.lm_node_U[lm]).to(device)
    logp_U, entropy_U = row_logprobs(spec, hidden_ND[at], trie.lm_label_U[lm].to(device),
                                     trie.lm_temperature_U[lm].to(device), chunk_rows=chunk_rows,
                                     with_entropy=with_entropy, inside_root=inside_root)
    row_lm = (trie.row_lm_R[rows] - lm.start).to(device)
    return logp_U[row_lm], None if entropy_U is None else entropy_U[row_lm], rows


def unit_loss(spec: DecoderSpec, trie: Trie, segs: range, nodes: torch.Tensor, hidden_ND: torch.Tensor,
              loss_fn: SequenceLoss, normaliser: LossNormaliser, stats: dict[str, torch.Tensor], *, chunk_rows: int,
              with_entropy: bool, inside_root: bool = False) -> torch.Tensor | None:
    """The loss of segments `segs` (unit_logprobs through loss_fn; its statistics added to `stats`)."""
    out = unit_logprobs(spec, trie, segs, nodes, hidden_ND, chunk_rows=chunk_rows, with_entropy=with_entropy,
                        inside_root=inside_root)
    if out is None:
        return None
    logp, entropy, rows = out
    loss, part = loss_fn(logp, trie.row_sample_R[rows], trie.row_pos_R[rows], normaliser, entropy_N=entropy)
    add_stats(stats, part)
    return loss


def segment_nodes(trie: Trie, segs: list[int], input_len: list[int]) -> torch.Tensor:
    """The trie nodes of segments `segs` that run forward, in order (int64)."""
    starts = trie.seg_start_S[segs]
    return torch.cat([torch.arange(int(a), int(a) + input_len[s]) for a, s in zip(starts, segs, strict=True)])


class _Replay:
    """One call's depth-first walk; see the module doc. A unit is one inner segment, or a run of sibling
    leaf segments, which run as one forward call (rows of several segments) against the open path."""

    def __init__(self, model: nn.Module, spec: DecoderSpec, trie: Trie, loss_fn: SequenceLoss,
                 normaliser: LossNormaliser, *, chunk_rows: int, with_entropy: bool, budget_bytes: int,
                 max_batch_tokens: int) -> None:
        self.spec, self.trie, self.loss_fn, self.normaliser = spec, trie, loss_fn, normaliser
        self.chunk_rows, self.with_entropy = chunk_rows, with_entropy
        self.device = next(model.parameters()).device
        self.tokens_N = trie.tokens_N.to(self.device)
        self.depth_N = trie.depth_N.to(self.device)
        self.act_bytes = activation_bytes_per_token(model)
        self.kv_bytes = kv_bytes_per_token(model)
        self.budget_bytes, self.max_batch_tokens = budget_bytes, max_batch_tokens
        self.input_len_S = trie.input_len_S.tolist()
        self.parent_S = trie.seg_parent_S.tolist()
        # Inner segments have a descendant that runs forward; the others close right after their forward.
        self.inner_S = [False] * trie.num_segments
        for seg, parent in enumerate(self.parent_S):
            if parent >= 0 and self.input_len_S[seg] > 0:
                self.inner_S[parent] = True
        self.reserve_bytes = max(self._bytes([s]) for s in range(trie.num_segments))
        self.stats: dict[str, torch.Tensor] = {}
        self.forward_tokens = 0
        self.recomputed_tokens = 0

    def _bytes(self, segs: list[int]) -> int:
        """What a kept forward of `segs` holds for backward: per-token activations (attention keeps only
        its inputs, output and log-sum-exp), plus one temporary concatenation of the path's keys/values."""
        tokens = sum(self.input_len_S[s] for s in segs)
        return tokens * self.act_bytes + int(self.trie.seg_depth_S[segs[0]]) * self.kv_bytes

    def run(self) -> None:
        running = [s for s in range(self.trie.num_segments) if self.input_len_S[s] > 0]
        path: list[_Open] = []
        i = 0
        while i < len(running):
            seg = running[i]
            # The parent of a segment that runs is inner, hence open: close what lies below it.
            while path and path[-1].seg != self.parent_S[seg]:
                self._close(path.pop(), path)
            if self.inner_S[seg]:
                path.append(self._open(seg, path))
                i += 1
                continue
            # Adjacent leaf siblings join one call while it stays within max_batch_tokens and the budget.
            j, tokens = i + 1, self.input_len_S[seg]
            # _bytes of the run: its tokens' activations plus one concatenation of the path (same depth).
            room = self.budget_bytes - sum(o.kept_bytes for o in path) - int(self.trie.seg_depth_S[seg]) * self.kv_bytes
            while (j < len(running) and not self.inner_S[running[j]]
                   and self.parent_S[running[j]] == self.parent_S[seg]
                   and tokens + self.input_len_S[running[j]] <= self.max_batch_tokens
                   and (tokens + self.input_len_S[running[j]]) * self.act_bytes <= room):
                tokens += self.input_len_S[running[j]]
                j += 1
            loss, _ = self._forward(running[i:j], path, keep=True)
            if loss is not None:
                loss.backward()
            i = j
        while path:
            self._close(path.pop(), path)

    def _forward(self, segs: list[int], path: list[_Open], *, keep: bool):
        """(loss or None, keys and values per layer) of the unit `segs` against the open path; without
        autograd or loss when not `keep`."""
        trie = self.trie
        nodes = segment_nodes(trie, segs, self.input_len_S)
        rows, lo = [], 0
        for s in segs:
            depth = int(trie.seg_depth_S[s])
            rows.append(SegmentRows(lo, lo + self.input_len_S[s], (), depth, external=bool(path)))
            lo += self.input_len_S[s]
        self.forward_tokens += lo
        at = nodes.to(self.device)
        with torch.set_grad_enabled(keep and torch.is_grad_enabled()):
            hidden, keys, values, _ = forward_rows(self.spec, self.tokens_N[at], self.depth_N[at], rows,
                                                   external=[o.kv for o in path])
            loss = unit_loss(self.spec, trie, range(segs[0], segs[-1] + 1), nodes, hidden, self.loss_fn,
                             self.normaliser, self.stats, chunk_rows=self.chunk_rows,
                             with_entropy=self.with_entropy) if keep else None
        return loss, list(zip(keys, values, strict=True))

    def _open(self, seg: int, path: list[_Open]) -> _Open:
        kept_now = sum(o.kept_bytes for o in path)
        nbytes = self._bytes([seg])
        keep = kept_now + nbytes + self.reserve_bytes <= self.budget_bytes
        loss, kv = self._forward([seg], path, keep=keep)
        leaves = [_PrefixLeaf(t) for pair in kv for t in pair]
        pairs = [(leaves[2 * i].tensor, leaves[2 * i + 1].tensor) for i in range(len(kv))]
        outputs = [t for pair in kv for t in pair] if keep else None
        return _Open(seg, pairs, leaves, outputs, loss, nbytes if keep else 0)

    def _close(self, o: _Open, path: list[_Open]) -> None:
        outputs, loss = o.outputs, o.loss
        if outputs is None:  # recompute the forward against the (still open) ancestors
            self.recomputed_tokens += self.input_len_S[o.seg]
            loss, kv = self._forward([o.seg], path, keep=True)
            outputs = [t for pair in kv for t in pair]
        tensors, grads = [], []
        if loss is not None:
            tensors.append(loss)
            grads.append(torch.ones_like(loss))
        for out, leaf in zip(outputs, o.leaves, strict=True):
            # Keys/values that no trainable parameter reaches (frozen layers below LoRA adapters, e.g. the
            # first layer's keys when only q_proj and v_proj adapt) have no graph: nothing to send back.
            if leaf.grad is not None and out.requires_grad:
                tensors.append(out)
                grads.append(leaf.grad.to(out.dtype))
        if tensors:
            torch.autograd.backward(tensors, grads)


# ------------------------------------------------------------------------------- sequence-level losses


@torch.no_grad()
def trie_logprobs(model: nn.Module, spec: DecoderSpec, trie: Trie, chunk_rows: int) -> torch.Tensor:
    """Log-prob of every loss row (float64 [R], CPU): one forward over the trie without autograd."""
    device = next(model.parameters()).device
    out = torch.zeros(trie.row_lm_R.numel(), dtype=torch.float64)
    input_len = trie.input_len_S.tolist()
    parents = trie.seg_parent_S.tolist()
    path: list[tuple[int, list]] = []
    for seg, length in enumerate(input_len):
        if length == 0:
            continue
        while path and path[-1][0] != parents[seg]:
            path.pop()
        start = int(trie.seg_start_S[seg])
        hidden, keys, values = segment_forward(spec, trie.tokens_N[start:start + length].to(device),
                                               int(trie.seg_depth_S[seg]), [kv for _, kv in path])
        nodes = torch.arange(start, start + length)
        rows = unit_logprobs(spec, trie, range(seg, seg + 1), nodes, hidden, chunk_rows=chunk_rows,
                             with_entropy=False)
        if rows is not None:
            out[rows[2]] = rows[0].double().cpu()
        if int(trie.seg_num_children_S[seg]):
            path.append((seg, list(zip(keys, values, strict=True))))
    return out


def sample_logprobs(model: nn.Module, samples: Sequence[TrainSample], chunk_rows: int) -> list[torch.Tensor]:
    """Per-sample completion log-probs (float64 [T] each, CPU), shared prefixes run once, no autograd; 0.0
    at observation tokens (loss_mask False), which have no loss row."""
    if not samples:
        return []
    trie = build_trie(samples)
    rows = trie_logprobs(model, decoder_spec(model), trie, chunk_rows)
    lengths = [s.num_completion_tokens for s in samples]
    offsets_S = torch.tensor([0, *lengths[:-1]], dtype=torch.int64).cumsum(0)
    flat = torch.zeros(sum(lengths), dtype=torch.float64)
    flat[offsets_S[trie.row_sample_R] + trie.row_pos_R] = rows
    return list(flat.split(lengths))


def prepare(model: nn.Module, samples: Sequence[TrainSample], loss_fn, chunk_rows: int) -> tuple[DecoderSpec, Trie]:
    """What every strategy does first: the model's decoder spec and the samples' trie, with the
    per-sample sequence losses set up (prepare_sequence_loss)."""
    spec = decoder_spec(model)
    trie = build_trie(samples)
    prepare_sequence_loss(model, spec, trie, loss_fn, chunk_rows)
    return spec, trie


def prepare_sequence_loss(model: nn.Module, spec: DecoderSpec, trie: Trie, loss_fn, chunk_rows: int) -> None:
    """A loss that is not a sum over tokens (DPO: a function of each sample's summed log-prob) declares
    `set_sequence_logprobs`; it gets every sample's summed log-prob first (one forward without autograd)
    and turns into the per-token linearisation whose gradient is the exact gradient of the sequence loss."""
    if hasattr(loss_fn, "set_sequence_logprobs"):
        loss_fn.set_sequence_logprobs(summed_logprobs(model, spec, trie, chunk_rows))


def summed_logprobs(model: nn.Module, spec: DecoderSpec, trie: Trie, chunk_rows: int) -> torch.Tensor:
    """Each sample's summed completion log-prob over its loss tokens (float64 [S], CPU), shared prefixes run
    once, no autograd."""
    rows = trie_logprobs(model, spec, trie, chunk_rows)
    return torch.zeros(len(trie.sample_path), dtype=torch.float64).index_add_(0, trie.row_sample_R, rows)

