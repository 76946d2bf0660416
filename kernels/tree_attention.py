"""Tree attention over packed prefix tries: every token attends to its ancestors and to itself.

The unique tokens of one or more tries are packed in depth-first pre-order (several tries in one
sequence form a forest; a leading batch dim is packed into one forest too). In pre-order, token j is an
ancestor-or-self of token i exactly when j <= i < subtree_end[j], so one integer vector is the whole mask.
`tree_attention` runs a Triton flash-attention kernel (online softmax, blocks without a visible key
skipped, logsumexp saved for the recomputing backward kernels) on CUDA and a dense masked plain-torch
reference elsewhere. Grouped-query attention: query head h reads kv head h // (H // K).
Test: pytest tests/kernels/test_tree_attention.py (Triton runs under TRITON_INTERPRET=1 in a subprocess)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tailrace.kernels._triton import interpreting, jit, tl, use_triton

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ----------------------------------------------------------------------------------------- trie layout


def subtree_end_from_parents(parent_N: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """subtree_end_N (int64): one past the last pre-order index of each token's subtree.

    parent_N[i] is the index of token i's parent, -1 for a root. Raises ValueError unless the tokens
    are in depth-first pre-order, i.e. every parent is on the path from a root to the previous token.
    """
    parents = parent_N.tolist() if isinstance(parent_N, torch.Tensor) else list(parent_N)
    num_tokens = len(parents)
    end = [num_tokens] * num_tokens
    path: list[int] = []  # root-to-previous-token path; a token's subtree ends when it leaves the path
    for i, parent in enumerate(parents):
        if parent < -1:
            raise ValueError(f"parent_N[{i}] = {parent}: a parent is a token index or -1 for a root")
        while path and path[-1] != parent:
            end[path.pop()] = i
        if parent >= 0 and not path:
            raise ValueError(f"parent_N[{i}] = {parent} is not on the path to token {i - 1}: "
                             "tokens must be in depth-first pre-order")
        path.append(i)
    device = parent_N.device if isinstance(parent_N, torch.Tensor) else None
    return torch.tensor(end, dtype=torch.int64, device=device)


def mask_from_subtree_end(subtree_end_N: torch.Tensor) -> torch.Tensor:
    """Boolean mask_NN (or mask_BNN for subtree_end_BN): mask[i, j] is True iff query i sees key j."""
    num_tokens = subtree_end_N.shape[-1]
    idx = torch.arange(num_tokens, device=subtree_end_N.device)
    return (idx[None, :] <= idx[:, None]) & (idx[:, None] < subtree_end_N[..., None, :])


def check_subtree_end(subtree_end_N: torch.Tensor) -> None:
    """ValueError unless i < subtree_end[i] <= N for every token (every token must see itself)."""
    if subtree_end_N.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"subtree_end: expected int32 or int64, got {subtree_end_N.dtype}")
    num_tokens = subtree_end_N.shape[-1]
    idx = torch.arange(num_tokens, device=subtree_end_N.device)
    bad = (subtree_end_N <= idx) | (subtree_end_N > num_tokens)
    if bool(bad.any()):
        first = bad.reshape(-1, num_tokens).any(0).nonzero()[0].item()
        raise ValueError(f"subtree_end: token {first} must satisfy {first} < subtree_end <= {num_tokens}")


# ------------------------------------------------------------------------------------------ reference


def tree_attention_reference(
    q_HND: torch.Tensor, k_KND: torch.Tensor, v_KND: torch.Tensor, subtree_end_N: torch.Tensor, scale: float
) -> torch.Tensor:
    """Dense masked attention, O(H N^2) memory; float32 math for half inputs, float64 kept as is."""
    num_heads, num_kv_heads = q_HND.shape[0], k_KND.shape[0]
    compute = torch.promote_types(q_HND.dtype, torch.float32)
    k_HND = k_KND.to(compute).repeat_interleave(num_heads // num_kv_heads, dim=0)
    v_HND = v_KND.to(compute).repeat_interleave(num_heads // num_kv_heads, dim=0)
    scores_HNN = torch.einsum("hid,hjd->hij", q_HND.to(compute), k_HND) * scale
    scores_HNN = scores_HNN.masked_fill(~mask_from_subtree_end(subtree_end_N), float("-inf"))
    probs_HNN = torch.softmax(scores_HNN, dim=-1)
    return torch.einsum("hij,hjd->hid", probs_HNN, v_HND).to(q_HND.dtype)


# ------------------------------------------------------------------------------------- triton kernels


@jit
def _fwd_kernel(Q, K, V, SE, Out, LSE, N, D, scale, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    q_off = head.to(tl.int64) * N * D
    kv_off = (head // GROUP).to(tl.int64) * N * D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < N
    d_ok = offs_d < D
    rows = offs_m[:, None] * D + offs_d[None, :]
    q = tl.load(Q + q_off + rows, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    # Finite start: padded rows see no key and must not compute inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(start_m + BLOCK_M, N)  # keys after the block's last query are never visible
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        se = tl.load(SE + offs_n, mask=n_ok, other=0)
        if tl.max(se, axis=0) > start_m:  # else no key of this block is an ancestor of any query
            cols = offs_n[:, None] * D + offs_d[None, :]
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(K + kv_off + cols, mask=kv_mask, other=0.0)
            v = tl.load(V + kv_off + cols, mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_m[:, None] < se[None, :])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(Out + q_off + rows, out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(LSE + head.to(tl.int64) * N + offs_m, m_i + tl.log(l_safe), mask=m_ok)


@jit
def _bwd_dkdv_kernel(Q, K, V, SE, DO, LSE, DELTA, DK, DV, N, D, scale, GROUP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     PRECISION: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    kv_head = tl.program_id(1)
    kv_off = kv_head.to(tl.int64) * N * D
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < N
    d_ok = offs_d < D
    cols = offs_n[:, None] * D + offs_d[None, :]
    k = tl.load(K + kv_off + cols, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(V + kv_off + cols, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    se = tl.load(SE + offs_n, mask=n_ok, other=0)
    # Queries that see a key of this block lie in [start_n, max subtree_end of the block).
    lo = (start_n // BLOCK_M) * BLOCK_M
    hi = tl.max(se, axis=0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(0, GROUP):  # the query heads that share this kv head
        head = kv_head * GROUP + g
        q_off = head.to(tl.int64) * N * D
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_ok = offs_m < N
            rows = offs_m[:, None] * D + offs_d[None, :]
            q = tl.load(Q + q_off + rows, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            do = tl.load(DO + q_off + rows, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            lse = tl.load(LSE + head.to(tl.int64) * N + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + head.to(tl.int64) * N + offs_m, mask=m_ok, other=0.0)
            visible_t = (offs_n[:, None] <= offs_m[None, :]) & (offs_m[None, :] < se[:, None])
            s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * scale
            p_t = tl.where(visible_t, tl.exp(s_t - lse[None, :]), 0.0)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    mask = n_ok[:, None] & d_ok[None, :]
    tl.store(DK + kv_off + cols, (dk * scale).to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + kv_off + cols, dv.to(DV.dtype.element_ty), mask=mask)


@jit
def _bwd_dq_kernel(Q, K, V, SE, DO, LSE, DELTA, DQ, N, D, scale, GROUP: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                   PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    q_off = head.to(tl.int64) * N * D
    kv_off = (head // GROUP).to(tl.int64) * N * D
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < N
    d_ok = offs_d < D
    rows = offs_m[:, None] * D + offs_d[None, :]
    q = tl.load(Q + q_off + rows, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(DO + q_off + rows, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    lse = tl.load(LSE + head.to(tl.int64) * N + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + head.to(tl.int64) * N + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(start_m + BLOCK_M, N)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        se = tl.load(SE + offs_n, mask=n_ok, other=0)
        if tl.max(se, axis=0) > start_m:
            cols = offs_n[:, None] * D + offs_d[None, :]
            k = tl.load(K + kv_off + cols, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(V + kv_off + cols, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
            visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_m[:, None] < se[None, :])
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(DQ + q_off + rows, (dq * scale).to(DQ.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# ------------------------------------------------------------------------------------------ launchers


def _launch_config(head_dim: int, dtype: torch.dtype) -> dict:
    """Block sizes and dot precision. Small blocks under the interpreter so tiny tests span many blocks;
    fp32 inputs use IEEE dots so the packed path keeps the float32 gradient-equality tolerance."""
    block_d = max(16, 1 << max(0, (head_dim - 1).bit_length()))
    precision = "ieee" if dtype == torch.float32 else "tf32"
    if interpreting():
        return dict(block_m=16, block_n=16, block_d=block_d, precision=precision, num_warps=4)
    block = 64 if block_d <= 64 and dtype != torch.float32 else 32
    return dict(block_m=block, block_n=block, block_d=block_d, precision=precision,
                num_warps=4 if block_d <= 64 else 8)


def _triton_forward(q, k, v, subtree_end, scale):
    num_heads, num_tokens, head_dim = q.shape
    cfg = _launch_config(head_dim, q.dtype)
    out = torch.empty_like(q)
    lse = torch.empty((num_heads, num_tokens), device=q.device, dtype=torch.float32)
    grid = (_cdiv(num_tokens, cfg["block_m"]), num_heads)
    _fwd_kernel[grid](q, k, v, subtree_end, out, lse, num_tokens, head_dim, scale,
                      GROUP=num_heads // k.shape[0], BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
                      BLOCK_D=cfg["block_d"], PRECISION=cfg["precision"], num_warps=cfg["num_warps"])
    return out, lse


def _triton_backward(q, k, v, subtree_end, out, lse, grad_out, scale):
    num_heads, num_tokens, head_dim = q.shape
    num_kv_heads = k.shape[0]
    cfg = _launch_config(head_dim, q.dtype)
    delta = (out.float() * grad_out.float()).sum(-1)  # rowsum(dO * O): the softmax backward's correction
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(GROUP=num_heads // num_kv_heads, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
                  BLOCK_D=cfg["block_d"], PRECISION=cfg["precision"], num_warps=cfg["num_warps"])
    _bwd_dkdv_kernel[(_cdiv(num_tokens, cfg["block_n"]), num_kv_heads)](
        q, k, v, subtree_end, grad_out, lse, delta, dk, dv, num_tokens, head_dim, scale, **common)
    _bwd_dq_kernel[(_cdiv(num_tokens, cfg["block_m"]), num_heads)](
        q, k, v, subtree_end, grad_out, lse, delta, dq, num_tokens, head_dim, scale, **common)
    return dq, dk, dv


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _TreeAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, subtree_end, scale):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = _triton_forward(q, k, v, subtree_end, scale)
        ctx.save_for_backward(q, k, v, subtree_end, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, subtree_end, out, lse = ctx.saved_tensors
        dq, dk, dv = _triton_backward(q, k, v, subtree_end, out, lse, grad_out.contiguous(), ctx.scale)
        return dq, dk, dv, None, None


# ----------------------------------------------------------------------------------------- dispatcher


def tree_attention(
    q_HND: torch.Tensor,
    k_KND: torch.Tensor,
    v_KND: torch.Tensor,
    subtree_end_N: torch.Tensor,
    *,
    scale: float | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Attention of each packed token to its ancestors and itself; returns out_HND (q's dtype).

    Also accepts q_BHND, k_BKND, v_BKND, subtree_end_BN: the batch rows are packed into one forest.
    impl: "auto" (Triton on CUDA for float16/bfloat16/float32, else the reference), "triton", "reference".
    subtree_end on the CPU is validated; on CUDA it is trusted (build it with subtree_end_from_parents).
    """
    if impl not in ("auto", "triton", "reference"):
        raise ValueError(f"tree_attention: impl must be 'auto', 'triton' or 'reference', got {impl!r}")
    batched = q_HND.dim() == 4
    q, k, v, subtree_end = _as_forest(q_HND, k_KND, v_KND, subtree_end_N) if batched else (
        q_HND, k_KND, v_KND, subtree_end_N)
    _check_inputs(q, k, v, subtree_end)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    triton_ok = use_triton(impl, q.device, "tree_attention") and q.shape[1] > 0  # no empty launch grid
    if triton_ok and q.dtype not in TRITON_DTYPES:
        if impl == "triton":
            raise ValueError(f"tree_attention: the Triton kernel takes {TRITON_DTYPES}, got {q.dtype}")
        triton_ok = False
    if triton_ok:
        out = _TreeAttentionTriton.apply(q, k, v, subtree_end.to(torch.int32).contiguous(), scale)
    else:
        out = tree_attention_reference(q, k, v, subtree_end, scale)
    if batched:
        batch, num_heads, num_tokens, head_dim = q_HND.shape
        out = out.reshape(num_heads, batch, num_tokens, head_dim).transpose(0, 1)
    return out


def _as_forest(q_BHND, k_BKND, v_BKND, subtree_end_BN):
    """Batch rows become consecutive tries of one forest: no token sees another row's tokens."""
    batch, num_heads, num_tokens, head_dim = q_BHND.shape
    if k_BKND.dim() != 4 or v_BKND.dim() != 4 or subtree_end_BN.shape != (batch, num_tokens):
        raise ValueError("tree_attention: with a batch dim, pass q_BHND, k_BKND, v_BKND, subtree_end_BN")
    offsets_B1 = torch.arange(batch, device=subtree_end_BN.device)[:, None] * num_tokens
    if subtree_end_BN.device.type == "cpu":
        check_subtree_end(subtree_end_BN)

    def flat(x_BXND: torch.Tensor) -> torch.Tensor:
        return x_BXND.transpose(0, 1).reshape(x_BXND.shape[1], batch * num_tokens, head_dim)

    return flat(q_BHND), flat(k_BKND), flat(v_BKND), (subtree_end_BN + offsets_B1).reshape(-1)


def _check_inputs(q, k, v, subtree_end) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"tree_attention: expected q_HND, k_KND, v_KND, got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    (num_heads, num_tokens, head_dim), num_kv_heads = q.shape, k.shape[0]
    if k.shape != v.shape or k.shape[1:] != (num_tokens, head_dim):
        raise ValueError(f"tree_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                         f"[K, {num_tokens}, {head_dim}]")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"tree_attention: {num_heads} query heads are not a multiple of "
                         f"{num_kv_heads} kv heads")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"tree_attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if subtree_end.device != q.device:
        raise ValueError(f"tree_attention: subtree_end is on {subtree_end.device}, q on {q.device}")
    if subtree_end.shape != (num_tokens,):
        raise ValueError(f"tree_attention: subtree_end_N must have shape ({num_tokens},), "
                         f"got {tuple(subtree_end.shape)}")
    if subtree_end.device.type == "cpu":
        check_subtree_end(subtree_end)
