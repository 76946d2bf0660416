"""Exact attention over trie paths, segment by segment, without per-path copies of the keys/values.

Rows are the tokens of one forward call, a union of trie segments in pre-order; a segment's queries see
its ancestors' keys and its own tokens causally. Ancestors are either rows of the same call (packed mode:
`SegmentRows.prefix`) or an external cached prefix (replay: the keys/values of the open path, passed as
separate tensors, root first). A packed call on the CPU (`tree_attention_cpu`) runs each root subtree of
many short branches as one masked dense SDPA call over its rows (its per-segment calls would cost more),
the others as `paths_attention`. `paths_attention` on the CPU runs PyTorch's flash-attention kernels: each
segment's own part causal, the prefix part without a mask (one call per run of adjacent siblings, which
share it), merged by log-sum-exp; its custom backward runs each part's flash backward with the merged
output and log-sum-exp (the split-KV identity) and sums key/value gradients in float32 or wider. Nothing
but the inputs, the output and the log-sum-exp is kept for backward. Sliding windows and other devices
take a per-segment gather + masked SDPA under autograd.
Test: pytest tests/engine/replay/test_replay.py (replay and packed vs naive gradients)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@dataclass(frozen=True)
class SegmentRows:
    """One segment of a forward call: its query rows [lo, hi) (also its own key rows), the rows of its
    ancestors inside the call (root first), its first token's path depth, and whether the external prefix
    (all ancestors outside the call) comes first."""

    lo: int
    hi: int
    prefix: tuple[tuple[int, int], ...]
    depth: int
    external: bool = False


def _gather(x_KNd: torch.Tensor, ranges: Sequence[tuple[int, int]],
            ext: torch.Tensor | None) -> torch.Tensor | None:
    parts = ([ext] if ext is not None else []) + [x_KNd[:, a:b] for a, b in ranges]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def sibling_runs(segments: Sequence[SegmentRows]) -> list[tuple[int, int, SegmentRows, list[SegmentRows]]]:
    """Adjacent segments with the same ancestors (e.g. the completions of one prompt): (rows lo, rows hi,
    first segment, members). Their prefix part runs as one bigger, faster call."""
    runs: list = []
    for seg in segments:
        last = runs[-1][2] if runs else None
        same = last is not None and (last.prefix, last.external) == (seg.prefix, seg.external)
        if same and runs[-1][1] == seg.lo:
            runs[-1] = (runs[-1][0], seg.hi, last, runs[-1][3] + [seg])
        else:
            runs.append((seg.lo, seg.hi, seg, [seg]))
    return runs


def _merge_(out, lse, out_p, lse_p, rows: slice) -> None:
    """out/lse[:, rows] <- attention over both key sets, from each part's output and log-sum-exp."""
    merged = torch.logaddexp(lse[:, rows], lse_p)
    acc = merged.dtype
    mixed = out[:, rows].to(acc) * torch.exp(lse[:, rows] - merged)[..., None]
    mixed += out_p.to(acc) * torch.exp(lse_p - merged)[..., None]
    out[:, rows], lse[:, rows] = mixed.to(out.dtype), merged


def _scatter_add_(dst_KNd: torch.Tensor, src_KSd: torch.Tensor, ranges: Sequence[tuple[int, int]],
                  offset: int) -> None:
    for a, b in ranges:
        dst_KNd[:, a:b] += src_KSd[:, offset:offset + b - a]
        offset += b - a


def _cat(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    return None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class _PathsAttention(torch.autograd.Function):
    """Own parts (causal) per segment, prefix parts (no mask) per sibling run, merged by log-sum-exp.
    Inputs: q, k, v, segments, scale, number of external parts, then the external keys and values."""

    @staticmethod
    def forward(ctx, q_HNd, k_KNd, v_KNd, segments, scale, num_ext, *ext):
        q, k, v = q_HNd.contiguous(), k_KNd.contiguous(), v_KNd.contiguous()
        ext_k, ext_v = _cat(ext[:num_ext]), _cat(ext[num_ext:])
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:2], dtype=torch.promote_types(q.dtype, torch.float32))
        runs = sibling_runs(segments)
        for lo, hi, first, members in runs:
            for seg in members:
                rows = slice(seg.lo, seg.hi)
                o, o_lse = _flash(q[None, :, rows], k[None, :, rows], v[None, :, rows], 0.0, True, scale=scale)
                out[:, rows], lse[:, rows] = o[0], o_lse[0]
            keys = _gather(k, first.prefix, ext_k if first.external else None)
            if keys is not None:
                values = _gather(v, first.prefix, ext_v if first.external else None)
                o, o_lse = _flash(q[None, :, lo:hi], keys[None], values[None], 0.0, False, scale=scale)
                _merge_(out, lse, o[0], o_lse[0], slice(lo, hi))
        ctx.save_for_backward(q, k, v, out, lse, *ext)
        ctx.runs, ctx.scale, ctx.num_ext = runs, scale, num_ext
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *ext = ctx.saved_tensors
        ext_k, ext_v = _cat(ext[:ctx.num_ext]), _cat(ext[ctx.num_ext:])
        grad_out = grad_out.contiguous()
        acc = torch.promote_types(k.dtype, torch.float32)  # key/value gradients summed over descendants
        dq = torch.empty_like(q)
        dk, dv = torch.zeros(k.shape, dtype=acc), torch.zeros(v.shape, dtype=acc)
        d_ext_k = None if ext_k is None else torch.zeros(ext_k.shape, dtype=acc)
        d_ext_v = None if ext_v is None else torch.zeros(ext_v.shape, dtype=acc)

        def part(rows: slice, keys, values, causal: bool):
            return _flash_backward(grad_out[None, :, rows], q[None, :, rows], keys[None], values[None],
                                   out[None, :, rows], lse[None, :, rows], 0.0, causal, scale=ctx.scale)

        for lo, hi, first, members in ctx.runs:
            for seg in members:
                rows = slice(seg.lo, seg.hi)
                dq_s, dk_s, dv_s = part(rows, k[:, rows], v[:, rows], True)
                dq[:, rows], dk[:, rows], dv[:, rows] = dq_s[0], dk[:, rows] + dk_s[0], dv[:, rows] + dv_s[0]
            keys = _gather(k, first.prefix, ext_k if first.external else None)
            if keys is None:
                continue
            values = _gather(v, first.prefix, ext_v if first.external else None)
            dq_p, dk_p, dv_p = part(slice(lo, hi), keys, values, False)
            dq[:, lo:hi] += dq_p[0]
            offset = 0
            if first.external:
                offset = ext_k.shape[1]
                d_ext_k += dk_p[0, :, :offset]
                d_ext_v += dv_p[0, :, :offset]
            _scatter_add_(dk, dk_p[0], first.prefix, offset)
            _scatter_add_(dv, dv_p[0], first.prefix, offset)
        return (dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None,
                *_split(d_ext_k, ext[:ctx.num_ext]), *_split(d_ext_v, ext[ctx.num_ext:]))


def _split(grad: torch.Tensor | None, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if grad is None:
        return []
    return [g.to(p.dtype) for g, p in zip(grad.split([p.shape[1] for p in parts], dim=1), parts, strict=True)]


def paths_attention(q_HNd: torch.Tensor, k_KNd: torch.Tensor, v_KNd: torch.Tensor,
                    segments: Sequence[SegmentRows],
                    *, scale: float, window: int | None = None,
                    external: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] | None = None,
                    masks: dict | None = None) -> torch.Tensor:
    """Each segment's queries over its path (external prefix, ancestors in the call, itself causally);
    grouped-query attention. `segments` tile the rows [0, N) in order. external: (keys, values) pieces
    [K, l, d] of the ancestors outside the call, root first, covering depths 0..; masks: a per-call cache
    the layers share."""
    ext_k, ext_v = external if external is not None else ((), ())
    if window is None and q_HNd.device.type == "cpu":
        return _PathsAttention.apply(q_HNd, k_KNd, v_KNd, tuple(segments), scale, len(ext_k), *ext_k, *ext_v)
    return paths_attention_sdpa(q_HNd, k_KNd, v_KNd, segments, scale=scale, window=window,
                                external=(ext_k, ext_v), masks=masks)


# The CPU costs `tree_attention_cpu` chooses by (forward + backward, PyTorch's flash kernels, one thread
# of this project's 2-core Xeon VM, one GRPO group of 8 branches, heads x head_dim 128 and 1024): a masked
# dense call costs about DENSE_COST_PER_PAIR x heads x head_dim per query-key pair of its whole N x N
# square; paths_attention about PATHS_COST_PER_PAIR per exact pair plus PATHS_COST_PER_SEGMENT per segment
# (its calls, slicing and log-sum-exp merges). Seconds; only their ratios matter. The measurements they
# were fitted to: docs/benchmarks.md.
DENSE_COST_PER_PAIR = 1.2e-10
PATHS_COST_PER_PAIR = 6e-10
PATHS_COST_PER_SEGMENT = 1e-4


def root_subtrees(segments: Sequence[SegmentRows]) -> list[list[SegmentRows]]:
    """The segments of each whole root subtree of a packed call (a segment with no ancestor starts one)."""
    out: list[list[SegmentRows]] = []
    for seg in segments:
        if not seg.prefix and not seg.external or not out:
            out.append([seg])
        else:
            out[-1].append(seg)
    return out


def dense_is_cheaper(segs: Sequence[SegmentRows], heads_x_dim: int) -> bool:
    """Whether one masked dense call over a root subtree's rows beats paths_attention's calls on a CPU."""
    n = segs[-1].hi - segs[0].lo
    exact = sum((seg.hi - seg.lo) * (seg.hi - seg.lo + 1) // 2
                + (seg.hi - seg.lo) * sum(b - a for a, b in seg.prefix) for seg in segs)
    dense = DENSE_COST_PER_PAIR * heads_x_dim * n * n
    paths = PATHS_COST_PER_PAIR * heads_x_dim * exact + PATHS_COST_PER_SEGMENT * len(segs)
    return dense < paths


def tree_attention_cpu(q_HNd: torch.Tensor, k_KNd: torch.Tensor, v_KNd: torch.Tensor,
                       segments: Sequence[SegmentRows], subtree_end_N: torch.Tensor, *, scale: float,
                       masks: dict) -> torch.Tensor:
    """A packed call's attention on a CPU (no external prefix, no window), root subtree by root subtree:
    one masked dense SDPA call over a subtree's rows (token j visible to i iff j <= i < subtree_end[j])
    where that is cheaper than paths_attention's per-segment calls (many short branches, as in a GRPO
    group of short samples: docs/benchmarks.md), else paths_attention. Both
    are exact: the same keys per query, masked pairs weigh exactly zero. masks: the layers' shared cache
    (the plan and the dense masks)."""
    if "cpu_plan" not in masks:
        plan = []
        for segs in root_subtrees(segments):
            lo, hi = segs[0].lo, segs[-1].hi
            if len(segs) > 1 and dense_is_cheaper(segs, q_HNd.shape[0] * q_HNd.shape[-1]):
                rows = torch.arange(lo, hi, device=q_HNd.device)
                ends = subtree_end_N[lo:hi].to(q_HNd.device)
                plan.append((lo, hi, (rows[None, :] <= rows[:, None]) & (rows[:, None] < ends[None, :])))
            else:
                shifted = tuple(SegmentRows(s.lo - lo, s.hi - lo, tuple((a - lo, b - lo) for a, b in s.prefix),
                                            s.depth, s.external) for s in segs)
                plan.append((lo, hi, shifted))
        masks["cpu_plan"] = plan
    outs = []
    for lo, hi, how in masks["cpu_plan"]:
        q, k, v = q_HNd[:, lo:hi], k_KNd[:, lo:hi], v_KNd[:, lo:hi]
        if isinstance(how, torch.Tensor):
            outs.append(path_attention(q, k, v, how, scale))
        else:
            outs.append(_PathsAttention.apply(q, k, v, how, scale, 0))
    return _cat(outs)


def paths_attention_sdpa(q_HNd, k_KNd, v_KNd, segments: Sequence[SegmentRows], *, scale: float,
                         window: int | None, external, masks: dict | None = None) -> torch.Tensor:
    """paths_attention as one masked SDPA call per segment over a gathered copy of its path, under
    autograd: any device, any window."""
    ext_k, ext_v = external
    masks = {} if masks is None else masks
    outs = []
    for i, seg in enumerate(segments):
        ranges = [*seg.prefix, (seg.lo, seg.hi)]
        first = 0 if window is None else max(0, seg.depth - window + 1)
        keys = drop_before([*(ext_k if seg.external else ()), *(k_KNd[:, a:b] for a, b in ranges)], first)
        values = drop_before([*(ext_v if seg.external else ()), *(v_KNd[:, a:b] for a, b in ranges)], first)
        k_all, v_all = _cat(keys), _cat(values)
        if (i, window) not in masks:
            masks[i, window] = path_mask(seg.hi - seg.lo, k_all.shape[1], first, window, q_HNd.device)
        outs.append(path_attention(q_HNd[:, seg.lo:seg.hi], k_all, v_all, masks[i, window], scale))
    return _cat(outs)


def drop_before(parts: list[torch.Tensor], first: int) -> list[torch.Tensor]:
    """Path-ordered [K, l, d] pieces from depth 0, without depths < first."""
    out, depth = [], 0
    for p in parts:
        n = p.shape[1]
        if depth + n > first:
            out.append(p[:, max(0, first - depth):])
        depth += n
    return out


def path_mask(num_queries: int, num_keys: int, first_key_depth: int, window: int | None,
              device: torch.device) -> torch.Tensor | None:
    """bool [L, S] for queries at the last L of depths first_key_depth..first_key_depth+S-1 over those
    keys: causal along the path and within `window`; None when plain causal attention is the same."""
    L, S = num_queries, num_keys
    last_depth = first_key_depth + S - 1
    needs_window = window is not None and last_depth - first_key_depth >= window
    if L == S and not needs_window:
        return None
    q_depth = torch.arange(last_depth - L + 1, last_depth + 1, device=device)
    k_depth = torch.arange(first_key_depth, last_depth + 1, device=device)
    delta = q_depth[:, None] - k_depth[None, :]
    return (delta >= 0) & (delta < window) if needs_window else delta >= 0


def path_attention(q_HLd: torch.Tensor, k_HkSd: torch.Tensor, v_HkSd: torch.Tensor, mask_LS: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
    """Queries (the path's last L tokens) over the path's keys, GQA; mask None means causal, L == S."""
    out = F.scaled_dot_product_attention(q_HLd[None], k_HkSd[None], v_HkSd[None], attn_mask=mask_LS,
                                         is_causal=mask_LS is None, scale=scale, enable_gqa=True)
    return out[0]
