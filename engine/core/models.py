"""Loading policy models and tokenizers: local Hugging Face checkpoints of the supported families.

`load_model("tiny")` loads the tiny model shipped under examples/tiny/, "tiny_longtail" the 12-layer one
under examples/tiny_longtail/ (both built by tools/make_tiny_model.py); any other name is a checkpoint folder (or, where the Hub is reachable, a
Hub id). Only architectures the torch backend and branch-replay are tested on are accepted.
Test: pytest tests/engine/generator/torch_backend/test_backend.py
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TINY_MODEL_PATH = Path(__file__).resolve().parents[2] / "examples" / "tiny"
"""The shipped tiny model (a source checkout or editable install; examples/ is not packaged)."""

SHIPPED_MODELS = {"tiny": TINY_MODEL_PATH, "tiny_longtail": TINY_MODEL_PATH.parent / "tiny_longtail"}
"""Names of the shipped models: "tiny" (4 layers, task reverse) and "tiny_longtail" (12 layers, task
reverse_longtail: the long-tail benchmarks' policy), both built by tools/make_tiny_model.py."""

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""Hugging Face `model_type`s of the supported families."""

_DTYPES = ("float32", "bfloat16", "float16", "float64")


def resolve_model_path(path_or_name: str | Path) -> str:
    """A name of SHIPPED_MODELS ("tiny") -> its folder; anything else unchanged. Raises ValueError when a
    shipped model is asked for but not present (a checkout without examples/)."""
    folder = SHIPPED_MODELS.get(str(path_or_name))
    if folder is None:
        return str(path_or_name)
    if not (folder / "config.json").is_file():
        raise ValueError(f"the shipped model {path_or_name!r} is missing: no config.json in {folder} "
                         "(run tools/make_tiny_model.py)")
    return str(folder)


def check_supported(config: Any) -> None:
    """Raise ValueError unless `config` (a transformers config) belongs to a supported family."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {model_type!r} is not supported; tailrace supports the Llama, "
                         f"Mistral, Qwen2 and Qwen3 families (model_type one of {', '.join(SUPPORTED_MODEL_TYPES)})")


def sliding_window(config: Any) -> int | None:
    """The sliding window some attention layers use, or None when every layer attends fully."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def _torch_dtype(dtype: Any):
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} or a torch.dtype, got {dtype!r}")
    return getattr(torch, dtype)


def load_model(path_or_name: str | Path, dtype: Any = "float32", device: Any = "cpu"):
    """A causal LM in eval mode with SDPA attention, on `device`. Raises ValueError for an
    unsupported architecture (before any weights are read) or a bad dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_path(path_or_name)
    torch_dtype = _torch_dtype(dtype)
    with _one_line_load_errors(path):
        check_supported(AutoConfig.from_pretrained(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def load_tokenizer(path_or_name: str | Path):
    """The tokenizer saved with a checkpoint ("tiny" for the shipped one)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(path_or_name)
    with _one_line_load_errors(path):
        return AutoTokenizer.from_pretrained(path)


@contextlib.contextmanager
def _one_line_load_errors(path: str) -> Iterator[None]:
    """transformers' OSError for a folder or Hub id it cannot load (not found, no network) as one line
    naming model.path."""
    try:
        yield
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"model.path: cannot load {path!r}: {first}") from None


def cache_kwarg(module: Any) -> str:
    """The keyword a Hugging Face model's forward takes its key/value cache by: transformers 5.20
    renamed past_key_values to cache (vLLM's pins are older)."""
    import inspect

    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


def eos_token_ids(model: Any, tokenizer: Any = None) -> list[int]:
    """Every end-of-sequence id the model's generation config or the tokenizer declares."""
    ids: set[int] = set()
    generation_config = getattr(model, "generation_config", None)
    for source in (getattr(generation_config, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(int(t) for t in source)
    return sorted(ids)


RUN_METHOD = "tailrace_run"
"""Name of the method engine/trainer/dist.shard_model installs on the root and every decoder layer."""


def run_as_forward(module: Any, fn: Any, *args: Any) -> Any:
    """fn(*args) as module's forward: under FSDP2 the module's unshard and gradient hooks run around it (and
    activation checkpointing, when enabled); a plain module just calls fn."""
    method = getattr(module, RUN_METHOD, None)
    return fn(*args) if method is None else method(fn, *args)
