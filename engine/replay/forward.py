"""Functional forward of the supported decoder families over explicit positions, a cached prefix, a tree mask.

Branch-replay runs one trie segment (tokens at path depths start..start+L-1) against the per-layer
keys/values of its ancestors; packed mode runs the unique tokens of whole tries as one sequence with a
tree mask. Both call the model's own submodules (projections, q/k norms, MLP, RMSNorms, rotary
embedding), so weights and numerics are the model's; only which keys a query sees differs from a plain
forward. Each call runs as the forward of the root and each layer as its layer's (models.run_as_forward),
so FSDP2's unshard and gradient hooks see it. Families: Llama, Mistral, Qwen2, Qwen3 (GQA, RoPE, sliding windows measured along the path).
Test: pytest tests/engine/replay/test_replay.py
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tailrace.engine.core.models import SUPPORTED_MODEL_TYPES, run_as_forward
from tailrace.engine.replay.attention import SegmentRows, paths_attention, tree_attention_cpu
from tailrace.kernels.logprobs import chunked_logprobs
from tailrace.kernels.tree_attention import TRITON_DTYPES
from tailrace.kernels.tree_attention import tree_attention as kernel_tree_attention

_FAMILIES = "Llama, Mistral, Qwen2 and Qwen3 (model_type llama, mistral, qwen2, qwen3)"
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTN_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj"}
_LAYER_TYPES = ("full_attention", "sliding_attention")
# cos/sin of these depend on the position alone; "dynamic" and "longrope" rescale by sequence length, which
# differs between a per-sample forward and a trie.
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class DecoderSpec:
    """A validated model: its decoder parts and attention shapes. windows: per layer, the sliding window
    (a query at depth d sees keys at depths > d - window) or None."""

    root: nn.Module
    decoder: nn.Module
    lm_head: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool
    windows: tuple[int | None, ...]

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def num_layers(self) -> int:
        return len(self.windows)


def _unsupported(model_type: str | None, what: str) -> ValueError:
    return ValueError(f"branch-replay: model_type {model_type!r}: {what}; supported families are {_FAMILIES}, "
                      "whose layers hold only self-attention keys/values (no linear-attention or SSM state)")


def decoder_spec(model: nn.Module) -> DecoderSpec:
    """Validate that `model` is a decoder whose every layer replay can run exactly; raise ValueError
    naming what is missing otherwise."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    layer_types = list(getattr(config, "layer_types", None) or [])
    odd = sorted({t for t in layer_types if t not in _LAYER_TYPES})
    if odd:
        raise _unsupported(model_type, f"layer types {odd} carry state other than attention keys/values")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(model_type, "not a supported family")
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in _ROPE_TYPES:
        raise _unsupported(model_type, f"rope_type {rope!r} depends on the sequence length "
                                       f"(supported: {_ROPE_TYPES})")
    if model.training and getattr(config, "attention_dropout", 0.0):
        raise ValueError("branch-replay: attention_dropout must be 0 when training (exact gradients)")
    decoder = model.get_decoder()
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(decoder, name):
            raise _unsupported(model_type, f"the decoder has no {name!r}")
    qk_norm = model_type == "qwen3"
    for i, layer in enumerate(decoder.layers):
        children = {n for n, _ in layer.named_children()}
        attn_children = {n for n, _ in getattr(layer, "self_attn", nn.Module()).named_children()}
        want_attn = _ATTN_CHILDREN | ({"q_norm", "k_norm"} if qk_norm else set())
        if children != _LAYER_CHILDREN or attn_children != want_attn:
            odd_modules = sorted(children ^ _LAYER_CHILDREN | attn_children ^ want_attn)
            raise _unsupported(model_type, f"layer {i} has modules {odd_modules} that replay does not know")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return DecoderSpec(root=model, decoder=decoder, lm_head=model.get_output_embeddings(),
                       num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                       head_dim=head_dim, qk_norm=qk_norm, windows=_windows(config, len(decoder.layers)))


def _windows(config, num_layers: int) -> tuple[int | None, ...]:
    window = getattr(config, "sliding_window", None)
    if getattr(config, "model_type", None) == "mistral":  # Mistral: every layer, when set
        return (window,) * num_layers
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * num_layers)
    return tuple(window if t == "sliding_attention" else None for t in types)


def activation_bytes_per_token(model: nn.Module) -> int:
    """Rough bytes autograd keeps per token for a backward (all layers): inputs of every linear layer
    and norm, attention inputs/outputs, the MLP's three intermediates, in the model's dtype."""
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    per_layer = 6 * c.hidden_size + 3 * q + 4 * kv + 4 * c.intermediate_size
    return per_layer * c.num_hidden_layers * next(model.parameters()).element_size()


def kv_bytes_per_token(model: nn.Module) -> int:
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_key_value_heads * hd * c.num_hidden_layers * next(model.parameters()).element_size()


# ------------------------------------------------------------------------------------------------ layers


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope(spec: DecoderSpec, x_LD: torch.Tensor, depth_L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [L, head_dim] at path-depth positions, from the model's own rotary embedding."""
    cos, sin = spec.decoder.rotary_emb(x_LD[None], depth_L[None])
    return cos[0], sin[0]


def _qkv(spec: DecoderSpec, attn: nn.Module, x_LD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Queries [H, L, hd], keys and values [Hk, L, hd], RoPE applied (same ops as the HF attention)."""
    L = x_LD.shape[0]
    q = attn.q_proj(x_LD).view(L, spec.num_heads, spec.head_dim)
    k = attn.k_proj(x_LD).view(L, spec.num_kv_heads, spec.head_dim)
    v = attn.v_proj(x_LD).view(L, spec.num_kv_heads, spec.head_dim)
    if spec.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    q = q * cos + _rotate_half(q) * sin
    k = k * cos + _rotate_half(k) * sin
    return q, k, v


def decoder_layer(spec: DecoderSpec, i: int, h_LD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend,
                  *, as_forward: bool = True):
    """One decoder layer; attend(i, q, k, v) -> [H, L, hd] supplies the attention pattern.
    Returns the new hidden state and this layer's keys/values (for descendants). as_forward: run as the
    layer's forward (models.run_as_forward: FSDP2's hooks, activation checkpointing); False calls the
    submodules directly (layer_major.py's forward pass, which unshards the layer itself)."""
    layer = spec.decoder.layers[i]

    def body(h_LD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        attn = layer.self_attn
        q, k, v = _qkv(spec, attn, layer.input_layernorm(h_LD), cos, sin)
        o = attend(i, q, k, v)
        h_LD = h_LD + attn.o_proj(o.transpose(0, 1).reshape(h_LD.shape[0], -1))
        h_LD = h_LD + layer.mlp(layer.post_attention_layernorm(h_LD))
        return h_LD, k, v

    return run_as_forward(layer, body, h_LD, cos, sin) if as_forward else body(h_LD, cos, sin)


def forward_rows(spec: DecoderSpec, tokens_N: torch.Tensor, depth_N: torch.Tensor,
                 segments: Sequence[SegmentRows],
                 *, external: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]] = (),
                 subtree_end_N: torch.Tensor | None = None, head: Callable[[torch.Tensor], Any] | None = None):
    """One forward call over trie segments in pre-order (`segments` tile the rows) at path-depth positions.

    external: the cached prefix outside the call, per ancestor (root first), per layer (keys [Hk, l, hd],
    values), covering depths 0..; segments flagged `external` see it first. subtree_end_N: the call's tree
    mask as kernels/tree_attention takes it; with it and without an external prefix, CUDA runs that Triton
    kernel, elsewhere attention.paths_attention runs the exact pairs segment by segment.
    head: runs on the final-normed hidden inside the same root call (the LM head and loss, so that FSDP
    gathers and reduces the root once per call); its result comes fourth, else None.
    Returns (final-normed hidden [N, D], keys per layer, values per layer, head's result)."""
    masks: dict = {}  # path masks (windows, other devices), shared by the layers

    def attend(i: int, q, k, v):
        window = spec.windows[i]
        if (subtree_end_N is not None and not external and window is None and q.device.type == "cuda"
                and q.dtype in TRITON_DTYPES):
            return kernel_tree_attention(q.contiguous(), k.contiguous(), v.contiguous(), subtree_end_N,
                                         scale=spec.scale)
        if subtree_end_N is not None and not external and window is None and q.device.type == "cpu":
            return tree_attention_cpu(q, k, v, segments, subtree_end_N, scale=spec.scale, masks=masks)
        ext = ([a[i][0] for a in external], [a[i][1] for a in external]) if external else None
        return paths_attention(q, k, v, segments, scale=spec.scale, window=window, external=ext, masks=masks)

    def body(tokens_N: torch.Tensor, depth_N: torch.Tensor):
        h = spec.decoder.embed_tokens(tokens_N)
        cos, sin = rope(spec, h, depth_N)
        keys, values = [], []
        for i in range(spec.num_layers):
            h, k, v = decoder_layer(spec, i, h, cos, sin, attend)
            keys.append(k)
            values.append(v)
        h = spec.decoder.norm(h)
        return h, keys, values, None if head is None else head(h)

    return run_as_forward(spec.root, body, tokens_N, depth_N)


def segment_forward(spec: DecoderSpec, tokens_L: torch.Tensor, start_depth: int,
                    prefix: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]):
    """One trie segment at depths start_depth.. against its ancestors' keys/values (forward_rows' external)."""
    depth = torch.arange(start_depth, start_depth + tokens_L.numel(), device=tokens_L.device)
    rows = [SegmentRows(0, tokens_L.numel(), (), start_depth, external=bool(prefix))]
    return forward_rows(spec, tokens_L, depth, rows, external=prefix)[:3]


def tree_forward(spec: DecoderSpec, tokens_N: torch.Tensor, depth_N: torch.Tensor, subtree_end_N: torch.Tensor,
                 segments: Sequence[SegmentRows]) -> torch.Tensor:
    """Whole tries packed in pre-order (token j visible to i iff j <= i < subtree_end[j]): hidden [N, D]."""
    return forward_rows(spec, tokens_N, depth_N, segments, subtree_end_N=subtree_end_N)[0]


# -------------------------------------------------------------------------------------------- log-probs


def row_logprobs(spec: DecoderSpec, hidden_UD: torch.Tensor, labels_U: torch.Tensor, temperature_U: torch.Tensor,
                 *, chunk_rows: int, with_entropy: bool,
                 inside_root: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and detached entropies) of labels under softmax(lm_head(hidden) / temperature), a chunk
    of rows at a time, never [U, V] at once (kernels/logprobs.py). As its own root call, unless
    `inside_root` (called from forward_rows' head: the root's parameters are already gathered)."""
    def body(hidden_UD: torch.Tensor, labels_U: torch.Tensor):  # temperatures stay out of mixed precision's cast
        return chunked_logprobs(hidden_UD, spec.lm_head.weight, labels_U, bias_V=getattr(spec.lm_head, "bias", None),
                                temperature=temperature_U, chunk_size=chunk_rows, return_entropy=with_entropy)

    out = body(hidden_UD, labels_U) if inside_root else run_as_forward(spec.root, body, hidden_UD, labels_U)
    if not with_entropy:
        return out, None
    return out[0], out[1].detach()
