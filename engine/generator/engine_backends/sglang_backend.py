"""The SGLang backend: tailrace's Backend interface (interface.py) on sglang.Engine. UNVERIFIED: SGLang
does not run on a CPU (its kernel package is CUDA-only); tests/engine/generator/engine_backends/test_sglang_backend.py is marked
`gpu` and runs from tools/gpu_check.sh.

    add(request) -> our waiting queue --admit--> engine.async_generate(input_ids, stream=True,
                    return_logprob=True) as a task on the backend's own event loop (a daemon thread)
    each streamed chunk: its new tokens are stamped with the policy version loaded at that moment
    step(): waits (bounded) until some sample finished or progressed, returns the finished ones
    update_weights(): pause_generation -> update_weights_from_tensor(flush_cache) -> version
             -> continue_generation; recompute mode aborts the running samples and resubmits them
             as prompt + tokens so far, as the vLLM backend does.

Sampling maps as in vllm_backend.py (stop ids plus eos with ignore_eos; seed mixed with the sample id);
greedy tokens get behaviour log-prob 0.0. SGLang returns log-probs of the temperature-scaled
distribution only where its server argument for processed log-probs exists; check on a GPU.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

from tailrace.engine.generator.engine_backends.engine_queue import EngineQueue, LiveSample
from tailrace.engine.generator.requests import Finished, Weights, weight_items
from tailrace.engine.generator.sampling import sample_seed

STEP_WAIT_S = 0.05  # step() returns after this long even if nothing finished (the service re-decides)


class SGLangBackend(EngineQueue):
    """Not thread-safe from outside (one owner); SGLang's coroutines run on self._loop."""

    name = "sglang"

    def __init__(self, engine: Any, *, max_batch_size: int, max_model_len: int, vocab_size: int,
                 eos_token_ids: Iterable[int] = (), in_flight_kv: str = "keep"):
        super().__init__(max_batch_size=max_batch_size, max_model_len=max_model_len, vocab_size=vocab_size,
                         eos_token_ids=eos_token_ids, in_flight_kv=in_flight_kv)
        self.engine = engine
        self._tasks: dict[str, Any] = {}
        self._events: queue.Queue = queue.Queue()  # (rid, finish reason | None) from the loop thread
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sglang-loop", daemon=True)
        self._thread.start()

    def step(self) -> list[Finished]:
        if not self.pause_admission:
            self._admit()
        if not self._running:
            return []
        start_s = time.monotonic()
        events = []
        try:
            events.append(self._events.get(timeout=STEP_WAIT_S))
            while True:
                events.append(self._events.get_nowait())
        except queue.Empty:
            pass
        finished = []
        for rid, reason in events:
            if reason is not None and rid in self._running:
                self._tasks.pop(rid, None)
                finished.append(self._finished(self._running.pop(rid), reason))
        self.stats.num_steps += 1
        self.stats.decode_s += time.monotonic() - start_s
        return finished

    def cancel(self, group_ids: Iterable[int]) -> list[Finished]:
        groups = set(group_ids)
        out = self._cancel_waiting(groups)
        for rid in [rid for rid, live in self._running.items() if live.request.group_id in groups]:
            self._abort(rid)
            out.append(self._finished(self._running.pop(rid), "cancelled"))
        return out


    def update_weights(self, weights: Weights, version: int) -> None:
        if version < self.policy_version:
            raise ValueError(f"policy version {version} is older than the loaded {self.policy_version}")
        items = weight_items(weights)
        self._call(self.engine.pause_generation())
        suspended = []
        if self.in_flight_kv == "recompute":
            for rid in list(self._running):
                self._abort(rid)
                suspended.append(self._running.pop(rid))
        self.engine.update_weights_from_tensor(named_tensors=items, flush_cache=True)
        self.policy_version = version
        self._call(self.engine.continue_generation())
        for live in suspended:
            self._submit(live)

    def close(self) -> None:
        for rid in list(self._running):
            self._abort(rid)
        self._running.clear()
        self.engine.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ internals

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=60)

    def _abort(self, rid: str) -> None:
        task = self._tasks.pop(rid, None)
        if task is not None:
            task.cancel()
        self._loop.call_soon_threadsafe(self.engine.tokenizer_manager.abort_request, rid)

    def _submit(self, live: LiveSample) -> None:
        req = live.request
        done = len(live.tokens)
        limit = self._limit(live)
        s = req.sampling
        params = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k if s.top_k > 0 else -1,
                  "max_new_tokens": limit, "ignore_eos": True,
                  "stop_token_ids": sorted(set(s.stop_token_ids) | set(self.eos_token_ids))}
        if s.seed is not None:
            params["sampling_seed"] = sample_seed(s.seed, req.sample_id + done * 7919)
        rid = f"g{req.group_id}-s{req.sample_id}-t{done}"
        self._running[rid] = live
        self._tasks[rid] = asyncio.run_coroutine_threadsafe(
            self._generate(rid, live, list(req.prompt_ids) + live.tokens, params), self._loop)

    async def _generate(self, rid: str, live: LiveSample, input_ids: list[int], params: dict) -> None:
        reason = "length"
        stream = await self.engine.async_generate(input_ids=input_ids, sampling_params=params, rid=rid,
                                                  return_logprob=True, stream=True)
        seen = 0
        async for chunk in stream:
            meta = chunk["meta_info"]
            entries = meta.get("output_token_logprobs") or []
            new = entries[seen:]  # streamed chunks carry the whole completion so far
            seen = len(entries)
            if new and not live.tokens:
                live.first_token_s = time.monotonic()
            greedy = live.request.sampling.temperature == 0.0
            live.tokens += [int(token) for _, token, *_ in new]
            live.logprobs += [0.0 if greedy else float(lp) for lp, *_ in new]
            live.versions += [self.policy_version] * len(new)
            self.stats.num_generated_tokens += len(new)
            finish = meta.get("finish_reason")
            if finish:
                reason = {"stop": "stop", "length": "length", "abort": "cancelled"}.get(finish.get("type"), "length")
        self._events.put((rid, reason))


def sglang_backend(cfg: Any) -> SGLangBackend:
    """interface.load_backend for generator.backend = "sglang" (GPU)."""
    import sglang
    from transformers import AutoConfig

    from tailrace.engine.core import models

    path = models.resolve_model_path(cfg.model.path or "tiny")
    config = AutoConfig.from_pretrained(path)
    tokenizer = models.load_tokenizer(path)
    engine = sglang.Engine(model_path=path, skip_tokenizer_init=True, dtype=cfg.model.dtype,
                           random_seed=cfg.train.seed, context_length=config.max_position_embeddings,
                           max_running_requests=cfg.generator.max_batch_size)
    eos = models.eos_token_ids(SimpleNamespace(config=config, generation_config=None), tokenizer)
    return SGLangBackend(engine, max_batch_size=cfg.generator.max_batch_size,
                         max_model_len=config.max_position_embeddings, vocab_size=config.vocab_size,
                         eos_token_ids=eos, in_flight_kv=cfg.generator.in_flight_kv)
