"""Kernels for branch-replay training, each a Triton kernel + a plain-torch reference + a dispatcher:

- kernels.tree_attention: `tree_attention` over packed prefix tries (ancestor-only mask from subtree_end),
  `subtree_end_from_parents`, `mask_from_subtree_end`;
- kernels.logprobs: `chunked_logprobs` (and entropy) from hidden states and the LM head, chunk by chunk.

Import from the submodules: this package re-exports nothing, so `import kernels` does not import Triton
(and a function never shadows the submodule of the same name). Imports nothing from engine/.
Test: pytest tests/kernels
"""
