"""The built-in torch backend: continuous batching (backend.py) over a slot KV cache (kv.py), fixed-shape
forwards for CUDA graphs (graphs.py) and tree-sampled groups (tree.py)."""
