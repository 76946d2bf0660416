"""Kernels for branch-replay training, each a Triton kernel + a plain-torch reference + a dispatcher:

- kernels.tree_attention: `tree_attention` over packed prefix tries (ancestor-only mask from subtree_end),
  `subtree_end_from_parents`, `mask_from_subtree_end`;
- kernels.logprobs: `chunked_logprobs` (and entropy) from hidden states and the LM head, chunk by chunk.

Import from the submodules: this package re-exports nothing, so importing it does not import Triton
(and a function never shadows the submodule of the same name). Imports nothing from engine/.
Imported only as tailrace.kernels: under a bare `kernels` (the checkout's root on sys.path) it steps
aside for Hugging Face's `kernels` (engine/_toplevel/_bare_names.py).
Test: pytest tests/kernels
"""

if "." not in __name__:  # imported as bare `kernels` because the checkout's root is on sys.path
    import runpy  # by path: a checkout whose tailrace is not installed must step aside too
    from pathlib import Path

    runpy.run_path(str(Path(__file__).parents[1] / "engine/_toplevel/_bare_names.py"))["step_aside"](__name__, __file__)
