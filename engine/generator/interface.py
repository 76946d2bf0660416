"""The Backend interface: what the generator service needs from whatever samples tokens, and the factory
that builds the one `generator.backend` names.

    service ---add(Request)------------> backend      one sample per request (group_id, sample_id, sampling)
            ---step()  (worker thread)-> backend  ->  list[Finished], each sample as soon as it finishes
            ---update_weights(pairs, v)> backend      between steps; later tokens are stamped with v
            ---cancel(groups) / drain()> backend  ->  list[Finished]
            ---resume(key, ids) / finish(key, reason)  multi-turn episodes (EpisodeHooks, torch only)

Backends: torch (backend.TorchBackend, built in), vllm (vllm_backend.VLLMBackend), sglang
(sglang_backend.SGLangBackend), and the benchmark's modelled one (tools/benches/modelled.py). Each owns
its model loading: load_backend(cfg) is all the service calls. The drafter's speculative decoding and
tree sampling are torch-only (SpeculationHooks); the vLLM backend speculates with vLLM's own
speculative_config instead (engine_backends/vllm_backend.py); config validation refuses speculation elsewhere.
Multi-turn episodes (env.max_turns > 1, engine/generator/episodes.py) need EpisodeHooks: the torch backend has
them; the config refuses env.max_turns > 1 with the others (RunConfig).
Test: pytest tests/engine/generator/test_backend_conformance.py (the vLLM half needs vllm installed)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from tailrace.engine.config import RunConfig
from tailrace.engine.generator.requests import BackendStats, Finished, Request, Weights


@runtime_checkable
class Backend(Protocol):
    """A continuous-batching sampler owned by one thread at a time (the service's main loop and the
    worker thread it runs step() in never overlap)."""

    name: str                 # "torch", "vllm", "sglang", "modelled": sent in the Hello capabilities
    max_batch_size: int       # samples decoded together
    max_model_len: int        # prompt plus completion tokens
    vocab_size: int
    policy_version: int       # stamped on every token sampled from now on
    stats: BackendStats

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def capacity(self) -> int:
        """Requests the backend takes now without queueing beyond one batch."""

    def add(self, request: Request) -> None:
        """Queue one sample; ValueError for a prompt that is empty, too long or outside the vocabulary."""

    def step(self) -> list[Finished]:
        """Advance generation (admit, decode); returns the samples that finished meanwhile."""

    def cancel(self, group_ids: Iterable[int]) -> list[Finished]:
        """Remove every waiting and running sample of these groups; they come back as "cancelled"."""

    def drain(self) -> list[Finished]:
        """Finish the running samples without starting waiting ones."""

    def update_weights(self, weights: Weights, version: int) -> None:
        """Load new policy weights between steps; ValueError for a version older than the loaded one."""

    def close(self) -> None:
        """Release engines, worker processes and memory; the backend is unusable afterwards."""


@runtime_checkable
class SpeculationHooks(Protocol):
    """Optional: speculative decoding with an online-trained drafter (torch backend only)."""

    model: torch.nn.Module  # the policy, which the drafter is built for

    def enable_speculation(self, drafter: Any, depth_policy: Any, *, max_traces: int | None = None) -> None: ...

    def take_traces(self) -> list: ...

    def drafter_changed(self) -> None: ...


@runtime_checkable
class EpisodeHooks(Protocol):
    """Optional: multi-turn episodes (Request.episode). A row whose assistant turn ends comes out of step() as
    Finished "turn" and is parked with its cache; drain() leaves parked rows parked (like waiting requests)."""

    @property
    def num_parked(self) -> int: ...

    def resume(self, key: tuple[int, int], observation_ids: list[int]) -> None:
        """Feed the observation to a parked row against its kept cache at its next admission, then decode on."""

    def finish(self, key: tuple[int, int], reason: str) -> Finished:
        """End a parked row with this finish reason."""


BackendFactory = Callable[[RunConfig], Backend]
"""(run config) -> the backend the service samples on. The service takes one, so that a benchmark can
put modelled compute there (tools/benches/modelled.py)."""


def torch_backend(cfg: RunConfig) -> Backend:
    """The built-in torch backend on the run's model, tree sampling on where generator.fork_depths asks."""
    from tailrace.engine.core import models
    from tailrace.engine.generator.torch_backend.backend import TorchBackend
    from tailrace.engine.generator.torch_backend.tree import TreeSampling

    model_path = cfg.model.path or "tiny"
    tokenizer = models.load_tokenizer(model_path)
    model = models.load_model(model_path, dtype=cfg.model.dtype, device=cfg.model.device)
    fork_depths = cfg.generator.fork_depths
    tree = TreeSampling(fork_depths=fork_depths, branching=cfg.generator.tree_branching) if fork_depths else None
    return TorchBackend(model, max_batch_size=cfg.generator.max_batch_size,
                        max_model_len=model.config.max_position_embeddings,
                        eos_token_ids=models.eos_token_ids(model, tokenizer), device=cfg.model.device, tree=tree,
                        static_forwards="auto" if cfg.generator.cuda_graphs else "off")


def load_backend(cfg: RunConfig) -> Backend:
    """The backend `generator.backend` names, on the run's model."""
    name = cfg.generator.backend
    if name == "torch":
        return torch_backend(cfg)
    if name == "vllm":
        from tailrace.engine.generator.engine_backends.vllm_backend import vllm_backend

        return vllm_backend(cfg)
    if name == "sglang":
        from tailrace.engine.generator.engine_backends.sglang_backend import sglang_backend

        return sglang_backend(cfg)
    raise ValueError(f"generator.backend: unknown backend {name!r}")


def speculation_drafters(cfg: RunConfig, backend: Backend) -> tuple[str, ...]:
    """The drafters generator.speculation lets this backend use: () when off, and with "auto" on a
    backend without speculative decoding; ValueError where a setting asks for speculation it lacks.

    "auto" on a CPU drops the EAGLE drafter unless generator.drafter_path gives a trained one: training
    it in the generator's idle turns (spot_training) is not free there, because the cores a generator
    leaves idle are the ones the trainer and the other generators run on: the contention slows the
    trainer's own steps, and the whole run with them (docs/benchmarks.md)."""
    drafters = cfg.generator.spec_drafters
    if drafters and not isinstance(backend, SpeculationHooks):
        if cfg.generator.speculation != "auto":
            raise ValueError(f"generator.speculation: the {backend.name} backend has no speculative decoding")
        return ()
    if _auto_on_cpu(cfg, backend) and not cfg.generator.drafter_path:
        return tuple(d for d in drafters if d != "eagle")
    return drafters


def spot_training(cfg: RunConfig, backend: Backend) -> bool:
    """Whether the generator trains the EAGLE drafter in its idle turns: whenever it drafts with it,
    except under "auto" on a CPU (see speculation_drafters), where a given drafter is used as it is."""
    return "eagle" in speculation_drafters(cfg, backend) and not _auto_on_cpu(cfg, backend)


def _auto_on_cpu(cfg: RunConfig, backend: Backend) -> bool:
    """speculation "auto" on a backend that runs on the CPU, whose idle cores are other processes'."""
    return cfg.generator.speculation == "auto" and getattr(getattr(backend, "device", None), "type", None) == "cpu"
