"""Prefix trie: every sample reconstructs from its path, segments are maximal runs in pre-order, loss rows
sit on the predicting node (several labels on a branching node), identical and prefix samples."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tailrace.engine.core.samples import TrainSample
from tailrace.engine.replay.trie import build_trie


def make_sample(seq, prompt_len, i=0, temperature=1.0):
    t = len(seq) - prompt_len
    return TrainSample(group_id=0, sample_id=i, prompt_ids=seq[:prompt_len], completion_ids=seq[prompt_len:],
                       behaviour_logprobs=torch.full((t,), -1.0), policy_versions=torch.zeros(t, dtype=torch.int64),
                       reward=0.0, temperature=temperature)


@st.composite
def sequences(draw, vocab=3, max_samples=7, max_len=10):
    """Token sequences that share prefixes: copies, prefixes of one another, branches at any depth."""
    tokens = st.integers(0, vocab - 1)
    seqs: list[list[int]] = []
    for _ in range(draw(st.integers(1, max_samples))):
        if seqs and draw(st.booleans()):
            base = draw(st.sampled_from(seqs))
            seq = base[: draw(st.integers(0, len(base)))] + draw(st.lists(tokens, max_size=max_len))
        else:
            seq = draw(st.lists(tokens, min_size=2, max_size=max_len))
        seqs.append((seq + [0, 1])[: max(2, len(seq))])
    return seqs


@st.composite
def sample_sets(draw):
    seqs = draw(sequences())
    return [make_sample(s, draw(st.integers(1, len(s) - 1)), i, draw(st.sampled_from([1.0, 0.5])))
            for i, s in enumerate(seqs)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sample_sets())
def test_trie_structure(samples):
    trie = build_trie(samples)
    tokens, depth = trie.tokens_N.tolist(), trie.depth_N.tolist()
    seqs = [torch.cat([s.prompt_ids, s.completion_ids]).tolist() for s in samples]
    # Every sample reads back from its path; depths are positions along the path.
    for seq, path in zip(seqs, trie.sample_path, strict=True):
        nodes = [n for seg in path for n in range(int(trie.seg_start_S[seg]), int(trie.seg_start_S[seg] + trie.seg_len_S[seg]))]
        assert [tokens[n] for n in nodes[: len(seq)]] == seq
        assert [depth[n] for n in nodes[: len(seq)]] == list(range(len(seq)))
        assert len(nodes) - len(seq) < int(trie.seg_len_S[path[-1]])  # it ends in its last segment
    # One node per distinct prefix.
    assert trie.num_unique_tokens == len({tuple(s[:k]) for s in seqs for k in range(1, len(s) + 1)})
    assert trie.num_logical_tokens == sum(map(len, seqs))
    parents = trie.seg_parent_S.tolist()
    for seg, parent in enumerate(parents):
        start, end = int(trie.seg_start_S[seg]), int(trie.seg_end_S[seg])
        if parent >= 0:  # pre-order: a child follows its parent and lies inside its subtree
            assert parent < seg and int(trie.seg_start_S[parent]) < start <= end <= int(trie.seg_end_S[parent])
            assert int(trie.seg_depth_S[seg]) == int(trie.seg_depth_S[parent] + trie.seg_len_S[parent])
        children = [c for c, p in enumerate(parents) if p == seg]
        assert len(children) == int(trie.seg_num_children_S[seg]) and len(children) != 1  # maximal runs
        assert len({tokens[int(trie.seg_start_S[c])] for c in children}) == len(children)
    roots = trie.roots()
    assert len({tokens[int(trie.seg_start_S[r])] for r in roots}) == len(roots)


@settings(max_examples=150, deadline=None)
@given(sample_sets())
def test_loss_rows_sit_on_the_predicting_node(samples):
    trie = build_trie(samples)
    seen = set()
    for r in range(trie.row_lm_R.numel()):
        i, pos, lm = int(trie.row_sample_R[r]), int(trie.row_pos_R[r]), int(trie.row_lm_R[r])
        s = samples[i]
        node = int(trie.lm_node_U[lm])
        seen.add((i, pos))
        assert int(trie.depth_N[node]) == s.num_prompt_tokens + pos - 1
        assert int(trie.lm_label_U[lm]) == int(s.completion_ids[pos])
        assert float(trie.lm_temperature_U[lm]) == s.temperature
        assert bool(trie.is_input_N[node])
        seg = int(torch.searchsorted(trie.seg_start_S, torch.tensor(node), right=True)) - 1
        assert seg in trie.sample_path[i]
        assert int(trie.seg_row_ptr_S1[seg]) <= r < int(trie.seg_row_ptr_S1[seg + 1])
        assert int(trie.seg_lm_ptr_S1[seg]) <= lm < int(trie.seg_lm_ptr_S1[seg + 1])
    assert seen == {(i, p) for i, s in enumerate(samples) for p in range(s.num_completion_tokens)}
    keys = list(zip(trie.lm_node_U.tolist(), trie.lm_label_U.tolist(), trie.lm_temperature_U.tolist(), strict=True))
    assert len(set(keys)) == len(keys)
    assert trie.num_forward_tokens == int(trie.is_input_N.sum())


def test_branching_token_has_one_row_per_label():
    samples = [make_sample([5, 6, 7], 2, 0), make_sample([5, 6, 8], 2, 1), make_sample([5, 6, 8], 2, 2)]
    trie = build_trie(samples)
    assert trie.seg_len_S.tolist() == [2, 1, 1] and trie.seg_parent_S.tolist() == [-1, 0, 0]
    assert trie.lm_node_U.tolist() == [1, 1] and sorted(trie.lm_label_U.tolist()) == [7, 8]
    assert trie.row_lm_R.numel() == 3  # identical samples 1 and 2 share one LM row
    assert trie.num_forward_tokens == 2  # the one-token leaves are labels only
    assert trie.attention_pairs() == 1 + 2


def test_prefix_of_another_and_extension_keep_one_segment():
    samples = [make_sample([1, 2, 3], 1, 0), make_sample([1, 2, 3, 4, 5], 1, 1), make_sample([1, 2], 1, 2)]
    trie = build_trie(samples)
    assert trie.num_segments == 1 and trie.tokens_N.tolist() == [1, 2, 3, 4, 5]
    assert trie.num_forward_tokens == 4
    # Sample 0's last token (3) is predicted by node 1; sample 2's (2) by node 0.
    rows = {(int(trie.row_sample_R[r]), int(trie.row_pos_R[r])): int(trie.lm_node_U[trie.row_lm_R[r]])
            for r in range(trie.row_lm_R.numel())}
    assert rows[(0, 1)] == 1 and rows[(2, 0)] == 0 and rows[(1, 3)] == 3


def test_forest_and_temperature_split_lm_rows():
    samples = [make_sample([1, 2, 3], 1, 0, 1.0), make_sample([1, 2, 3], 1, 1, 0.5), make_sample([9, 2], 1, 2)]
    trie = build_trie(samples)
    assert len(trie.roots()) == 2
    assert trie.lm_node_U.numel() == 5 and trie.row_lm_R.numel() == 5  # temperatures do not share rows
    np.testing.assert_array_equal(np.diff(trie.seg_lm_ptr_S1.numpy()) >= 0, True)


@pytest.mark.parametrize("num_samples", [1, 16])
def test_long_prompt_group(num_samples):
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 50, (300,), generator=gen).tolist()
    samples = [make_sample(prompt + torch.randint(0, 50, (20,), generator=gen).tolist(), 300, i)
               for i in range(num_samples)]
    trie = build_trie(samples)
    assert trie.num_unique_tokens == 300 + 20 * num_samples - (0 if num_samples == 1 else _shared_first(samples))
    assert trie.num_logical_tokens == 320 * num_samples


def _shared_first(samples):
    """Nodes saved by completions that start with the same tokens (random ids can coincide)."""
    seqs = [tuple(s.completion_ids.tolist()) for s in samples]
    distinct = {s[:k] for s in seqs for k in range(1, len(s) + 1)}
    return sum(map(len, seqs)) - len(distinct)
