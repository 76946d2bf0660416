"""Logits processing and sampling, shared by every decoding path of the torch backend.

One function turns raw logits into the distribution a token is actually drawn from, so plain decoding
and (later) speculative decoding apply identical processing to drafter and policy. Order: divide by
temperature, keep the top_k largest, keep the smallest set of the rest whose mass reaches top_p, then
renormalise. Behaviour log-probs are log-probabilities under that processed distribution — what the
trainer's off-policy correction needs. Convention: temperature 0 is greedy and its processed
distribution is one-hot on the argmax, so a greedy token's behaviour log-prob is exactly 0.0.

Randomness: one uniform per row per draw, from a CPU torch.Generator per row (a seeded request owns
its generator, so its tokens do not depend on what else is in the batch or on the device).
Test: pytest tests/engine/generator/test_sampling.py
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tailrace.protocol.messages import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, sample_id) pairs over seeds


def sample_seed(seed: int, sample_id: int) -> int:
    """The seed of one sample of a seeded request. The sample id is mixed in because one WorkItem (one
    seed) yields a whole group: identical streams would give identical samples and zero advantages."""
    return (seed * _SEED_MIX + sample_id) % (1 << 63)


def request_generator(seed: int, sample_id: int) -> torch.Generator:
    """The CPU generator of one seeded request (see sample_seed)."""
    return torch.Generator().manual_seed(sample_seed(seed, sample_id))


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings of a batch as tensors [B], built once per batch composition.

    generators[i] is row i's CPU generator (several rows may share the backend's own generator)."""

    temperature_B: torch.Tensor  # float32; 0 = greedy
    top_k_B: torch.Tensor        # int64; 0 = off
    top_p_B: torch.Tensor        # float32; 1.0 = off
    truncates_B: torch.Tensor    # bool; the row uses top-k or top-p
    divisor_B1: torch.Tensor     # float32 [B, 1]; what logits are divided by: the temperature, 1 if greedy
    generators: tuple[torch.Generator, ...]
    all_greedy: bool
    any_greedy: bool
    any_truncation: bool
    any_top_p: bool
    max_top_k: int               # largest top_k in use (0 if none)
    unit_divisor: bool = False   # every divisor is 1 (temperatures 1 and 0): dividing would change nothing

    @classmethod
    def build(cls, params: Sequence[SamplingParams], generators: Sequence[torch.Generator],
              device: torch.device | str = "cpu") -> SamplingBatch:
        assert len(params) == len(generators)
        temps = [p.temperature for p in params]
        top_ks = [p.top_k for p in params]
        top_ps = [p.top_p for p in params]
        truncates = [k > 0 or p < 1.0 for k, p in zip(top_ks, top_ps, strict=True)]
        return cls(
            temperature_B=torch.tensor(temps, dtype=torch.float32, device=device),
            top_k_B=torch.tensor(top_ks, dtype=torch.int64, device=device),
            top_p_B=torch.tensor(top_ps, dtype=torch.float32, device=device),
            truncates_B=torch.tensor(truncates, dtype=torch.bool, device=device),
            divisor_B1=torch.tensor([[t if t > 0.0 else 1.0] for t in temps], dtype=torch.float32, device=device),
            generators=tuple(generators),
            all_greedy=all(t == 0.0 for t in temps),
            any_greedy=any(t == 0.0 for t in temps),
            any_truncation=any(truncates),
            any_top_p=any(p < 1.0 for p in top_ps),
            max_top_k=max(top_ks, default=0),
            unit_divisor=all(t in (0.0, 1.0) for t in temps),
        )

    def __len__(self) -> int:
        return len(self.generators)


_NUM_CANDIDATES = 64
"""Top-p first looks for its nucleus among this many most likely tokens: a top-k selection costs a
fraction of a full-vocabulary sort (docs/benchmarks.md)."""


def _truncate(scaled_BV: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf. The nucleus is
    the smallest set of most likely tokens whose mass reaches top_p under the top-k-renormalised
    distribution (as vLLM and Hugging Face do); the most likely token always stays."""
    vocab = scaled_BV.shape[-1]
    num = min(vocab, max(batch.max_top_k, _NUM_CANDIDATES if batch.any_top_p else 1))
    truncated_BV = _truncate_within(scaled_BV, batch, num)
    if truncated_BV is None:  # a nucleus reaches past the candidates: redo over the whole vocabulary
        truncated_BV = _truncate_within(scaled_BV, batch, vocab)
    return torch.where(batch.truncates_B[:, None], truncated_BV, scaled_BV)


def _truncate_within(scaled_BV: torch.Tensor, batch: SamplingBatch, num: int) -> torch.Tensor | None:
    """_truncate computed on the `num` most likely tokens of each row, or None when that is not exact.
    num is at least every row's top_k, so top-k is always exact here."""
    vocab = scaled_BV.shape[-1]
    if num == vocab:
        top_BN, index_BN = torch.sort(scaled_BV, dim=-1, descending=True, stable=True)
    else:
        top_BN, index_BN = torch.topk(scaled_BV, num, dim=-1)
    rank_N = torch.arange(num, device=scaled_BV.device)
    k_B = torch.where(batch.top_k_B > 0, batch.top_k_B, vocab)
    top_BN = top_BN.masked_fill(rank_N >= k_B[:, None], float("-inf"))
    if batch.any_top_p:
        # Normaliser of the top-k distribution: the candidates hold all of it when k <= num.
        log_z_B = torch.where(k_B <= num, torch.logsumexp(top_BN, -1), torch.logsumexp(scaled_BV, -1))
        probs_BN = torch.exp(top_BN - log_z_B[:, None])
        cum_BN = torch.cumsum(probs_BN, dim=-1)
        uses_top_p_B = batch.top_p_B < 1.0  # top_p 1.0 must not drop a tail token over rounding
        if num < vocab and bool((uses_top_p_B & (k_B > num) & (cum_BN[:, -1] < batch.top_p_B)).any()):
            return None
        # Drop a token once the tokens ranked above it already reach top_p: the smallest such set.
        drop_BN = ((cum_BN - probs_BN) >= batch.top_p_B[:, None]) & (rank_N > 0) & uses_top_p_B[:, None]
        top_BN = top_BN.masked_fill(drop_BN, float("-inf"))
    return torch.full_like(scaled_BV, float("-inf")).scatter_(-1, index_BN, top_BN)


def processed_logprobs(logits_BV: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Log-probabilities [B, V] (float32, -inf outside the support) of the distribution each row samples
    from. Speculative decoding must use this same function for drafter and policy."""
    logits_BV = logits_BV.float()
    if batch.all_greedy:
        return _one_hot_logprobs(logits_BV)
    # Greedy rows are divided by 1 only to stay finite; their result is replaced below. x / 1 == x
    # exactly, so a batch at temperature 1 skips the op (every drafted token pays for each op).
    scaled_BV = logits_BV if batch.unit_divisor else logits_BV / batch.divisor_B1
    if batch.any_truncation:
        scaled_BV = _truncate(scaled_BV, batch)
    logprobs_BV = torch.log_softmax(scaled_BV, dim=-1)
    if batch.any_greedy:
        greedy_B1 = batch.temperature_B[:, None] == 0.0
        logprobs_BV = torch.where(greedy_B1, _one_hot_logprobs(logits_BV), logprobs_BV)
    return logprobs_BV


def _one_hot_logprobs(logits_BV: torch.Tensor) -> torch.Tensor:
    out_BV = torch.full_like(logits_BV, float("-inf"))
    return out_BV.scatter_(-1, logits_BV.argmax(-1, keepdim=True), 0.0)


def draw_uniforms(generators: Sequence[torch.Generator], device: torch.device | str = "cpu") -> torch.Tensor:
    """One U[0, 1) per row [B] (float32), row i from generators[i]. Drawn on the CPU so a seeded
    request gives the same stream whatever the device; one small copy per step on an accelerator."""
    u_B = torch.empty(len(generators), dtype=torch.float32)
    for i, gen in enumerate(generators):
        u_B[i : i + 1].uniform_(generator=gen)
    return u_B.to(device, non_blocking=True)


def sample_from_logprobs(logprobs_BV: torch.Tensor, uniforms_B: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw [B] (int64) from processed log-probs: the first token whose cumulative mass
    exceeds u * total. Tokens outside the support add no mass, so they can never be drawn."""
    cdf_BV = torch.cumsum(logprobs_BV.exp(), dim=-1)
    target_B1 = uniforms_B[:, None] * cdf_BV[:, -1:]
    tokens_B = torch.searchsorted(cdf_BV, target_B1, right=True).squeeze(-1)
    # Rounding can put the target at the total; the first index of the maximum is the last token
    # with mass, which is the right answer then.
    return torch.minimum(tokens_B, cdf_BV.argmax(-1))


def sample(logits_BV: torch.Tensor, batch: SamplingBatch,
           uniforms_B: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row. Returns (tokens [B] int64, behaviour log-probs [B] float32).

    uniforms_B defaults to a fresh draw from the batch's generators; pass it to replay a draw."""
    if batch.all_greedy:
        # Greedy needs no randomness, and its behaviour log-prob is 0 by convention.
        tokens_B = logits_BV.argmax(-1)
        return tokens_B, torch.zeros(tokens_B.shape, dtype=torch.float32, device=tokens_B.device)
    if uniforms_B is None:
        uniforms_B = draw_uniforms(batch.generators, logits_BV.device)
    logprobs_BV = processed_logprobs(logits_BV, batch)
    tokens_B = sample_from_logprobs(logprobs_BV, uniforms_B)
    return tokens_B, logprobs_BV.gather(-1, tokens_B[:, None]).squeeze(-1)
