"""Model-free drafts from siblings: suffix matching over the group's prompt and completions.

In GRPO every prompt is sampled G times, and the samples of a group repeat each other's text (and the
prompt's). A SuffixIndex per group maps every n-gram (n = 1 .. max_ngram) of the group's sequences to
where it was seen last; to draft for a row, the longest n-gram ending its context that was seen before
proposes the tokens that followed it there. No forward pass: a draft costs a few dict lookups.

The draft is a point mass, so the lossless rule of speculative.accept_drafts applies unchanged with
q = one-hot(draft): the draft d is kept with probability p(d), and at a rejection the next token is
drawn from normalise(max(0, p - one_hot(d))) — i.e. from p without d. point_mass_logprobs builds that q; speculative.accept_point_drafts applies the rule without building it.
SuffixDrafter is the backend's side: one index per prompt (so a group's concurrent samples and the
same prompt's earlier completions draft for each other), each running sample's text added lazily, at the
steps that draft from it, so plain and EAGLE steps pay no host sync for it; and a prompt's n-grams are
indexed only when a draft is asked of that index, so a generator whose bandit keeps suffix drafting off
pays a list append per finished sample, not the indexing (a measurable share of decode time where
samples are a few tokens long: docs/benchmarks.md).
Test: pytest tests/engine/generator/speculation/test_suffix.py
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch


class SuffixIndex:
    """n-grams of a group's token sequences -> (sequence, position after the n-gram), latest wins.

    Sequences are added whole (the prompt) or grown token by token (completions while they decode);
    memory is bounded by max_ngram entries per token seen."""

    def __init__(self, max_ngram: int = 4):
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.seqs: list[list[int]] = []
        self._where: dict[tuple[int, ...], tuple[int, int]] = {}
        # Tokens added but not yet indexed, (seq_id, start, stop) in the order they came: propose() indexes
        # them first, in that order, so the index is the one adding them eagerly would build, and a
        # generator that never drafts from suffixes (the bandit chose other arms) never pays for indexing.
        self._unindexed: list[tuple[int, int, int]] = []

    def add(self, tokens: Sequence[int]) -> int:
        """A new sequence; returns its id, for extend()."""
        self.seqs.append([])
        seq_id = len(self.seqs) - 1
        self.extend(seq_id, tokens)
        return seq_id

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        seq = self.seqs[seq_id]
        start = len(seq)
        seq.extend(int(token) for token in tokens)
        if len(seq) > start:
            self._unindexed.append((seq_id, start, len(seq)))

    def _index_new_tokens(self) -> None:
        where, max_ngram = self._where, self.max_ngram
        for seq_id, start, stop in self._unindexed:
            seq = self.seqs[seq_id]
            for end in range(start + 1, stop + 1):
                # The n-grams ending at the token before end - 1 now have a continuation: token end - 1.
                for n in range(1, min(max_ngram, end - 1) + 1):
                    where[tuple(seq[end - 1 - n:end - 1])] = (seq_id, end - 1)
        self._unindexed.clear()

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix of `context` seen in the index. An n-gram is
        indexed only once a token follows it, so a row's own last n-gram never matches itself."""
        if self._unindexed:
            self._index_new_tokens()
        for n in range(min(self.max_ngram, len(context)), 0, -1):
            hit = self._where.get(tuple(int(t) for t in context[-n:]))
            if hit is not None:
                seq_id, pos = hit
                return self.seqs[seq_id][pos:pos + k]
        return []


def point_mass_logprobs(drafts_BK: torch.Tensor, vocab_size: int, dtype=torch.float32) -> torch.Tensor:
    """log q [B, k, V] of drafts that are certain: 0 at the draft, -inf elsewhere."""
    q_BKV = torch.full((*drafts_BK.shape, vocab_size), float("-inf"), dtype=dtype, device=drafts_BK.device)
    return q_BKV.scatter_(-1, drafts_BK[..., None], 0.0)


def pad_drafts(proposals: list[list[int]], k: int, fallback: Sequence[int]) -> torch.Tensor:
    """[B, k] drafts: each row's proposal, filled up with its fallback token (any token keeps the rule
    lossless; a poor one is merely rejected)."""
    rows = [(p + [int(fallback[i])] * k)[:k] for i, p in enumerate(proposals)]
    return torch.tensor(rows, dtype=torch.long)


class _RowText:
    """A running sample's place in its prompt's index: its sequence id and how many of its completion
    tokens the index holds."""

    __slots__ = ("index", "seq_id", "num_indexed")

    def __init__(self, index: SuffixIndex, seq_id: int):
        self.index, self.seq_id, self.num_indexed = index, seq_id, 0


class SuffixDrafter:
    """Per-prompt suffix indexes over the prompt and every sample of it, running or finished.

    Memory is bounded: at most max_prompts indexes (least recently used dropped; running samples keep
    theirs), and a prompt's index that holds max_seqs samples is replaced by a fresh one (prompt only)
    for the samples that start after that. The defaults cover the groups a generator has in flight (a
    prompt's samples are decoded close together) at about max_prompts * max_seqs * max_ngram dict
    entries per token of a sample."""

    def __init__(self, max_ngram: int = 4, max_prompts: int = 16, max_seqs: int = 32):
        if max_prompts < 1 or max_seqs < 1:
            raise ValueError(f"max_prompts and max_seqs must be >= 1, got {max_prompts}, {max_seqs}")
        self.max_ngram, self.max_prompts, self.max_seqs = max_ngram, max_prompts, max_seqs
        self._indexes: OrderedDict[tuple[int, ...], SuffixIndex] = OrderedDict()

    def start(self, prompt_ids: Sequence[int]) -> _RowText:
        """A new sample of this prompt: its sequence starts with the prompt's last tokens, so the n-grams
        across the prompt's end point at what the samples wrote first."""
        key = tuple(int(t) for t in prompt_ids)
        index = self._indexes.get(key)
        if index is None or len(index.seqs) > self.max_seqs:
            index = SuffixIndex(self.max_ngram)
            index.add(key)
            self._indexes[key] = index
            while len(self._indexes) > self.max_prompts:
                self._indexes.popitem(last=False)
        self._indexes.move_to_end(key)
        return _RowText(index, index.add(key[-self.max_ngram:]))

    @staticmethod
    def add_tokens(text: _RowText, completion: Sequence[int]) -> None:
        """Bring the index up to `completion` (the sample's whole completion so far)."""
        if len(completion) > text.num_indexed:
            text.index.extend(text.seq_id, completion[text.num_indexed:])
            text.num_indexed = len(completion)

    @staticmethod
    def propose(text: _RowText, k: int) -> list[int]:
        """Up to k tokens to draft after the sample's text so far (its pending token last)."""
        return text.index.propose(text.index.seqs[text.seq_id][-text.index.max_ngram:], k)
