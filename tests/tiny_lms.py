"""The tests' one builder of tiny Hugging Face causal LMs from configs (no hub access, no files).

Tests reach it only through fixtures: `tiny_lm` (tests/conftest.py) and the presets built on it in the
conftest.py files below (exact_model for gradient tests, make_model for the generator's, learner_model and
tied_model for the trainer's). tests/engine/trainer/dist_worker.py, a script torchrun starts, loads this
file by its path. Run: the tests that use it, e.g. pytest tests/engine/replay tests/engine/generator
"""

from __future__ import annotations

import types

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}
# Two layers, grouped-query attention (4 query heads over 2 key/value heads); every argument may override.
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=64, max_position_embeddings=128)


def build(arch: str = "qwen2", *, seed: int = 0, dtype: torch.dtype | None = None, attn: str | None = None,
          **config) -> torch.nn.Module:
    """A model of the family `arch` (llama, qwen2, qwen3, mistral) from SHAPE updated by `config`, its
    weights drawn right after torch.manual_seed(seed), in training mode as from_config leaves it; cast to
    `dtype` and given `attn` as attn_implementation only when they are given (else the library defaults)."""
    if arch not in CONFIGS:
        raise ValueError(f"arch: {arch!r} is not one of {sorted(CONFIGS)}")
    model_config = CONFIGS[arch](**{**SHAPE, **config})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config, **({} if attn is None else {"attn_implementation": attn}))
    return model if dtype is None else model.to(dtype)


def exact_norms(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every RMSNorm computing in the model's dtype: Hugging Face's computes in float32 even in
    a float64 model, which leaves ~1e-8 relative differences between evaluation orders (exact_model in
    tests/engine/conftest.py). Returns the model, changed in place."""

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(forward, module)
    return model
