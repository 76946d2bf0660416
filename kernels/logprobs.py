"""Log-probs (and entropies) of labels from final hidden states and the LM head, a chunk of rows at a time.

The full [N, V] logits never exist: forward keeps one [chunk, V] float32 block, reduces it to log-prob,
logsumexp and entropy per row, and drops it; backward recomputes each chunk's logits, turns them into
d(loss)/d(logits) in place, and multiplies into the hidden, weight (and bias) gradients. The entropy's
gradient is included when the entropy is used in the loss. The per-chunk reduction and gradient are
Triton kernels on CUDA ("triton") and plain torch elsewhere ("torch"); the LM-head matmuls stay torch.
"reference" is the plain full-logits computation under autograd, for tests.
Test: pytest tests/kernels/test_logprobs.py (Triton runs under TRITON_INTERPRET=1 in a subprocess)
"""

from __future__ import annotations

import torch

from tailrace.kernels._triton import interpreting, jit, tl, use_triton

IMPLS = ("auto", "triton", "torch", "reference")


# ------------------------------------------------------------------------------------- triton kernels


@jit
def _stats_kernel(LOGITS, LABELS, TEMP, LOGP, ENT, LSE, V, stride_row, temp_stride, ignore_index,
                  BLOCK_V: tl.constexpr):
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride_row
    temp = tl.load(TEMP + row * temp_stride).to(tl.float32)
    # Online over the vocabulary: running max m, s = sum e^(z-m), u = sum e^(z-m) (z-m).
    m = tl.full([], -1.0e30, tl.float32)  # finite so that the first rescale is 0 * finite
    s = tl.zeros([], tl.float32)
    u = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temp
        m_new = tl.maximum(m, tl.max(z, axis=0))
        rescale = tl.exp(m - m_new)
        e = tl.exp(z - m_new)
        zc = tl.where(e > 0, z - m_new, 0.0)  # padding and -inf logits add nothing (not 0 * -inf)
        u = rescale * (u - (m_new - m) * s) + tl.sum(e * zc, axis=0)
        s = rescale * s + tl.sum(e, axis=0)
        m = m_new
    lse = m + tl.log(s)
    label = tl.load(LABELS + row)
    valid = label != ignore_index
    z_label = tl.load(base + label, mask=valid, other=0.0).to(tl.float32) / temp
    tl.store(LOGP + row, tl.where(valid, z_label - lse, 0.0))
    tl.store(ENT + row, tl.log(s) - u / s)  # -sum p log p with log p = (z - m) - log s
    tl.store(LSE + row, lse)


@jit
def _grad_kernel(LOGITS, LABELS, TEMP, LSE, ENT, GLOGP, GENT, V, stride_row, temp_stride, ignore_index,
                 HAS_GLOGP: tl.constexpr, HAS_GENT: tl.constexpr, BLOCK_V: tl.constexpr):
    # Overwrites the row's logits with d(loss)/d(logits).
    row = tl.program_id(0)
    base = LOGITS + row.to(tl.int64) * stride_row
    temp = tl.load(TEMP + row * temp_stride).to(tl.float32)
    lse = tl.load(LSE + row)
    label = tl.load(LABELS + row)
    g_logp = tl.zeros([], tl.float32)
    if HAS_GLOGP:
        g_logp = tl.where(label != ignore_index, tl.load(GLOGP + row).to(tl.float32), 0.0)
    g_ent = tl.zeros([], tl.float32)
    ent = tl.zeros([], tl.float32)
    if HAS_GENT:
        g_ent = tl.load(GENT + row).to(tl.float32)
        ent = tl.load(ENT + row)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        ok = offs < V
        logp = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32) / temp - lse
        p = tl.exp(logp)
        # d logp[label] / dz = onehot - p;  d entropy / dz = -p (log p + entropy)
        g = g_logp * (tl.where(offs == label, 1.0, 0.0) - p)
        g -= g_ent * tl.where(p > 0, p * (logp + ent), 0.0)
        tl.store(base + offs, (g / temp).to(LOGITS.dtype.element_ty), mask=ok)


def _block_v(vocab: int) -> int:
    # Small blocks under the interpreter so that tiny test vocabularies span several blocks.
    return min(64 if interpreting() else 4096, max(16, 1 << max(0, (vocab - 1).bit_length())))


def _stats_triton(logits_CV, labels_C, temp_C, ignore_index, with_entropy=True):
    num_rows, vocab = logits_CV.shape
    logp, ent, lse = (torch.empty(num_rows, device=logits_CV.device, dtype=torch.float32) for _ in range(3))
    _stats_kernel[(num_rows,)](logits_CV, labels_C, temp_C, logp, ent, lse, vocab, logits_CV.stride(0),
                               temp_C.stride(0), ignore_index, BLOCK_V=_block_v(vocab))
    return logp, ent, lse


def _grad_triton(logits_CV, labels_C, temp_C, lse_C, ent_C, g_logp_C, g_ent_C, ignore_index):
    num_rows, vocab = logits_CV.shape
    _grad_kernel[(num_rows,)](
        logits_CV, labels_C, temp_C, lse_C, ent_C,
        g_logp_C if g_logp_C is not None else lse_C, g_ent_C if g_ent_C is not None else lse_C,
        vocab, logits_CV.stride(0), temp_C.stride(0), ignore_index,
        HAS_GLOGP=g_logp_C is not None, HAS_GENT=g_ent_C is not None, BLOCK_V=_block_v(vocab))
    return logits_CV


# ------------------------------------------------------------------------------ per-chunk torch math


def _stats_torch(logits_CV, labels_C, temp_C, ignore_index, with_entropy=True):
    z_CV = logits_CV / temp_C[:, None]  # division, as the generator scales its logits
    lse_C = torch.logsumexp(z_CV, dim=-1)
    valid_C = labels_C != ignore_index
    z_label_C = z_CV.gather(-1, torch.where(valid_C, labels_C, 0)[:, None]).squeeze(-1)
    logp_C = torch.where(valid_C, z_label_C - lse_C, 0.0)
    ent_C = lse_C - (torch.softmax(z_CV, dim=-1) * z_CV).sum(-1) if with_entropy else torch.zeros_like(lse_C)
    return logp_C, ent_C, lse_C


def _grad_torch(logits_CV, labels_C, temp_C, lse_C, ent_C, g_logp_C, g_ent_C, ignore_index):
    logp_CV = logits_CV / temp_C[:, None] - lse_C[:, None]
    p_CV = logp_CV.exp()
    grad_CV = torch.zeros_like(logits_CV)
    if g_logp_C is not None:
        valid_C = labels_C != ignore_index
        g_C = torch.where(valid_C, g_logp_C.to(grad_CV.dtype), 0.0)
        grad_CV -= p_CV * g_C[:, None]
        grad_CV.scatter_add_(-1, torch.where(valid_C, labels_C, 0)[:, None], g_C[:, None])
    if g_ent_C is not None:
        grad_CV -= g_ent_C.to(grad_CV.dtype)[:, None] * p_CV * (logp_CV + ent_C[:, None])
    return grad_CV / temp_C[:, None]


# ------------------------------------------------------------------------------------ autograd function


def _chunk_logits(hidden_CD, weight_VD, bias_V, stat_dtype):
    logits_CV = hidden_CD @ weight_VD.T if bias_V is None else torch.addmm(bias_V, hidden_CD, weight_VD.T)
    return logits_CV.to(stat_dtype)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temp, chunk_size, ignore_index, triton, with_entropy):
        stat_dtype = torch.promote_types(hidden.dtype, torch.float32)
        stats, num_rows = (_stats_triton if triton else _stats_torch), hidden.shape[0]
        logp, ent, lse = (torch.empty(num_rows, device=hidden.device, dtype=stat_dtype) for _ in range(3))
        for start in range(0, num_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            logits_CV = _chunk_logits(hidden[rows], weight, bias, stat_dtype)
            logp[rows], ent[rows], lse[rows] = stats(logits_CV, labels[rows], temp[rows], ignore_index,
                                                         with_entropy)
            del logits_CV  # free before the next chunk's matmul allocates
        ctx.save_for_backward(hidden, weight, bias, labels, temp, lse, ent)
        ctx.chunk_size, ctx.ignore_index, ctx.triton = chunk_size, ignore_index, triton
        ctx.set_materialize_grads(False)  # an unused entropy output gets no gradient pass
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, labels, temp, lse, ent = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if g_logp is None and g_ent is None:
            return (None,) * 9
        grad_fn = _grad_triton if ctx.triton else _grad_torch
        # Accumulate the weight gradient in at least float32 across chunks, whatever the weight dtype.
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=acc_dtype) if need_w else None
        grad_b = torch.zeros(weight.shape[0], device=weight.device, dtype=acc_dtype) if need_b else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            logits_CV = _chunk_logits(hidden[rows], weight, bias, lse.dtype)
            grad_CV = grad_fn(logits_CV, labels[rows], temp[rows], lse[rows], ent[rows],
                              None if g_logp is None else g_logp[rows],
                              None if g_ent is None else g_ent[rows], ctx.ignore_index)
            if need_b:
                grad_b += grad_CV.sum(0)
            grad_CV = grad_CV.to(weight.dtype)
            if need_h:
                grad_h[rows] = grad_CV @ weight
            if need_w:
                grad_w += (grad_CV.T @ hidden[rows]).to(acc_dtype)
            del logits_CV, grad_CV
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype)) + (None,) * 6


# ----------------------------------------------------------------------------------------- public API


def logprobs_reference(hidden_ND, weight_VD, labels_N, *, bias_V=None, temperature=1.0,
                       ignore_index=-100):
    """Plain full-logits computation under autograd: (logprobs_N, entropy_N), float32 or float64."""
    logits_NV = torch.nn.functional.linear(hidden_ND, weight_VD, bias_V)
    logits_NV = logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32))
    temp_N = _temperature(temperature, labels_N.shape[0], logits_NV)
    logp_NV = torch.log_softmax(logits_NV / temp_N[:, None], dim=-1)
    valid_N = labels_N != ignore_index
    logp_N = logp_NV.gather(-1, torch.where(valid_N, labels_N, 0)[:, None]).squeeze(-1)
    entropy_N = -(logp_NV.exp() * logp_NV).sum(-1)
    return torch.where(valid_N, logp_N, 0.0), entropy_N


def chunked_logprobs(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_N: torch.Tensor,
    *,
    bias_V: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    chunk_size: int = 1024,
    return_entropy: bool = False,
    ignore_index: int = -100,
    impl: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax((hidden @ weight.T + bias) / temperature)[label] per row, and its entropy if asked.

    hidden_ND may have any leading dims ([..., D] with labels [...]); temperature is a float or a
    per-row tensor (no gradient). Rows whose label is ignore_index get log-prob 0 and no log-prob
    gradient. Results are float32 (float64 for float64 inputs). impl: "auto" (Triton on CUDA, else
    "torch"), "triton", "torch" (chunked, plain-torch per chunk), "reference" (full logits).
    """
    if impl not in IMPLS:
        raise ValueError(f"chunked_logprobs: impl must be one of {IMPLS}, got {impl!r}")
    if chunk_size < 1:
        raise ValueError(f"chunked_logprobs: chunk_size must be >= 1, got {chunk_size}")
    lead_shape = hidden_ND.shape[:-1]
    hidden, labels = hidden_ND.reshape(-1, hidden_ND.shape[-1]), labels_N.reshape(-1)
    _check_inputs(hidden, weight_VD, labels, bias_V, lead_shape, labels_N.shape, ignore_index)
    if impl == "reference":
        logp, ent = logprobs_reference(hidden, weight_VD, labels, bias_V=bias_V, temperature=temperature,
                                       ignore_index=ignore_index)
    else:
        stat_dtype = torch.promote_types(hidden.dtype, torch.float32)
        # The Triton kernels reduce in float32: "auto" keeps float64 on the torch path.
        triton = impl in ("auto", "triton") and use_triton(impl, hidden.device, "chunked_logprobs") and (
            impl == "triton" or stat_dtype == torch.float32)
        temp = _temperature(temperature, labels.shape[0], hidden.new_empty(0, dtype=stat_dtype))
        logp, ent = _ChunkedLogprobs.apply(hidden, weight_VD, bias_V, labels, temp, int(chunk_size),
                                           int(ignore_index), triton, return_entropy)
        if triton and stat_dtype != torch.float32:
            logp, ent = logp.to(stat_dtype), ent.to(stat_dtype)
    logp = logp.reshape(lead_shape)
    return (logp, ent.reshape(lead_shape)) if return_entropy else logp


def _temperature(temperature, num_rows: int, like: torch.Tensor) -> torch.Tensor:
    """Per-row temperature_N in like's dtype and device; a float becomes a stride-0 expansion."""
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() not in (1, num_rows):
            raise ValueError(f"temperature: expected a float or {num_rows} per-row values, "
                             f"got shape {tuple(temperature.shape)}")
        return temperature.detach().to(like.device, like.dtype).reshape(-1).expand(num_rows)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return torch.full((1,), float(temperature), device=like.device, dtype=like.dtype).expand(num_rows)


def _check_inputs(hidden, weight, labels, bias, lead_shape, labels_shape, ignore_index) -> None:
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"chunked_logprobs: weight_VD {tuple(weight.shape)} does not match hidden "
                         f"dim {hidden.shape[1]}")
    if labels_shape != lead_shape:
        raise ValueError(f"chunked_logprobs: labels shape {tuple(labels_shape)} != hidden rows "
                         f"{tuple(lead_shape)}")
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"chunked_logprobs: hidden, weight (and bias) dtypes differ: {hidden.dtype}, "
                         f"{weight.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"chunked_logprobs: bias_V shape {tuple(bias.shape)} != ({weight.shape[0]},)")
    if labels.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"chunked_logprobs: labels must be int32 or int64, got {labels.dtype}")
    bad = ((labels < 0) | (labels >= weight.shape[0])) & (labels != ignore_index)
    if labels.numel() and bool(bad.any()):  # one device sync per call, against silent garbage
        raise ValueError(f"chunked_logprobs: labels outside [0, {weight.shape[0]}) other than "
                         f"ignore_index={ignore_index}")
