"""Backends on an external inference engine: vLLM (vllm_backend.py, and vllm_worker.py inside vLLM's
worker) and SGLang (sglang_backend.py), sharing their waiting queue and bookkeeping (engine_queue.py)."""
