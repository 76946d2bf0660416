"""Model-free drafts from a group's own text: the suffix index proposes what followed the longest match,
and the lossless acceptance rule with a point-mass draft emits exactly the policy's distribution
(chi-square over two emitted tokens, drafts right, wrong and impossible under top-k).
Run: pytest tests/engine/test_suffix.py
"""

import itertools

import pytest
import torch
from test_speculative import chi_square_pvalue

from tailrace.engine.generator.speculative import accept_drafts
from tailrace.engine.generator.suffix import SuffixIndex, pad_drafts, point_mass_logprobs


def test_longest_seen_suffix_proposes_its_continuation():
    index = SuffixIndex(max_ngram=3)
    index.add([5, 6, 7, 8, 9])            # the prompt
    sibling = index.add([1, 2, 3, 4])      # a sibling completion, growing
    index.extend(sibling, [7, 8, 1])
    assert index.propose([0, 6, 7], 3) == [8, 9]         # "6 7" seen in the prompt only
    assert index.propose([3, 4, 7, 8], 2) == [1]          # "4 7 8" (longest) in the sibling, then its end
    assert index.propose([9, 9, 2], 4) == [3, 4, 7, 8]    # "2": one token of context suffices
    assert index.propose([42], 3) == [] and index.propose([], 3) == []


def test_a_row_does_not_match_its_own_last_ngram_but_does_match_its_own_repeats():
    index = SuffixIndex(max_ngram=2)
    row = index.add([3, 4, 5])
    assert index.propose([3, 4, 5], 2) == []     # "4 5" has no continuation yet
    index.extend(row, [3, 4])
    assert index.propose([5, 3, 4], 2) == [5, 3]  # the row repeats itself: its own earlier text drafts


def test_pad_drafts_and_point_mass():
    drafts = pad_drafts([[7, 8], [], [1, 2, 3, 4]], 3, fallback=[0, 5, 9])
    assert drafts.tolist() == [[7, 8, 0], [5, 5, 5], [1, 2, 3]]
    q = point_mass_logprobs(drafts, 10)
    assert q.shape == (3, 3, 10) and torch.equal(q.exp().sum(-1), torch.ones(3, 3))
    assert torch.equal(q.exp().argmax(-1), drafts)


def processed(logits_V, top_k=0):
    if top_k:
        cut = logits_V.topk(top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < cut, float("-inf"))
    return torch.log_softmax(logits_V, -1)


@pytest.mark.parametrize("drafts, top_k", [((2, 0), 0), ((4, 4), 0), ((1, 3), 3)])
def test_point_mass_drafts_emit_exactly_the_policy_distribution(drafts, top_k):
    """Two policy steps p1, p2(. | t1) over a 5-token vocabulary; a fixed two-token draft is verified
    for 60k rows at once. The emitted (t1, t2) pairs follow p1 x p2 whatever the draft: right (the
    likeliest tokens), wrong, or outside top-k (probability 0: always rejected)."""
    gen = torch.Generator().manual_seed(7)
    vocab, num = 5, 60_000
    p1 = processed(torch.randn(vocab, generator=gen) * 1.5, top_k)
    p2 = torch.stack([processed(torch.randn(vocab, generator=gen) * 1.5, top_k) for _ in range(vocab)])
    d1, d2 = drafts
    # Position 2 is verified under t1 = d1 (the draft's own prefix), as a real verify pass would.
    p_BNV = torch.stack([p1, p2[d1], p2[d2]])[None].expand(num, 3, vocab)
    drafts_BK = torch.tensor([[d1, d2]]).expand(num, 2)
    q_BKV = point_mass_logprobs(drafts_BK, vocab)
    u = torch.rand(num, 3, generator=gen)
    accepted, tokens, _ = accept_drafts(p_BNV, q_BKV, drafts_BK, u[:, :2], u[:, 2])
    # Rows that rejected d1 emit one token from the residual; their second token comes from a plain step.
    first = tokens[:, 0]
    t2 = torch.where(accepted >= 1, tokens[:, 1], _plain_step(p2, first, gen))
    counts = {}
    for a, b in zip(first.tolist(), t2.tolist(), strict=True):
        counts[(a, b)] = counts.get((a, b), 0) + 1
    probs = {(a, b): float(p1[a].exp() * p2[a, b].exp()) for a, b in itertools.product(range(vocab), repeat=2)}
    assert chi_square_pvalue(counts, probs, num) > 1e-3
    if top_k and float(p1[d1].exp()) == 0.0:
        assert int(accepted.max()) == 0  # an impossible draft is never kept


def _plain_step(p2, first, gen):
    """A plain decode step after the first token, for rows whose draft ended at it."""
    cdf = p2.exp().cumsum(-1)[first]
    u = torch.rand(first.shape[0], 1, generator=gen)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp_max(p2.shape[1] - 1)
