"""LoRA: low-rank adapters (peft) on the policy's linear layers; only the adapters train.

    attach(model, model.lora)   peft injects lora.Linear modules in place (same names, so branch-replay's
                                forward, which calls the modules, runs them); every other weight is frozen
    merge(state)                what generators and from_pretrained get: base + B @ A * alpha / r under the
                                base model's names, a plain state dict of the original architecture (from
                                the local state dict, or the full one FSDP2 gathers on rank 0)
    save(...)                   a checkpoint's merged model, and CHECKPOINT/adapter/ (adapter_config.json,
                                adapter_model.safetensors) that PeftModel.from_pretrained(base, ...) loads

The base weights are never merged in place (merge + unmerge would round them each step). peft is an
optional extra: pip install 'tailrace[lora]'. Test: pytest tests/engine/trainer/test_lora.py
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tailrace.engine.config import LoRAConfig

log = logging.getLogger("tailrace.trainer")

ADAPTER = "default"  # peft's name of the one adapter
ADAPTER_DIR = "adapter"  # inside a checkpoint folder; beside, not inside, the merged model (see save)
_LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise ValueError("model.lora: r > 0 needs peft, which is not installed: pip install 'tailrace[lora]' "
                         "(or set model.lora.r = 0 to train the full model)") from None
    return peft


def attach(model: nn.Module, config: LoRAConfig) -> Any:
    """Inject the adapters into `model` in place and freeze the rest; returns the PeftModel wrapping it
    (for save_pretrained), or None when config.r is 0. The adapters' A is drawn from torch's RNG, B is 0,
    so the model starts as the base model (the same on every rank, which seeds alike). Call it before
    FSDP2 shards the model: fully_shard keeps frozen and trainable parameters in one unit."""
    if not config.enabled:
        return None
    peft = _peft()
    targets = "all-linear" if tuple(config.target_modules) == ("all-linear",) else list(config.target_modules)
    peft_config = peft.LoraConfig(r=config.r, lora_alpha=config.alpha, lora_dropout=config.dropout,
                                  target_modules=targets, bias="none", task_type="CAUSAL_LM")
    try:
        with warnings.catch_warnings():  # peft asks transformers a deprecated is_gradient_checkpointing
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            wrapped = peft.get_peft_model(model, peft_config)
    except ValueError as exc:  # peft: target modules not found in the base model
        raise ValueError(f"model.lora.target_modules: {exc}") from None
    _check_targets(model)
    trainable, total = parameter_counts(model)
    log.info("LoRA r=%d alpha=%g on %s: %d trainable parameters of %d (%.3f%%)", config.r, config.alpha,
             targets, trainable, total, 100.0 * trainable / total)
    return wrapped


def _check_targets(model: nn.Module) -> None:
    """Adapters only on the decoder layers' linear layers: the LM head and the embedding are read as plain
    weights by the log-prob kernel and the generators' loaders."""
    from peft.tuners.lora import Linear

    decoder_layers = {id(m) for layer in model.get_decoder().layers for m in layer.modules()}
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        short = name.rsplit(".", 1)[-1]
        if not isinstance(module, Linear) or id(module) not in decoder_layers or short not in _LAYER_LINEARS:
            raise ValueError(f"model.lora.target_modules: {name!r} cannot take an adapter; tailrace adapts the "
                             f"decoder layers' linear layers only ({', '.join(_LAYER_LINEARS)})")
        if module.use_dora.get(ADAPTER) or module.fan_in_fan_out:
            raise ValueError(f"model.lora: {name!r} is a DoRA or transposed layer, which tailrace does not merge")


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, all) parameter element counts, a tied parameter counted once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def scalings(model: nn.Module) -> dict[str, float]:
    """Module name -> alpha / r of every adapted layer (names as in model.state_dict())."""
    return {name: float(module.scaling[ADAPTER]) for name, module in model.named_modules()
            if hasattr(module, "lora_A") and ADAPTER in module.scaling}


@torch.no_grad()
def merge(state: dict[str, torch.Tensor], scaling: dict[str, float]) -> dict[str, torch.Tensor]:
    """A peft-injected model's state dict as the base architecture's: every adapted W becomes
    W + B @ A * scaling (accumulated in float32 or wider, then in W's dtype), the adapters' own tensors
    dropped, `.base_layer.` removed from names. Tensors that are one in `state` (tied) stay one."""
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    for key, tensor in state.items():
        if ".lora_" in key:
            continue
        name = key.replace(".base_layer.", ".")
        module = key.rsplit(".base_layer.", 1)[0] if ".base_layer." in key else None
        if module in scaling and key.endswith(".base_layer.weight"):
            a = state[f"{module}.lora_A.{ADAPTER}.weight"]
            b = state[f"{module}.lora_B.{ADAPTER}.weight"]
            acc = torch.promote_types(tensor.dtype, torch.float32)
            merged = tensor.to(acc) + (b.to(acc) @ a.to(acc)) * scaling[module]
            out[name] = merged.to(tensor.dtype).to("cpu")
            continue
        if tensor.numel() == 0 or id(tensor) not in done:
            done[id(tensor)] = tensor.detach().to("cpu", copy=True)
        out[name] = done[id(tensor)]
    return out


def local_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict() with tied names as one tensor (they come back as two views of one storage)."""
    state = {}
    by_storage: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        state[key] = by_storage.setdefault((tensor.data_ptr(), tensor.dtype, tuple(tensor.shape)), tensor)
    return state


def save(wrapped: Any, model: nn.Module, folder: str | Path, full: dict[str, torch.Tensor] | None) -> None:
    """The merged model in FOLDER (save_pretrained) and the adapter in FOLDER/adapter; `full`: the gathered
    state dict under FSDP2 (rank 0), None for the local one. The adapter is not in FOLDER itself:
    transformers' from_pretrained(FOLDER) would find adapter_config.json there and load the base model from
    its original path plus the adapter, instead of the merged weights beside it."""
    state = local_state_dict(model) if full is None else full
    model.save_pretrained(folder, state_dict=merge(state, scalings(model)))
    # The PeftModel's own names (its root holds the model as base_model.model).
    adapter = {f"base_model.model.{k}": v.detach().cpu() for k, v in state.items() if ".lora_" in k}
    wrapped.save_pretrained(Path(folder) / ADAPTER_DIR, state_dict=adapter)
