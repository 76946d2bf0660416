"""Chunked log-probs: the chunked path against the plain full-logits computation, forward and backward
(log-probs, entropy in the loss, temperature, bias, ignored labels, chunk sizes that do not divide N),
the reference against torch's own cross-entropy and Categorical entropy, and the Triton kernels.

The Triton tests (`test_under_interpreter_*`) run only inside a subprocess that this module starts with
TRITON_INTERPRET=1 (Triton reads it when kernels are decorated, at import; it must not leak elsewhere).
Run: pytest tests/kernels/test_logprobs.py [-m slow] [-m gpu]
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import tailrace.kernels.logprobs as logprobs_module
from tailrace.kernels._triton import interpreting
from tailrace.kernels.logprobs import chunked_logprobs, logprobs_reference

ROOT = Path(__file__).resolve().parents[2]
SUBPROCESS_FLAG = "TAILRACE_KERNEL_INTERPRETER_SUBPROCESS"
IN_SUBPROCESS = os.environ.get(SUBPROCESS_FLAG) == "1" and interpreting()
under_interpreter = pytest.mark.skipif(not IN_SUBPROCESS, reason="runs in the interpreter subprocess")


def make_inputs(num_rows, dim, vocab, *, dtype=torch.float64, seed=0, bias=False, per_row_temp=False,
                num_ignored=0, weight_std=1.0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        x = torch.randn(*shape, generator=gen, dtype=torch.float64) * std
        return x.to(device, dtype).requires_grad_()

    hidden, weight = randn(num_rows, dim), randn(vocab, dim, std=weight_std)
    labels = torch.randint(0, vocab, (num_rows,), generator=gen)
    labels[torch.randperm(num_rows, generator=gen)[:num_ignored]] = -100
    temperature = (torch.rand(num_rows, generator=gen, dtype=torch.float64) + 0.5).to(device, dtype) \
        if per_row_temp else 0.7
    return dict(hidden_ND=hidden, weight_VD=weight, labels_N=labels.to(device), temperature=temperature,
                bias_V=randn(vocab) if bias else None)


def loss_and_grads(inputs, impl, *, with_entropy=True, chunk_size=1024, seed=1):
    logp, ent = chunked_logprobs(**inputs, chunk_size=chunk_size, return_entropy=True, impl=impl)
    gen = torch.Generator().manual_seed(seed)
    w_logp, w_ent = (torch.randn(logp.shape, generator=gen, dtype=torch.float64).to(logp) for _ in range(2))
    loss = (w_logp * logp).sum() + ((w_ent * ent).sum() if with_entropy else 0.0)
    params = [inputs[name] for name in PARAMS if inputs[name] is not None]
    return logp.detach(), ent.detach(), torch.autograd.grad(loss, params)


PARAMS = ("hidden_ND", "weight_VD", "bias_V")


def assert_same(got, want, tol, norm_wise=False):
    """Elementwise closeness, or (for half precision on GPU) relative error of the whole tensor."""
    for g, w in zip(got[:2] + tuple(got[2]), want[:2] + tuple(want[2]), strict=True):
        if norm_wise:
            assert ((g.double() - w.double()).norm() / w.double().norm()).item() < tol
        else:
            torch.testing.assert_close(g.double(), w.double(), rtol=tol, atol=tol)


# ------------------------------------------------------------------------------ reference and torch


def test_reference_matches_cross_entropy_and_categorical_entropy():
    inputs = make_inputs(9, 6, 11, bias=True, per_row_temp=True, num_ignored=2)
    logp, ent = logprobs_reference(**inputs)
    logits = F.linear(inputs["hidden_ND"], inputs["weight_VD"], inputs["bias_V"])
    logits = logits / inputs["temperature"][:, None]
    torch.testing.assert_close(logp, -F.cross_entropy(logits, inputs["labels_N"], reduction="none"))
    torch.testing.assert_close(ent, torch.distributions.Categorical(logits=logits).entropy())


@settings(max_examples=30, deadline=None)
@given(num_rows=st.integers(1, 40), vocab=st.integers(2, 70), chunk_size=st.integers(1, 17),
       bias=st.booleans(), per_row_temp=st.booleans(), with_entropy=st.booleans(),
       num_ignored=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_chunked_matches_full_logits_float64(num_rows, vocab, chunk_size, bias, per_row_temp, with_entropy,
                                             num_ignored, seed):
    inputs = make_inputs(num_rows, 8, vocab, seed=seed, bias=bias, per_row_temp=per_row_temp,
                         num_ignored=min(num_ignored, num_rows))
    got = loss_and_grads(inputs, "torch", with_entropy=with_entropy, chunk_size=chunk_size)
    want = loss_and_grads(inputs, "reference", with_entropy=with_entropy)
    assert_same(got, want, tol=1e-11)


def test_chunked_float32_and_leading_dims():
    inputs = make_inputs(24, 16, 50, dtype=torch.float32, bias=True)
    got = loss_and_grads(inputs, "torch", chunk_size=7)
    want = loss_and_grads(inputs, "reference")
    assert got[0].dtype == torch.float32
    assert_same(got, want, tol=1e-5)
    hidden_BTD, labels_BT = inputs["hidden_ND"].reshape(4, 6, 16), inputs["labels_N"].reshape(4, 6)
    logp_BT = chunked_logprobs(hidden_BTD, inputs["weight_VD"], labels_BT, bias_V=inputs["bias_V"],
                               temperature=0.7, chunk_size=5, impl="auto")
    torch.testing.assert_close(logp_BT, got[0].reshape(4, 6))


def test_log_probs_alone_and_weight_only_gradients():
    inputs = make_inputs(13, 8, 21, num_ignored=3)
    inputs["hidden_ND"] = inputs["hidden_ND"].detach()
    logp = chunked_logprobs(**inputs, chunk_size=4)
    (grad_w,) = torch.autograd.grad(logp.sum(), inputs["weight_VD"])
    logp_ref, _ = logprobs_reference(**inputs)
    (grad_w_ref,) = torch.autograd.grad(logp_ref.sum(), inputs["weight_VD"])
    torch.testing.assert_close(logp, logp_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad_w, grad_w_ref, rtol=1e-12, atol=1e-12)
    assert (logp[inputs["labels_N"] == -100] == 0).all()


def test_never_more_than_one_chunk_of_logits(monkeypatch):
    seen_rows = []
    real = logprobs_module._chunk_logits

    def spy(hidden_CD, *args):
        seen_rows.append(hidden_CD.shape[0])
        return real(hidden_CD, *args)

    monkeypatch.setattr(logprobs_module, "_chunk_logits", spy)
    inputs = make_inputs(23, 8, 30)
    loss_and_grads(inputs, "torch", chunk_size=5)
    assert seen_rows == [5, 5, 5, 5, 3] * 2  # forward, then the recomputation in backward


@pytest.mark.parametrize(("change", "match"), [
    (dict(labels_N=torch.tensor([0, 30, 1])), "labels"),
    (dict(labels_N=torch.tensor([0, -1, 1])), "labels"),
    (dict(temperature=0.0), "temperature"),
    (dict(temperature=torch.ones(2)), "temperature"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(impl="fused"), "impl"),
    (dict(weight_VD=torch.zeros(30, 5)), "weight"),
    (dict(bias_V=torch.zeros(29, dtype=torch.float64)), "bias"),
])
def test_bad_inputs_raise_value_error(change, match):
    inputs = make_inputs(3, 8, 30)
    with pytest.raises(ValueError, match=match):
        chunked_logprobs(**{**inputs, **change})


@pytest.mark.skipif(interpreting(), reason="TRITON_INTERPRET is set in this process")
def test_forced_triton_on_cpu_says_why():
    with pytest.raises(ValueError, match="TRITON_INTERPRET|not installed"):
        chunked_logprobs(**make_inputs(3, 8, 30, dtype=torch.float32), impl="triton")


# ------------------------------------------------------------------- triton kernels, CPU interpreter


@pytest.mark.skipif(IN_SUBPROCESS, reason="this is the subprocess")
def test_triton_kernels_in_interpreter_subprocess(run_interpreter):
    run_interpreter(__file__, "not slow and not gpu", timeout_s=240)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.skipif(IN_SUBPROCESS, reason="this is the subprocess")
def test_triton_kernels_in_interpreter_subprocess_slow(run_interpreter):
    run_interpreter(__file__, "slow and not gpu", timeout_s=1700)


def check_triton_against_float64_reference(inputs, chunk_size, with_entropy, tol):
    got = loss_and_grads(inputs, "triton", with_entropy=with_entropy, chunk_size=chunk_size)
    inputs64 = {name: x.detach().double().requires_grad_() if name in PARAMS and x is not None else x
                for name, x in inputs.items()}
    want = loss_and_grads(inputs64, "reference", with_entropy=with_entropy)
    assert_same(got, want, tol=tol)


INTERPRETER_CASES = {
    # name: (rows, dim, vocab, chunk_size, make_inputs options, entropy in the loss)
    "multi_block_vocab_with_entropy": (11, 16, 200, 4, dict(bias=True, per_row_temp=True, num_ignored=2),
                                       True),
    "log_probs_only": (9, 8, 37, 9, dict(), False),
    "one_row_two_words": (1, 8, 2, 1024, dict(per_row_temp=True), True),
}


@under_interpreter
@pytest.mark.parametrize("case", sorted(INTERPRETER_CASES))
def test_under_interpreter_matches_reference(case):
    num_rows, dim, vocab, chunk_size, options, with_entropy = INTERPRETER_CASES[case]
    inputs = make_inputs(num_rows, dim, vocab, dtype=torch.float32, **options)
    check_triton_against_float64_reference(inputs, chunk_size, with_entropy, tol=2e-5)


@under_interpreter
@pytest.mark.slow
@pytest.mark.parametrize("seed", range(8))
def test_under_interpreter_random_shapes_slow(seed):
    gen = torch.Generator().manual_seed(seed)
    num_rows, vocab, chunk_size = (int(torch.randint(lo, hi, (1,), generator=gen)) for lo, hi in
                                   ((1, 60), (2, 700), (1, 25)))
    inputs = make_inputs(num_rows, 32, vocab, dtype=torch.float32, seed=seed, bias=seed % 2 == 0,
                         per_row_temp=seed < 2, num_ignored=min(seed, num_rows))
    # Logits of this size (std ~6 before temperature) leave float32 round-off near 1e-5.
    check_triton_against_float64_reference(inputs, chunk_size, with_entropy=True, tol=1e-4)


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_on_gpu_matches_reference(dtype):
    inputs = make_inputs(1000, 256, 32000, dtype=dtype, per_row_temp=True, num_ignored=10,
                         weight_std=0.2, device="cuda")
    got = loss_and_grads(inputs, "triton", chunk_size=300)
    want = loss_and_grads(inputs, "reference")
    if dtype == torch.float32:
        assert_same(got, want, tol=1e-3)
    else:
        assert_same(got, want, tol=2e-2, norm_wise=True)
