"""Tree attention: trie layout helpers, the reference against independent dense and per-path attention
(float64, forward and backward), and the Triton kernels against the reference.

The Triton tests (`test_under_interpreter_*`) run only inside a subprocess that this module starts with
TRITON_INTERPRET=1, because Triton reads that variable when kernels are decorated (at import), so it
must be set before `kernels` is imported and must not leak into the other test modules.
Run: pytest tests/kernels/test_tree_attention.py [-m slow] [-m gpu]
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.kernels._triton import interpreting
from tailrace.kernels.tree_attention import (
    mask_from_subtree_end,
    subtree_end_from_parents,
    tree_attention,
    tree_attention_reference,
)

ROOT = Path(__file__).resolve().parents[2]
SUBPROCESS_FLAG = "TAILRACE_KERNEL_INTERPRETER_SUBPROCESS"
IN_SUBPROCESS = os.environ.get(SUBPROCESS_FLAG) == "1" and interpreting()
under_interpreter = pytest.mark.skipif(not IN_SUBPROCESS, reason="runs in the interpreter subprocess")


# -------------------------------------------------------------------------------------------- helpers


def random_parents(rng: random.Random, num_tokens: int, p_extend: float = 0.6,
                   p_root: float = 0.05) -> list[int]:
    """A random pre-order forest: each token extends the previous one, branches off any token on the
    current path, or starts a new trie. Covers chains, one-token segments, wide fans and forests."""
    parents: list[int] = []
    path: list[int] = []
    for i in range(num_tokens):
        u = rng.random()
        if not path or u < p_root:
            path = []
        elif u >= p_root + p_extend:
            del path[rng.randrange(len(path)) + 1:]
        parents.append(path[-1] if path else -1)
        path.append(i)
    return parents


@st.composite
def forests(draw, max_tokens: int = 24) -> list[int]:
    parents: list[int] = []
    path: list[int] = []
    for i in range(draw(st.integers(1, max_tokens))):
        keep = draw(st.integers(0, len(path)))  # 0: a new root; len(path): extend the previous token
        del path[keep:]
        parents.append(path[-1] if path else -1)
        path.append(i)
    return parents


def ancestors_or_self(parents: list[int], i: int) -> list[int]:
    chain = []
    while i >= 0:
        chain.append(i)
        i = parents[i]
    return chain[::-1]


def leaves(parents: list[int]) -> list[int]:
    has_child = {p for p in parents if p >= 0}
    return [i for i in range(len(parents)) if i not in has_child]


def qkv(num_heads, num_kv_heads, num_tokens, head_dim, dtype=torch.float64, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(num_heads, num_tokens, head_dim)] + [(num_kv_heads, num_tokens, head_dim)] * 2
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(device, dtype).requires_grad_()
            for s in shapes]


def grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


# --------------------------------------------------------------------------------------- trie layout


def test_subtree_end_example():
    #   0 -> 1 -> {2, 3}, 0 -> 4;  5 -> 6   (two tries)
    assert subtree_end_from_parents([-1, 0, 1, 1, 0, -1, 5]).tolist() == [5, 4, 3, 4, 5, 7, 7]
    assert subtree_end_from_parents(torch.tensor([-1, -1, -1])).tolist() == [1, 2, 3]
    assert subtree_end_from_parents([]).tolist() == []


@pytest.mark.parametrize("parents", [[-1, 0, -1, 1], [-1, 1], [-1, 0, 1, 0, 2], [-2], [0]])
def test_subtree_end_rejects_non_preorder(parents):
    with pytest.raises(ValueError, match="parent"):
        subtree_end_from_parents(parents)


@settings(max_examples=60, deadline=None)
@given(forests(max_tokens=30))
def test_mask_is_ancestor_relation(parents):
    mask = mask_from_subtree_end(subtree_end_from_parents(parents))
    expected = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i in range(len(parents)):
        expected[i, ancestors_or_self(parents, i)] = True
    assert torch.equal(mask, expected)


# ------------------------------------------------------------------------------------------ reference


@settings(max_examples=25, deadline=None)
@given(forests(), st.sampled_from([(1, 1), (4, 2), (4, 1), (3, 3)]), st.integers(0, 2**16))
def test_reference_matches_dense_attention_from_parents(parents, heads, seed):
    num_heads, num_kv_heads = heads
    q, k, v = qkv(num_heads, num_kv_heads, len(parents), 8, seed=seed)
    scale = 0.3
    out = tree_attention(q, k, v, subtree_end_from_parents(parents), scale=scale, impl="reference")
    mask = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for i in range(len(parents)):
        mask[i, ancestors_or_self(parents, i)] = True
    group = num_heads // num_kv_heads
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0),
                                              attn_mask=mask, scale=scale)
    grad_out = torch.randn_like(out)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads(out, (q, k, v), grad_out), grads(expected, (q, k, v), grad_out), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


def per_path_attention(q, k, v, parents, scale):
    """Every root-to-leaf path as an ordinary causal sequence; each token's output taken from the first
    path that contains it. Differentiable, independent of subtree_end."""
    group = q.shape[0] // k.shape[0]
    rows: dict[int, torch.Tensor] = {}
    for leaf in leaves(parents):
        path = ancestors_or_self(parents, leaf)
        out_HPD = F.scaled_dot_product_attention(
            q[:, path], k[:, path].repeat_interleave(group, 0), v[:, path].repeat_interleave(group, 0),
            is_causal=True, scale=scale)
        for pos, token in enumerate(path):
            rows.setdefault(token, out_HPD[:, pos])
    return torch.stack([rows[i] for i in range(len(parents))], dim=1)


@settings(max_examples=25, deadline=None)
@given(forests(), st.sampled_from([(2, 1), (4, 2), (2, 2)]), st.integers(0, 2**16))
def test_reference_matches_per_path_causal_attention(parents, heads, seed):
    q, k, v = qkv(*heads, len(parents), 8, seed=seed)
    out = tree_attention(q, k, v, subtree_end_from_parents(parents), impl="reference")
    expected = per_path_attention(q, k, v, parents, scale=8**-0.5)
    grad_out = torch.randn_like(out)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads(out, (q, k, v), grad_out), grads(expected, (q, k, v), grad_out), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


def test_batch_dim_is_a_forest_of_its_rows():
    rng = random.Random(3)
    parents = [random_parents(rng, 12) for _ in range(3)]
    subtree_end_BN = torch.stack([subtree_end_from_parents(p) for p in parents])
    q, k, v = (x.detach() for x in qkv(4, 2, 3 * 12, 8, seed=1))
    q_BHND, k_BKND, v_BKND = (x.reshape(x.shape[0], 3, 12, 8).transpose(0, 1) for x in (q, k, v))
    out_BHND = tree_attention(q_BHND, k_BKND, v_BKND, subtree_end_BN, impl="reference")
    for b in range(3):
        alone = tree_attention(q_BHND[b], k_BKND[b], v_BKND[b], subtree_end_BN[b], impl="reference")
        torch.testing.assert_close(out_BHND[b], alone, rtol=1e-12, atol=1e-12)


def test_bad_inputs_raise_value_error():
    q, k, v = (x.detach() for x in qkv(4, 2, 5, 8))
    subtree_end = subtree_end_from_parents([-1, 0, 1, 0, -1])
    with pytest.raises(ValueError, match="subtree_end"):
        tree_attention(q, k, v, torch.tensor([1, 1, 3, 4, 5]))  # token 1 would not see itself
    with pytest.raises(ValueError, match="subtree_end"):
        tree_attention(q, k, v, torch.tensor([6, 2, 3, 4, 5]))
    with pytest.raises(ValueError, match="multiple"):
        kv = torch.zeros(3, 5, 8, dtype=q.dtype)
        tree_attention(q, kv, kv, subtree_end)
    with pytest.raises(ValueError, match="impl"):
        tree_attention(q, k, v, subtree_end, impl="flash")


@pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET is set in this process")
def test_forced_triton_on_cpu_says_why():
    q, k, v = (x.detach() for x in qkv(2, 1, 3, 16, dtype=torch.float32))
    with pytest.raises(ValueError, match="TRITON_INTERPRET|not installed"):
        tree_attention(q, k, v, subtree_end_from_parents([-1, 0, 0]), impl="triton")


# ------------------------------------------------------------------- triton kernels, CPU interpreter


@pytest.mark.skipif(IN_SUBPROCESS, reason="this is the subprocess")
def test_triton_kernels_in_interpreter_subprocess(run_interpreter):
    run_interpreter(__file__, "not slow and not gpu", timeout_s=240)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(IN_SUBPROCESS, reason="this is the subprocess")
def test_triton_kernels_in_interpreter_subprocess_slow(run_interpreter):
    run_interpreter(__file__, "slow and not gpu", timeout_s=1700)


def check_triton_against_reference(parents, num_heads, num_kv_heads, head_dim, dtype, seed, device="cpu",
                                   tol=2e-5, norm_wise=False):
    """Triton forward and backward against the float64 reference on the same (rounded) inputs;
    elementwise, or with norm_wise the relative error of each whole tensor (half precision on GPU)."""
    subtree_end = subtree_end_from_parents(parents).to(device)
    q, k, v = qkv(num_heads, num_kv_heads, len(parents), head_dim, dtype=dtype, seed=seed, device=device)
    out = tree_attention(q, k, v, subtree_end, impl="triton")
    assert out.dtype == dtype and out.shape == q.shape
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    expected = tree_attention_reference(q64, k64, v64, subtree_end, head_dim**-0.5)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    got = (out,) + grads(out, (q, k, v), grad_out)
    want = (expected,) + grads(expected, (q64, k64, v64), grad_out.double())
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        if norm_wise:
            rel_err = ((g.double() - w).norm() / w.norm()).item()
            assert rel_err < tol, f"{name}: relative error {rel_err:.2e}"
        else:
            torch.testing.assert_close(g.double(), w, rtol=tol, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


INTERPRETER_CASES = {
    # name: (parents, H, K, D)
    "one_token": ([-1], 2, 1, 16),
    "branchy_gqa": (random_parents(random.Random(0), 37), 4, 2, 32),
    "forest_mha_non_pow2_dim": (random_parents(random.Random(1), 33, p_root=0.15), 3, 3, 24),
    "chain_is_causal": (list(range(-1, 39)), 2, 1, 16),
    "all_roots": ([-1] * 20, 2, 2, 16),
    "fan_of_one_token_segments": ([-1] + [0] * 30, 4, 1, 16),
}


@under_interpreter
@pytest.mark.parametrize("case", sorted(INTERPRETER_CASES))
def test_under_interpreter_matches_reference(case):
    parents, num_heads, num_kv_heads, head_dim = INTERPRETER_CASES[case]
    check_triton_against_reference(parents, num_heads, num_kv_heads, head_dim, torch.float32, seed=7)


@under_interpreter
def test_under_interpreter_float16_and_batch_dim():
    # float16, not bfloat16: the interpreter's bfloat16 tl.dot returns garbage (Triton 3.9); the GPU
    # tests cover bfloat16.
    check_triton_against_reference(random_parents(random.Random(2), 20), 2, 1, 16, torch.float16, seed=3,
                                   tol=1e-2)
    subtree_end_BN = torch.stack([subtree_end_from_parents(random_parents(random.Random(s), 18))
                                  for s in (4, 5)])
    q, k, v = (x.detach().float().reshape(x.shape[0], 2, 18, 16).transpose(0, 1) for x in qkv(2, 1, 36, 16))
    torch.testing.assert_close(tree_attention(q, k, v, subtree_end_BN, impl="triton"),
                               tree_attention(q, k, v, subtree_end_BN, impl="reference"),
                               rtol=2e-5, atol=2e-5)


@under_interpreter
@pytest.mark.slow
@pytest.mark.parametrize("seed", range(16))
def test_under_interpreter_random_tries_slow(seed):
    rng = random.Random(100 + seed)
    num_kv_heads = rng.choice([1, 2])
    parents = random_parents(rng, rng.randrange(40, 300), p_extend=rng.uniform(0.3, 0.9),
                             p_root=rng.choice([0.0, 0.02, 0.1]))
    check_triton_against_reference(parents, num_kv_heads * rng.choice([1, 2]), num_kv_heads,
                                   rng.choice([16, 32, 64, 128]), torch.float32, seed=seed)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_on_gpu_matches_reference(head_dim, dtype):
    rng = random.Random(head_dim)
    parents = random_parents(rng, 700, p_extend=0.8, p_root=0.01)
    half = dtype != torch.float32
    check_triton_against_reference(parents, 8, 2, head_dim, dtype, seed=head_dim, device="cuda",
                                   tol=2e-2 if half else 1e-4, norm_wise=half)
