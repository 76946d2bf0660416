"""Memory plan: a training step's per-rank peak memory, predicted from a model's config before renting GPUs.

    tailrace plan --model examples/configs/qwen2.5-7b --ranks 8 --tokens 32768 --device-gb 96 [--json]

Parameter counts are exact: the model is built on the meta device from its config.json (nothing is
downloaded or allocated). The rest follows the trainer (engine/trainer/learner.py, dist.py): fp32 (param
dtype) master weights sharded over the ranks, AdamW's two moments per trainable parameter, FSDP2 gathering
in the compute dtype (train.fsdp.mixed_precision) and reducing in fp32, and one of two residencies
during a step: "layer" (one decoder layer gathered at a time, gradients reduce-scattered per layer) or
"full" (every unit gathered for the whole step, unsharded gradients accumulated, dist.gathered()).
Activations are the decoder layer's saved tensors counted from the architecture (layer_bytes_per_token);
the chunked LM head (kernels/logprobs.py) adds one [chunk, vocab] block and its fp32 weight gradient.
live_bytes() measures the same quantities on the CPU (the profiler's allocation events); the test
checks prediction against measurement on tiny models, one rank and two gloo ranks.
Test: pytest tests/engine/trainer/test_plan.py
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
RESIDENCIES = ("layer", "full")
LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LOGITS_IMPLS = ("triton", "torch")
# [chunk, vocab] float32 blocks alive at once in the chunked LM head's backward (kernels/logprobs.py):
# Triton turns the logits into their gradient in place (the block, plus its cast to the compute dtype);
# the plain-torch path keeps the logits, log-probs, probabilities, the gradient and a product term.
_LOGIT_BLOCKS = {"triton": 1.0, "torch": 5.0}


# ------------------------------------------------------------------------------------------ the model


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a decoder-only LM: its dimensions and every parameter's shape, by FSDP unit."""

    model_type: str
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    layer_params: tuple[tuple[str, tuple[int, ...]], ...]  # one decoder layer's (name, shape), layer 0
    root_params: tuple[tuple[str, tuple[int, ...]], ...]  # embedding, final norm, LM head when untied

    @property
    def num_params(self) -> int:
        return self.num_layers * _numel(self.layer_params) + _numel(self.root_params)


def _numel(params: tuple[tuple[str, tuple[int, ...]], ...]) -> int:
    return sum(math.prod(shape) for _, shape in params)


def _sharded_numel(params: tuple[tuple[str, tuple[int, ...]], ...], ranks: int) -> int:
    """FSDP2 shards each parameter on dim 0, padded to a multiple of the world size."""
    return sum(math.ceil(shape[0] / ranks) * math.prod(shape[1:]) if shape else 1 for _, shape in params)


def load_hf_config(path: str | Path) -> Any:
    """A transformers config from a checkpoint folder or a config.json file; only supported families."""
    from transformers import AutoConfig

    from tailrace.engine.core.models import check_supported, resolve_model_path

    path = Path(resolve_model_path(str(path)))
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"--model: cannot read {path}: {exc}") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise ValueError(f"--model: {path} has no model_type (a Hugging Face config.json has)")
        config = AutoConfig.for_model(**data)
    elif (path / "config.json").is_file():
        config = AutoConfig.from_pretrained(path)
    else:
        raise ValueError(f"--model: {path} is neither a config.json nor a folder holding one")
    check_supported(config)
    return config


def model_shape(config: Any) -> Shape:
    """Shape of the model `config` describes, its parameters read off a meta-device build (exact counts)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = model.get_decoder().layers
    in_layer = {id(p) for p in layers.parameters()}
    root = tuple((n, tuple(p.shape)) for n, p in model.named_parameters() if id(p) not in in_layer)
    layer = tuple((n, tuple(p.shape)) for n, p in layers[0].named_parameters())
    assert all(_numel(tuple((n, tuple(p.shape)) for n, p in m.named_parameters())) == _numel(layer)
               for m in layers), "decoder layers of different sizes"
    heads = config.num_attention_heads
    return Shape(model_type=config.model_type, hidden=config.hidden_size, intermediate=config.intermediate_size,
                 num_layers=len(layers), num_heads=heads,
                 num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                 head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                 vocab=config.vocab_size, tied=bool(getattr(config, "tie_word_embeddings", False)),
                 layer_params=layer, root_params=root)


def lora_params(shape: Shape, r: int, targets: tuple[str, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """One layer's adapter parameters (peft: A [r, in], B [out, r] per targeted linear, no bias)."""
    names = LAYER_LINEARS if tuple(targets) == ("all-linear",) else tuple(targets)
    out = []
    for name, (rows, cols) in ((n, s) for n, s in shape.layer_params if n.endswith(".weight") and len(s) == 2):
        module = name.rsplit(".", 2)[-2]
        if module in names:
            out += [(f"{name}.lora_A", (r, cols)), (f"{name}.lora_B", (rows, r))]
    if not out:
        raise ValueError(f"--lora-targets: none of {list(targets)} is a linear layer of the decoder layers")
    return tuple(out)


# ------------------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Settings:
    """A step's settings that change its memory (the trainer's names in the comments)."""

    ranks: int = 1  # trainer ranks (FSDP2 world size)
    tokens: int = 4096  # padded tokens per micro-batch on each rank (train.micro_batch_tokens)
    residency: str = "layer"  # train.fsdp.step_residency: layer | full
    param_dtype: str = "float32"  # model.dtype: the sharded master weights, gradients and AdamW moments
    compute_dtype: str = "bfloat16"  # train.fsdp.mixed_precision bf16 (float32 = off); one rank: param_dtype
    gradient_checkpointing: bool = False  # train.gradient_checkpointing
    cpu_offload: bool = False  # train.fsdp.cpu_offload: sharded weights, gradients, moments in host memory
    lora_r: int = 0  # model.lora.r (0: every parameter trains)
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")  # model.lora.target_modules
    logprob_chunk_tokens: int = 1024  # train.logprob_chunk_tokens
    row_tokens: int = 0  # padded rows of this many tokens (a padding mask); 0: rows without padding (no mask)
    logits_impl: str = "triton"  # the chunked LM head's kernels: triton (CUDA), torch (CPU)

    def __post_init__(self):
        for name, ok, why in (
            ("--ranks", self.ranks >= 1, "must be >= 1"), ("--tokens", self.tokens >= 1, "must be >= 1"),
            ("--residency", self.residency in RESIDENCIES, f"must be one of {', '.join(RESIDENCIES)}"),
            ("--param-dtype", self.param_dtype in DTYPE_BYTES, f"must be one of {', '.join(DTYPE_BYTES)}"),
            ("--compute-dtype", self.compute_dtype in DTYPE_BYTES, f"must be one of {', '.join(DTYPE_BYTES)}"),
            ("--lora-r", self.lora_r >= 0, "must be >= 0"),
            ("--logprob-chunk-tokens", self.logprob_chunk_tokens >= 1, "must be >= 1"),
            ("--row-tokens", 0 <= self.row_tokens <= self.tokens, "must be in [0, --tokens]"),
            ("--logits-impl", self.logits_impl in LOGITS_IMPLS, f"must be one of {', '.join(LOGITS_IMPLS)}")):
            if not ok:
                raise ValueError(f"{name}: {why}")

    @property
    def effective_compute_dtype(self) -> str:
        """One rank runs unsharded, in the model's own dtype (dist.shard_model applies no policy there)."""
        return self.param_dtype if self.ranks == 1 else self.compute_dtype


def layer_bytes_per_token(shape: Shape, compute_bytes: int, row_tokens: int = 0) -> int:
    """Bytes a decoder layer (HF Llama/Qwen2/Qwen3/Mistral, SDPA) saves for backward, per token.

    Each RMSNorm: its float32 input (pow, mul) + the normalised value cast back (weight *) + its output
    (the projections' input). Attention: SDPA's query, key, value, output (also o_proj's input: flash
    kernels write it [tokens, heads, dim], so HF's transpose + contiguous copies nothing) and float32
    logsumexp per head; key and value have the KV heads, or every head when a padding mask makes HF
    repeat them (use_gqa_in_sdpa), and then SDPA also keeps the mask as an additive float bias of
    [rows, 1, row, row] (row_tokens per token). MLP: gate, SiLU(gate), up, their product.
    Cos/sin and HF's boolean mask are shared by all layers (shared_bytes_per_token)."""
    h, b = shape.hidden, compute_bytes
    norms = 2 * (4 * h + 2 * b * h)
    q = shape.num_heads * shape.head_dim
    kv = (shape.num_heads if row_tokens else shape.num_kv_heads) * shape.head_dim
    attention = b * (q + 2 * kv + q + row_tokens) + 4 * shape.num_heads
    mlp = 4 * shape.intermediate * b
    return norms + attention + mlp


def shared_bytes_per_token(shape: Shape, compute_bytes: int, row_tokens: int = 0) -> int:
    """Saved once per micro-batch: the final norm (as one layer's norm) and the LM head's input rows (every
    token a loss row at worst), rotary cos and sin, HF's boolean padding mask."""
    h, b = shape.hidden, compute_bytes
    return (4 * h + b * h) + b * h + 2 * shape.head_dim * b + row_tokens


def backward_bytes_per_token(shape: Shape, compute_bytes: int) -> int:
    """The decoder backward's working set above the saved tensors it has not yet released: the hidden
    state's gradient coming in and going out, and one [tokens, intermediate] gradient (the MLP's product
    rule makes two before the node releases the two values it saved). Checked by measurement, not derived
    from the allocator: tests/engine/trainer/test_plan.py."""
    return compute_bytes * (2 * shape.hidden + shape.intermediate)


@dataclass(frozen=True)
class Plan:
    """Bytes per rank (see predict); `peak` is the largest of the step's phases, named in `peak_phase`."""

    params: int
    optimizer: int
    grads: int
    unsharded_params: int
    unsharded_grads: int
    reduce_buffer: int
    activations: int
    backward_working: int
    logits: int
    peak_fwd_bwd: int
    peak_reduce: int
    peak_optimizer: int
    num_params: int
    trainable_params: int

    @property
    def peak(self) -> int:
        return max(self.peak_fwd_bwd, self.peak_reduce, self.peak_optimizer)

    @property
    def peak_phase(self) -> str:
        return max((self.peak_fwd_bwd, "forward/backward"), (self.peak_reduce, "gradient reduce"),
                   (self.peak_optimizer, "optimizer"))[1]


def activation_bytes(shape: Shape, s: Settings) -> int:
    """Saved activations of one micro-batch of s.tokens tokens at the end of its forward: every layer's
    saved tensors, or with activation checkpointing only each layer's input."""
    b = DTYPE_BYTES[s.effective_compute_dtype]
    per_layer = shape.hidden * b if s.gradient_checkpointing else layer_bytes_per_token(shape, b, s.row_tokens)
    return s.tokens * (shape.num_layers * per_layer + shared_bytes_per_token(shape, b, s.row_tokens))


def backward_working_bytes(shape: Shape, s: Settings) -> int:
    """What a decoder layer's backward adds to the saved activations: its working set and, with activation
    checkpointing, the layer's recomputed activations."""
    b = DTYPE_BYTES[s.effective_compute_dtype]
    recomputed = layer_bytes_per_token(shape, b, s.row_tokens) if s.gradient_checkpointing else 0
    return s.tokens * (backward_bytes_per_token(shape, b) + recomputed)


def logits_bytes(shape: Shape, s: Settings) -> int:
    """The chunked LM head's backward (before any decoder layer's): its float32 weight gradient, the
    gradient of its input rows, and one [chunk, vocab] working block or, once the chunks are done, the weight
    gradient cast to the compute dtype."""
    chunk = min(s.logprob_chunk_tokens, s.tokens)
    b = DTYPE_BYTES[s.effective_compute_dtype]
    cast = b if b != 4 else 0
    block = int(chunk * shape.vocab * (4 * _LOGIT_BLOCKS[s.logits_impl] + cast))
    return shape.vocab * shape.hidden * 4 + s.tokens * shape.hidden * b + max(block, shape.vocab * shape.hidden * cast)


def predict(shape: Shape, s: Settings) -> Plan:
    """Per-rank bytes of one training step with micro-batches of s.tokens tokens (at least two per step, so
    earlier micro-batches' gradients are held while the last one's activations are)."""
    W, pb = s.ranks, DTYPE_BYTES[s.param_dtype]
    cb = DTYPE_BYTES[s.effective_compute_dtype]
    adapters = lora_params(shape, s.lora_r, s.lora_targets) if s.lora_r > 0 else ()
    layer_trainable = adapters if s.lora_r > 0 else shape.layer_params
    root_trainable = () if s.lora_r > 0 else shape.root_params
    layer_all = shape.layer_params + adapters
    num_all = shape.num_layers * _numel(layer_all) + _numel(shape.root_params)
    num_trainable = shape.num_layers * _numel(layer_trainable) + _numel(root_trainable)
    sharded_all = shape.num_layers * _sharded_numel(layer_all, W) + _sharded_numel(shape.root_params, W)
    sharded_trainable = shape.num_layers * _sharded_numel(layer_trainable, W) + _sharded_numel(root_trainable, W)
    on_device = 0 if s.cpu_offload and W > 1 else 1
    params = on_device * sharded_all * pb
    optimizer = on_device * sharded_trainable * 2 * pb
    grads = on_device * sharded_trainable * pb
    # FSDP2 reduces in float32 under mixed precision (dist.mixed_precision_policy), else in the param dtype:
    # a unit's gradients are copied into one flat reduce-scatter input, and its output is a shard of it.
    rb = 4 if cb != pb else pb
    largest_unit = max(_numel(layer_trainable), _numel(root_trainable))
    if W == 1:
        unsharded_params = unsharded_grads = reduce_buffer = 0
        held_grads = grads  # the earlier micro-batches' gradients (the grads themselves)
    elif s.residency == "full":
        unsharded_params = num_all * cb
        # Without gradient sync FSDP2 accumulates a unit's gradients upcast to the reduce dtype.
        unsharded_grads = num_trainable * rb
        reduce_buffer = largest_unit * rb + math.ceil(largest_unit / W) * rb
        held_grads = 0  # sharded gradients appear at the step's reduce, after the last backward
    else:  # the root stays gathered through forward and backward; a layer and its prefetched neighbour
        unsharded_params = (_numel(shape.root_params) + 2 * _numel(layer_all)) * cb
        unsharded_grads = (_numel(root_trainable) + _numel(layer_trainable)) * cb
        reduce_buffer = _numel(layer_trainable) * rb + math.ceil(_numel(layer_trainable) / W) * rb
        held_grads = grads  # reduce-scattered into the sharded gradients every micro-batch
    activations = activation_bytes(shape, s)
    backward_working = backward_working_bytes(shape, s)
    logits = logits_bytes(shape, s)
    base = params + optimizer + held_grads + unsharded_params + activations
    # The LM head's backward runs first (its weight gradient is the fp32 accumulator in `logits`), then the
    # layers' one at a time, so their working sets never meet. Full residency holds the earlier micro-batches'
    # unsharded gradients at both moments; layer residency only a layer's (and the root's) while it reduces.
    head = base + logits + (unsharded_grads if s.residency == "full" else 0)
    layers = base + unsharded_grads + backward_working + (reduce_buffer if s.residency == "layer" else 0)
    peak_fwd_bwd = max(head, layers)
    base = params + optimizer
    peak_reduce = base + unsharded_params + unsharded_grads + grads + reduce_buffer if W > 1 else 0
    # AdamW: fused on one rank (no temporaries); sharded DTensors take the foreach path, which holds a
    # list of sqrt(exp_avg_sq) the size of the shard.
    peak_optimizer = base + grads + (grads if W > 1 else 0)
    return Plan(params=params, optimizer=optimizer, grads=grads, unsharded_params=unsharded_params,
                unsharded_grads=unsharded_grads, reduce_buffer=reduce_buffer, activations=activations,
                backward_working=backward_working, logits=logits, peak_fwd_bwd=peak_fwd_bwd,
                peak_reduce=peak_reduce, peak_optimizer=peak_optimizer, num_params=num_all,
                trainable_params=num_trainable)


def max_tokens(shape: Shape, s: Settings, budget_bytes: float) -> int:
    """The most tokens per micro-batch whose peak fits in budget_bytes (0: not even one token); rows stay
    s.row_tokens long (shorter when the micro-batch is)."""

    def fits(tokens: int) -> bool:
        return predict(shape, replace(s, tokens=tokens, row_tokens=min(s.row_tokens, tokens))).peak <= budget_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 40:
            return lo
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ---------------------------------------------------------------------------------------- measurement


@contextmanager
def live_bytes() -> Iterator[dict[str, int]]:
    """Inside: every CPU allocation and free is recorded (torch.profiler with profile_memory); on exit the
    dict holds "peak" and "end", the most bytes alive at once and those alive at the end, both counted from
    the bytes alive on entry. The CPU's stand-in for torch.cuda.max_memory_allocated. Garbage left from
    before is collected first, so that its frees do not count against what is measured."""
    import gc

    import torch
    from torch.profiler import ProfilerActivity, profile

    result: dict[str, int] = {}
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    result.update(peak=peak, end=live)


# ---------------------------------------------------------------------------------------------- output


ROWS = (("params", "parameters (sharded, param dtype)"), ("optimizer", "AdamW moments (sharded)"),
        ("grads", "gradients (sharded)"), ("unsharded_params", "gathered parameters (compute dtype)"),
        ("unsharded_grads", "unsharded gradients"), ("reduce_buffer", "reduce-scatter buffers"),
        ("activations", "activations, one micro-batch"), ("backward_working", "backward working set"),
        ("logits", "LM head chunk + fp32 weight grad"))


_PHASE_NAMES = {"forward/backward": "fwd/bwd", "gradient reduce": "reduce", "optimizer": "optimizer"}


def report(shape: Shape, s: Settings, device_gb: float, reserve_gb: float) -> dict[str, Any]:
    """Both residencies, with and without activation checkpointing: the plan and the tokens that fit."""
    budget = (device_gb - reserve_gb) * GB
    out: dict[str, Any] = {"model": {"model_type": shape.model_type, "num_params": shape.num_params,
                                     "hidden": shape.hidden, "intermediate": shape.intermediate,
                                     "num_layers": shape.num_layers, "num_heads": shape.num_heads,
                                     "num_kv_heads": shape.num_kv_heads, "vocab": shape.vocab, "tied": shape.tied},
                           "settings": asdict(s), "device_gb": device_gb, "reserve_gb": reserve_gb, "plans": []}
    residencies = RESIDENCIES if s.ranks > 1 else ("layer",)
    for residency in residencies:
        for ckpt in (False, True):
            si = replace(s, residency=residency, gradient_checkpointing=ckpt)
            plan = predict(shape, si)
            fit = max_tokens(shape, si, budget)
            out["plans"].append({"residency": residency if s.ranks > 1 else "unsharded", "checkpointing": ckpt,
                                 **asdict(plan), "peak": plan.peak, "peak_phase": plan.peak_phase,
                                 "fits": plan.peak <= budget, "max_tokens": fit,
                                 "max_tokens_all_ranks": fit * s.ranks})
    return out


def format_report(rep: dict[str, Any]) -> str:
    m, s, plans = rep["model"], rep["settings"], rep["plans"]
    heads = [f"{p['residency']}{' +ckpt' if p['checkpointing'] else ''}" for p in plans]
    lines = [f"{m['model_type']}: {m['num_params'] / 1e9:.3f}B parameters (hidden {m['hidden']}, intermediate "
             f"{m['intermediate']}, {m['num_layers']} layers, {m['num_heads']} heads / {m['num_kv_heads']} KV, "
             f"vocab {m['vocab']}, {'tied' if m['tied'] else 'untied'} LM head)",
             f"{s['ranks']} ranks, {s['tokens']} tokens per micro-batch per rank, master weights {s['param_dtype']}, "
             f"compute {s['compute_dtype'] if s['ranks'] > 1 else s['param_dtype']}, AdamW"
             + (f", LoRA r={s['lora_r']}" if s['lora_r'] else "") + (", CPU offload" if s['cpu_offload'] else ""),
             f"per rank, GB (1e9 bytes); budget {rep['device_gb']:g} GB - {rep['reserve_gb']:g} GB reserve", ""]
    width = max(len(label) for _, label in ROWS) + 2
    lines.append(" " * width + "".join(f"{h:>14}" for h in heads))
    for key, label in ROWS:
        lines.append(f"{label:<{width}}" + "".join(f"{p[key] / GB:>14.2f}" for p in plans))
    lines.append(f"{'peak':<{width}}" + "".join(f"{p['peak'] / GB:>14.2f}" for p in plans))
    lines.append(f"{'peak during':<{width}}" + "".join(f"{_PHASE_NAMES[p['peak_phase']]:>14}" for p in plans))
    lines.append(f"{'fits':<{width}}" + "".join(f"{'yes' if p['fits'] else 'NO':>14}" for p in plans))
    lines.append(f"{'max tokens / micro-batch / rank':<{width}}" + "".join(f"{p['max_tokens']:>14,}" for p in plans))
    lines.append(f"{'  x ranks':<{width}}" + "".join(f"{p['max_tokens_all_ranks']:>14,}" for p in plans))
    return "\n".join(lines)


def main(args: Any, overrides: list[str] | None = None) -> int:
    """`tailrace plan` (engine/cli.py parses its flags; it takes no dotted settings)."""
    shape = model_shape(load_hf_config(args.model))
    settings = Settings(ranks=args.ranks, tokens=args.tokens,
                        param_dtype=_DTYPE_ALIASES.get(args.param_dtype, args.param_dtype),
                        compute_dtype=_DTYPE_ALIASES.get(args.compute_dtype, args.compute_dtype), cpu_offload=args.cpu_offload, lora_r=args.lora_r,
                        lora_targets=tuple(t for t in args.lora_targets.split(",") if t),
                        logprob_chunk_tokens=args.logprob_chunk_tokens, row_tokens=args.row_tokens,
                        logits_impl=args.logits_impl)
    if args.device_gb <= args.reserve_gb:
        raise ValueError("--device-gb: must be more than --reserve-gb")
    rep = report(shape, settings, args.device_gb, args.reserve_gb)
    if args.residency:
        rep["plans"] = [p for p in rep["plans"] if p["residency"] in (args.residency, "unsharded")]
    print(json.dumps(rep) if args.json else format_report(rep))
    return 0
