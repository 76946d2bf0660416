"""Runs inside vLLM's worker (worker_extension_cls): loads tailrace's weights into the running model.

The backend sends (name, raw bytes, dtype, shape) per tensor: collective_rpc serialises its arguments,
and tensors do not survive that as tensors. Loading goes through the worker's reload path, which
re-runs the model's own weight processing (CPU builds prepack linear layers, so a plain load_weights
into the packed modules fails); a tied LM head is re-pointed at the new embedding afterwards.
Imported by vLLM by name; needs vllm. Test: pytest tests/engine/generator/engine_backends/test_vllm_backend.py
"""

from __future__ import annotations

import torch


def pack(weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, bytes, str, tuple[int, ...]]]:
    """The wire form of a state dict (the backend's side)."""
    out = []
    for name, tensor in weights:
        flat = tensor.detach().to("cpu").contiguous()
        out.append((name, flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"",
                    str(flat.dtype).removeprefix("torch."), tuple(flat.shape)))
    return out


def unpack(payload: list) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, data, dtype, shape in payload:
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        out.append((name, raw.view(getattr(torch, dtype)).reshape(tuple(shape))))
    return out


class WeightLoader:
    """Mixed into vLLM's worker class: self is the worker (it has model_runner)."""

    def tailrace_load_weights(self, payload: list) -> int:
        weights = unpack(payload)
        self.model_runner.reload_weights(weights_iterator=iter(weights))
        model = self.model_runner.get_model()
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            model.lm_head.weight = model.model.embed_tokens.weight
        return len(weights)
