"""Logits processing and sampling on hand-built distributions. Run: pytest tests/engine/generator/test_sampling.py"""

import math

import pytest
import torch

from tailrace.engine.generator.sampling import (
    SamplingBatch,
    draw_uniforms,
    processed_logprobs,
    request_generator,
    sample,
    sample_from_logprobs,
)
from tailrace.protocol.messages import SamplingParams

torch.set_num_threads(1)

# Token i has probability PROBS[i] at temperature 1; ranked: 1 (0.5), 3 (0.2), 4 (0.15), 2 (0.1), 0 (0.05).
PROBS = [0.05, 0.5, 0.1, 0.2, 0.15]
LOGITS_V = torch.tensor(PROBS).log() + 3.0  # an offset changes nothing after softmax


def _batch(*params: SamplingParams) -> SamplingBatch:
    gens = [torch.Generator().manual_seed(i) for i in range(len(params))]
    return SamplingBatch.build(params, gens)


def _support_probs(params: SamplingParams) -> dict[int, float]:
    logprobs = processed_logprobs(LOGITS_V[None], _batch(params))[0]
    return {i: math.exp(lp) for i, lp in enumerate(logprobs.tolist()) if lp > float("-inf")}


def _renorm(kept: list[int]) -> dict[int, float]:
    total = sum(PROBS[i] for i in kept)
    return {i: PROBS[i] / total for i in kept}


@pytest.mark.parametrize(
    "params, kept",
    [
        (SamplingParams(top_k=2), [1, 3]),
        (SamplingParams(top_k=1), [1]),
        (SamplingParams(top_k=0), [0, 1, 2, 3, 4]),
        (SamplingParams(top_p=0.6), [1, 3]),
        (SamplingParams(top_p=0.5), [1]),     # the top token alone already reaches 0.5
        (SamplingParams(top_p=0.75), [1, 3, 4]),
        (SamplingParams(top_p=0.0), [1]),     # top-p 0 keeps the most likely token
        # top-p acts on the top-k-renormalised distribution: 0.5/0.85 + 0.2/0.85 = 0.82 >= 0.8
        (SamplingParams(top_k=3, top_p=0.8), [1, 3]),
        (SamplingParams(top_k=3, top_p=0.85), [1, 3, 4]),
    ],
)
def test_top_k_top_p_support_and_renormalisation(params, kept):
    support = _support_probs(params)
    assert sorted(support) == kept
    for token, prob in _renorm(kept).items():
        assert support[token] == pytest.approx(prob, abs=1e-6)


def test_temperature_scales_logits_before_softmax():
    for temperature in (0.5, 1.0, 2.0):
        got = processed_logprobs(LOGITS_V[None], _batch(SamplingParams(temperature=temperature)))[0]
        torch.testing.assert_close(got, torch.log_softmax(LOGITS_V / temperature, -1), atol=1e-6, rtol=0)


def test_greedy_is_one_hot_with_logprob_zero():
    batch = _batch(SamplingParams(temperature=0.0), SamplingParams(temperature=1.0))
    logits_BV = torch.stack([LOGITS_V, LOGITS_V])
    logprobs_BV = processed_logprobs(logits_BV, batch)
    assert logprobs_BV[0].tolist() == [float("-inf"), 0.0, float("-inf"), float("-inf"), float("-inf")]
    for _ in range(20):
        tokens_B, token_logprobs_B = sample(logits_BV, batch)
        assert tokens_B[0].item() == 1 and token_logprobs_B[0].item() == 0.0
    all_greedy = _batch(SamplingParams(temperature=0.0))
    tokens_B, token_logprobs_B = sample(LOGITS_V[None], all_greedy)
    assert tokens_B.tolist() == [1] and token_logprobs_B.tolist() == [0.0]


def test_sampled_logprob_is_the_processed_distribution_at_the_token():
    params = [SamplingParams(temperature=0.7, top_k=4, top_p=0.9), SamplingParams(temperature=1.3),
              SamplingParams(temperature=0.0), SamplingParams(top_p=0.3)]
    batch = _batch(*params)
    logits_BV = torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 3
    for _ in range(10):
        tokens_B, token_logprobs_B = sample(logits_BV, batch)
        expected_B = processed_logprobs(logits_BV, batch).gather(-1, tokens_B[:, None]).squeeze(-1)
        assert torch.equal(token_logprobs_B, expected_B)
        assert torch.isfinite(token_logprobs_B).all()


def test_empirical_frequencies_follow_the_processed_distribution():
    batch = _batch(SamplingParams(temperature=1.0, top_k=3))
    logprobs_BV = processed_logprobs(LOGITS_V[None], batch).expand(40_000, -1)
    uniforms_B = torch.rand(40_000, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(sample_from_logprobs(logprobs_BV, uniforms_B), minlength=5) / 40_000
    expected = _renorm([1, 3, 4])
    assert counts[0].item() == 0.0 and counts[2].item() == 0.0
    for token, prob in expected.items():
        assert counts[token].item() == pytest.approx(prob, abs=0.01)


def test_extreme_uniforms_never_pick_a_masked_token():
    logprobs_V = processed_logprobs(LOGITS_V[None], _batch(SamplingParams(top_k=2)))[0]
    edges_B = torch.tensor([0.0, 1e-9, 0.5, 1.0 - 2**-24, 1.0])  # 1.0 itself stands in for rounding up
    tokens_B = sample_from_logprobs(logprobs_V.expand(5, -1), edges_B)
    assert set(tokens_B.tolist()) <= {1, 3}
    assert tokens_B[0].item() == 1 and tokens_B[-1].item() == 3


def test_request_generators_are_reproducible_and_distinct_per_sample():
    first = draw_uniforms([request_generator(7, 0)])
    again = draw_uniforms([request_generator(7, 0)])
    other_sample = draw_uniforms([request_generator(7, 1)])
    assert torch.equal(first, again)
    assert not torch.equal(first, other_sample)
    shared = torch.Generator().manual_seed(1)
    both = draw_uniforms([shared, shared])
    assert both[0].item() != both[1].item()  # rows sharing a generator draw in turn


def _naive_support(logits_V: torch.Tensor, params: SamplingParams) -> set[int]:
    """Top-k then top-p, one row, written the obvious way over a full sort."""
    probs = torch.softmax(logits_V.double() / params.temperature, -1)
    order = torch.argsort(probs, descending=True).tolist()
    if params.top_k > 0:
        order = order[: params.top_k]
    total = sum(probs[i].item() for i in order)
    kept, mass = [], 0.0
    for i in order:
        if kept and params.top_p < 1.0 and mass >= params.top_p:
            break
        kept.append(i)
        mass += probs[i].item() / total
    return set(kept)


def test_candidate_shortcut_and_full_sort_fallback_match_naive_reference():
    # V = 300 > the 64 candidates: peaked rows stay within them, flat rows force the fallback.
    gen = torch.Generator().manual_seed(5)
    scales = [8.0, 4.0, 0.3, 0.05, 8.0, 0.3, 1.0, 2.0]
    logits_BV = torch.randn(8, 300, generator=gen) * torch.tensor(scales)[:, None]
    params = [SamplingParams(top_p=0.9), SamplingParams(top_k=20, top_p=0.8), SamplingParams(top_p=0.95),
              SamplingParams(top_k=100, top_p=0.5), SamplingParams(top_k=7), SamplingParams(),
              SamplingParams(temperature=0.6, top_p=0.7), SamplingParams(top_k=150)]
    for rows in ([0, 1, 4, 6], list(range(8))):  # 64 candidates suffice; rows 2, 3 need the full sort
        batch = _batch(*[params[r] for r in rows])
        logprobs_BV = processed_logprobs(logits_BV[rows], batch)
        for i, r in enumerate(rows):
            support = set(torch.nonzero(logprobs_BV[i] > float("-inf")).flatten().tolist())
            assert support == _naive_support(logits_BV[r], params[r]), (r, params[r])
            assert logprobs_BV[i].exp().sum().item() == pytest.approx(1.0, abs=1e-5)
