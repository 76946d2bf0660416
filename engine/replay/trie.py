"""The prefix trie of a step's samples, from token ids (prompt + completion), in flat DFS pre-order arrays.

A node is one distinct prefix of some sample's token sequence; a segment is a maximal unbranched run of
nodes (a radix-tree edge). Segments are numbered in DFS pre-order and their nodes are consecutive, so
node index order is the pre-order of nodes too: a segment's subtree is the node range
[seg_start, seg_end). Positions are path depths (a node's distance from the root).

Loss rows are logical, one per (sample, completion position) that carries a loss term, attached to the
node that *predicts* the token (its parent on the sample's path). A multi-turn sample's observation tokens
(loss_mask False) are nodes like any other token, shared prefix of the samples that contain them, but get
no loss row: the mask changes only which rows exist, never the trie. A node with several children predicts a different token in each
(the branching-token rule): one hidden state, several labels. Rows that share (node, label, temperature)
share one log-prob computation, the "LM rows".
Test: pytest tests/engine/replay/test_trie.py
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tailrace.engine.core.samples import TrainSample


@dataclass
class _Edge:
    tokens: np.ndarray
    parent: int  # index into the edge list, -1 for a root
    children: dict[int, int]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def _insert(edges: list[_Edge], roots: dict[int, int], seq: np.ndarray) -> None:
    """Radix insertion: split an edge only where two sequences diverge; a sample that ends inside an edge
    (a prefix of another) leaves it whole, and one that continues past a leaf extends it."""
    siblings, parent, pos = roots, -1, 0
    while pos < seq.size:
        child = siblings.get(int(seq[pos]))
        if child is None:
            edges.append(_Edge(seq[pos:].copy(), parent, {}))
            siblings[int(seq[pos])] = len(edges) - 1
            return
        edge = edges[child]
        match = _common_prefix(edge.tokens, seq[pos:])
        if match == seq.size - pos:
            return  # the rest of seq lies inside this edge
        if match == edge.tokens.size and not edge.children:  # extend a leaf: runs stay maximal
            edge.tokens = np.concatenate([edge.tokens, seq[pos + match:]])
            return
        if match < edge.tokens.size:  # diverges inside the edge: split it at `match`
            tail = _Edge(edge.tokens[match:], child, edge.children)
            edges.append(tail)
            for grandchild in tail.children.values():
                edges[grandchild].parent = len(edges) - 1
            edge.tokens, edge.children = edge.tokens[:match], {int(tail.tokens[0]): len(edges) - 1}
        siblings, parent, pos = edge.children, child, pos + match


def _preorder(edges: list[_Edge], roots: dict[int, int]) -> list[int]:
    order: list[int] = []
    stack = list(reversed(roots.values()))
    while stack:
        e = stack.pop()
        order.append(e)
        stack.extend(reversed(edges[e].children.values()))
    return order


@dataclass
class Trie:
    """Flat arrays; S segments, N nodes, U LM rows, R loss rows. All int64 unless noted, on the CPU.

    tokens_N, depth_N: token id and path depth of each node (pre-order).
    seg_start_S, seg_len_S, seg_end_S: node range of a segment and the end of its subtree.
    seg_parent_S: parent segment, -1 for a root. seg_depth_S: depth of a segment's first node.
    seg_num_children_S: 0 for a leaf segment, whose last node is a label only and never runs forward.
    lm_node_U, lm_label_U, lm_temperature_U (float64): the distinct (predicting node, label, temperature).
    row_lm_R, row_sample_R, row_pos_R: each loss row's LM row, sample index and completion position.
    seg_lm_ptr_S1, seg_row_ptr_S1: CSR pointers of the LM rows / loss rows of each segment (both sorted
    by node). sample_path: per sample, the segments of its path (for tests and tools).
    """

    tokens_N: torch.Tensor
    depth_N: torch.Tensor
    seg_start_S: torch.Tensor
    seg_len_S: torch.Tensor
    seg_end_S: torch.Tensor
    seg_parent_S: torch.Tensor
    seg_depth_S: torch.Tensor
    seg_num_children_S: torch.Tensor
    lm_node_U: torch.Tensor
    lm_label_U: torch.Tensor
    lm_temperature_U: torch.Tensor
    row_lm_R: torch.Tensor
    row_sample_R: torch.Tensor
    row_pos_R: torch.Tensor
    seg_lm_ptr_S1: torch.Tensor
    seg_row_ptr_S1: torch.Tensor
    sample_path: list[list[int]]
    num_logical_tokens: int

    @property
    def num_segments(self) -> int:
        return self.seg_start_S.numel()

    @property
    def num_unique_tokens(self) -> int:
        return self.tokens_N.numel()

    @property
    def input_len_S(self) -> torch.Tensor:
        """Nodes of each segment that run forward: all but a leaf segment's last (a label only)."""
        return self.seg_len_S - (self.seg_num_children_S == 0).to(torch.int64)

    @property
    def num_forward_tokens(self) -> int:
        return int(self.input_len_S.sum())

    @property
    def is_input_N(self) -> torch.Tensor:
        """bool [N]: nodes that run forward."""
        out = torch.ones(self.num_unique_tokens, dtype=torch.bool)
        leaves = self.seg_num_children_S == 0
        out[(self.seg_start_S + self.seg_len_S - 1)[leaves]] = False
        return out

    def attention_pairs(self) -> int:
        """Query-key pairs of an exact tree computation: each forward node attends to its path (depth + 1)."""
        return int((self.depth_N[self.is_input_N] + 1).sum())

    def roots(self) -> list[int]:
        return torch.nonzero(self.seg_parent_S < 0).flatten().tolist()


def build_trie(samples: Sequence[TrainSample]) -> Trie:
    """The trie (a forest: one root per distinct first token) of all samples' prompt + completion ids."""
    assert samples
    seqs = [torch.cat([s.prompt_ids, s.completion_ids]).numpy() for s in samples]
    edges: list[_Edge] = []
    roots: dict[int, int] = {}
    for seq in seqs:
        _insert(edges, roots, seq)
    order = _preorder(edges, roots)
    new_index = {old: new for new, old in enumerate(order)}
    seg_len = np.array([edges[e].tokens.size for e in order], dtype=np.int64)
    seg_start = np.cumsum(seg_len) - seg_len
    seg_parent = np.array([new_index.get(edges[e].parent, -1) for e in order], dtype=np.int64)
    seg_children = np.array([len(edges[e].children) for e in order], dtype=np.int64)
    seg_depth = np.zeros(len(order), dtype=np.int64)
    for s in range(len(order)):  # parents precede children in pre-order
        if seg_parent[s] >= 0:
            seg_depth[s] = seg_depth[seg_parent[s]] + seg_len[seg_parent[s]]
    seg_end = seg_start + seg_len
    for s in reversed(range(len(order))):
        if seg_parent[s] >= 0:
            seg_end[seg_parent[s]] = max(seg_end[seg_parent[s]], seg_end[s])
    tokens = np.concatenate([edges[e].tokens for e in order]).astype(np.int64)
    depth = np.concatenate([np.arange(d, d + n) for d, n in zip(seg_depth, seg_len, strict=True)])
    children_by_token = [{t: new_index[c] for t, c in edges[e].children.items()} for e in order]
    root_by_token = {t: new_index[e] for t, e in roots.items()}
    paths = [_path(seq, root_by_token, children_by_token, seg_len) for seq in seqs]
    trie_arrays = dict(
        tokens_N=tokens, depth_N=depth, seg_start_S=seg_start, seg_len_S=seg_len, seg_end_S=seg_end,
        seg_parent_S=seg_parent, seg_depth_S=seg_depth, seg_num_children_S=seg_children,
    )
    rows = _loss_rows(samples, paths, seg_start, seg_depth, seg_len)
    out = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in {**trie_arrays, **rows}.items()}
    return Trie(**out, sample_path=paths, num_logical_tokens=sum(s.num_tokens for s in samples))


def _path(seq: np.ndarray, roots: dict[int, int], children: list[dict[int, int]],
          seg_len: np.ndarray) -> list[int]:
    path, siblings, depth = [], roots, 0
    while depth < seq.size:
        seg = siblings[int(seq[depth])]
        path.append(seg)
        depth += int(seg_len[seg])
        siblings = children[seg]
    return path


def _loss_rows(samples: Sequence[TrainSample], paths: list[list[int]], seg_start: np.ndarray,
               seg_depth: np.ndarray, seg_len: np.ndarray) -> dict[str, np.ndarray]:
    """Loss rows (sorted by predicting node), their distinct LM rows, and CSR pointers per segment."""
    nodes, labels, temps, sample_idx, pos = [], [], [], [], []
    for i, (s, path) in enumerate(zip(samples, paths, strict=True)):
        path_arr = np.asarray(path, dtype=np.int64)
        starts = seg_depth[path_arr]
        loss_pos = s.loss_positions.numpy()
        pred_depth = loss_pos + (s.num_prompt_tokens - 1)
        k = np.searchsorted(starts, pred_depth, side="right") - 1
        seg = path_arr[k]
        nodes.append(seg_start[seg] + pred_depth - starts[k])
        labels.append(s.completion_ids.numpy()[loss_pos])
        temps.append(np.full(pred_depth.size, s.temperature, dtype=np.float64))
        sample_idx.append(np.full(pred_depth.size, i, dtype=np.int64))
        pos.append(loss_pos)
    node, label, temp = np.concatenate(nodes), np.concatenate(labels).astype(np.int64), np.concatenate(temps)
    temp_values, temp_idx = np.unique(temp, return_inverse=True)
    key = (node * temp_values.size + temp_idx) * (int(label.max()) + 1) + label
    lm_key, row_lm = np.unique(key, return_inverse=True)  # sorted by key, hence by node
    lm_index = np.zeros(lm_key.size, dtype=np.int64)
    lm_index[row_lm] = np.arange(row_lm.size)  # any row of each LM row, to read its fields back
    order = np.argsort(row_lm, kind="stable")
    lm_node = node[lm_index]
    # Segments tile the nodes in order: a segment's rows start where its first node's rows start.
    bounds = np.append(seg_start, seg_start[-1] + seg_len[-1])
    return dict(
        lm_node_U=lm_node, lm_label_U=label[lm_index], lm_temperature_U=temp[lm_index],
        row_lm_R=row_lm[order], row_sample_R=np.concatenate(sample_idx)[order],
        row_pos_R=np.concatenate(pos)[order],
        seg_lm_ptr_S1=np.searchsorted(lm_node, bounds),
        seg_row_ptr_S1=np.searchsorted(node[order], bounds),
    )
