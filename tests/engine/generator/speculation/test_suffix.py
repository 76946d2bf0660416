"""Model-free drafts from a group's own text: the suffix index proposes what followed the longest match,
and the lossless acceptance rule with a point-mass draft emits exactly the policy's distribution
(chi-square over two emitted tokens, drafts right, wrong and impossible under top-k); accept_point_drafts
is that rule, and in the backend a group's samples draft for each other.
Run: pytest tests/engine/generator/speculation/test_suffix.py
"""

import itertools

import pytest
import torch

from tailrace.engine.core.drafter import Drafter
from tailrace.engine.generator.speculation import speculative
from tailrace.engine.generator.speculation.speculative import accept_drafts
from tailrace.engine.generator.speculation.suffix import (
    SuffixDrafter,
    SuffixIndex,
    pad_drafts,
    point_mass_logprobs,
)
from tailrace.engine.generator.torch_backend.backend import Request
from tailrace.protocol.messages import SamplingParams


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


def test_the_index_is_built_only_when_asked_and_latest_wins_in_the_order_tokens_came():
    index = SuffixIndex(max_ngram=2)
    a = index.add([1, 2, 3])
    b = index.add([1, 2, 4])
    index.extend(a, [1, 2, 5])                     # the newest "1 2" is a's second: 5 followed it
    assert not index._where                        # nothing indexed until a draft is asked for
    assert index.propose([9, 1, 2], 3) == [5]
    index.extend(b, [1, 2, 6, 7])                  # now b's second "1 2" is the newest
    assert index.propose([1, 2], 3) == [6, 7]
    drafter = SuffixDrafter(max_ngram=2)
    for _ in range(3):                             # samples that finish while no suffix arm drafts
        drafter.add_tokens(drafter.start([8, 9]), [1, 2, 3])
    assert not drafter._indexes[(8, 9)]._where
    assert drafter.propose(drafter.start([8, 9]), 2) == [1, 2]


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
def test_point_mass_drafts_emit_exactly_the_policy_distribution(drafts, top_k, chi_square_pvalue):
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


def test_siblings_draft_for_each_other_in_the_backend(make_model, spec_backend, greedy_reference):
    # A greedy group decodes the same text four times, one sample after another (batch 1): from the
    # second sample on, every suffix draft comes from the first sample's text and is accepted, and the
    # output stays the greedy reference. A drafter that ignored siblings would be accepted by chance only.
    model = make_model("qwen2", seed=2)
    prompt = [3, 9, 4, 17, 5]
    backend = spec_backend(model, Drafter.for_policy(model), 4, kind="suffix", max_batch_size=1, max_model_len=40)
    for i in range(4):
        backend.add(Request(0, i, prompt, SamplingParams(temperature=0.0, max_new_tokens=20)))
    done, after_first, stats = [], None, backend.spec_stats
    while backend.num_running or backend.num_waiting:
        done += backend.step()
        if after_first is None and done:
            after_first = stats.accepted_by["suffix"], stats.drafted_by["suffix"]
    reference = greedy_reference(model, prompt, 20)
    assert [f.completion_ids.tolist() for f in done] == [reference] * 4
    assert stats.steps_by["suffix"] == stats.num_spec_steps > 0
    accepted, drafted = stats.accepted_by["suffix"] - after_first[0], stats.drafted_by["suffix"] - after_first[1]
    assert accepted / drafted > 0.9, (accepted, drafted, after_first)


def test_accept_point_drafts_is_the_rule_with_a_point_mass_q():
    # The same uniforms give the same result as accept_drafts with q = one-hot(draft), also where a
    # draft has probability 0 (top-k) or 1 (greedy).
    gen = torch.Generator().manual_seed(3)
    rows, k, vocab = 4000, 3, 6
    logits = torch.randn(rows, k + 1, vocab, generator=gen) * 2
    logits[:100] = logits[:100].masked_fill(logits[:100] < logits[:100].topk(2, -1).values[..., -1:], float("-inf"))
    logits[100:200] = torch.where(logits[100:200] == logits[100:200].amax(-1, keepdim=True), 0.0, float("-inf"))
    p = torch.log_softmax(logits, -1)
    drafts = torch.randint(0, vocab, (rows, k), generator=gen)
    drafts[100:150] = p[100:150, :k].argmax(-1)  # greedy rows whose drafts are right
    u = torch.rand(rows, k + 1, generator=gen)
    expected = accept_drafts(p, point_mass_logprobs(drafts, vocab), drafts, u[:, :k], u[:, k])
    got = speculative.accept_point_drafts(p, drafts, u[:, :k], u[:, k])
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)
    assert int(got[0][100:150].min()) == k and int(got[0].max()) == k and int(got[0].min()) == 0


def test_suffix_drafter_bounds_its_memory():
    drafter = SuffixDrafter(max_ngram=2, max_prompts=2, max_seqs=2)
    a1, a2 = drafter.start([1, 2, 3]), drafter.start([1, 2, 3])
    assert a1.index is a2.index  # one index per prompt
    drafter.add_tokens(a1, [4, 5])
    drafter.add_tokens(a1, [4, 5, 6])  # only the new token is added
    assert a1.index.seqs[a1.seq_id] == [2, 3, 4, 5, 6] and drafter.propose(a2, 3) == [4, 5, 6]
    a3 = drafter.start([1, 2, 3])  # 3 sequences (prompt + 2 samples) reached max_seqs: a fresh index
    assert a3.index is not a1.index and drafter.propose(a3, 2) == []
    drafter.start([7]), drafter.start([8])
    assert drafter.start([1, 2, 3]).index is not a3.index  # least recently used prompt dropped
    with pytest.raises(ValueError, match="max_prompts"):
        SuffixDrafter(max_prompts=0)
