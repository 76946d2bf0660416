"""Fixtures shared by the generator's tests: the tiny models they decode with, plain references (full
recompute, Hugging Face's own cache), a driver that steps a backend until idle, and one vLLM engine per
session (it takes most of a minute to start on a CPU; None where vllm is not installed).

make_model(arch="qwen2", seed=0, attn="sdpa", **config): an untied tiny model in eval mode with a large
init range (peaked distributions, so greedy has no near-ties); qwen3 gets head_dim 8.
The backend conformance suite's pieces (the shipped tiny model, vLLM builders) are in backend_harness.py
beside this file: its tests import it by name, as their marks need it when the module loads.
"""

import pytest
import torch
from backend_harness import HAS_VLLM, make_llm  # beside this file; pytest puts this folder on sys.path
from transformers import DynamicCache

from tailrace.engine.core.models import cache_kwarg
from tailrace.engine.generator.requests import Request
from tailrace.engine.generator.speculation.speculative import FixedDepth
from tailrace.engine.generator.torch_backend.backend import TorchBackend

VOCAB = 64  # make_model's vocabulary, and that of `prompts`


@pytest.fixture(scope="session")
def vllm_llm(tmp_path_factory):
    if not HAS_VLLM:
        return None
    return make_llm(tmp_path_factory.mktemp("vllm-cache"), max_batch_size=8)


@pytest.fixture(scope="session")
def make_model(tiny_lm):
    def make_model(arch: str = "qwen2", seed: int = 0, attn: str = "sdpa", **config):
        kwargs = dict(initializer_range=0.3, tie_word_embeddings=False)
        if arch == "qwen3":
            kwargs["head_dim"] = 8
        kwargs.update(config)
        return tiny_lm(arch, seed=seed, attn=attn, **kwargs).eval()

    return make_model


@pytest.fixture(scope="session")
def prompts():
    def prompts(num: int, seed: int = 1, max_len: int = 12) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, max_len + 1, (num,), generator=gen).tolist()
        return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]

    return prompts


@pytest.fixture(scope="session")
def reference_logits():
    @torch.no_grad()
    def reference_logits(model, ids: list[int]) -> torch.Tensor:
        """Next-token logits [V] after `ids`, from a full forward with no cache."""
        return model(torch.tensor([ids])).logits[0, -1].float()

    return reference_logits


@pytest.fixture(scope="session")
def greedy_reference(reference_logits):
    def greedy_reference(model, prompt: list[int], num_tokens: int) -> list[int]:
        ids = list(prompt)
        for _ in range(num_tokens):
            ids.append(int(reference_logits(model, ids).argmax()))
        return ids[len(prompt):]

    return greedy_reference


def _run(backend: TorchBackend, schedule: dict[int, list[Request]], max_steps: int = 500):
    done = {}
    for step in range(max_steps):
        for request in schedule.get(step, []):
            backend.add(request)
        for fin in backend.step():
            done[fin.group_id, fin.sample_id] = fin
        if not backend.num_running and not backend.num_waiting and step >= max(schedule, default=0):
            return done
    raise AssertionError("backend did not finish")


@pytest.fixture(scope="session")
def run():
    """run(backend, schedule, max_steps=500): step until idle; schedule[s] is added just before step s.
    Returns {(group, sample): Finished}."""
    return _run


@pytest.fixture(scope="session")
def run_spec():
    """run with room for the longer speculative schedules (1000 steps)."""
    def run_spec(backend: TorchBackend, schedule: dict[int, list[Request]]):
        return _run(backend, schedule, max_steps=1000)

    return run_spec


@pytest.fixture(scope="session")
def spec_backend():
    def spec_backend(model, drafter, k: int, max_traces: int | None = None, kind: str = "eagle",
                     **kwargs) -> TorchBackend:
        """kind "suffix_only": suffix drafts with no drafter model (what generator.speculation auto runs on
        a CPU without a drafter_path), none of its bookkeeping."""
        backend = TorchBackend(model, **kwargs)
        if kind == "suffix_only":
            drafter, kind = None, "suffix"
        backend.enable_speculation(drafter, FixedDepth(k, kind), max_traces=max_traces)
        return backend

    return spec_backend


@pytest.fixture(scope="session")
def chi_square_pvalue():
    def chi_square_pvalue(counts: dict, probs: dict, num: int) -> float:
        """Goodness of fit; categories expected below 5 are pooled into one."""
        observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
        for seq, prob in probs.items():
            if prob * num >= 5:
                observed.append(counts.get(seq, 0))
                expected.append(prob * num)
            else:
                pooled_obs += counts.get(seq, 0)
                pooled_exp += prob * num
        assert sum(counts.values()) == num and set(counts) <= {s for s, p in probs.items() if p > 0}
        if pooled_exp > 0:
            observed.append(pooled_obs)
            expected.append(pooled_exp)
        obs, exp = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
        stat = float(((obs - exp) ** 2 / exp).sum())
        df = len(observed) - 1
        return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2)))

    return chi_square_pvalue


@pytest.fixture(scope="session")
def row_cache_matches_recompute():
    def row_cache_matches_recompute(model, backend: TorchBackend, row: int, tokens: list[int]) -> None:
        """The row's valid cached keys/values equal Hugging Face's own cache over the fed tokens."""
        kv = backend.rows.kv
        cols = kv.valid_RC[row, kv.lo:kv.end].nonzero().flatten() + kv.lo
        assert cols.numel() == len(tokens)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.tensor([tokens]), use_cache=True, **{cache_kwarg(model): cache})
        for layer in range(model.config.num_hidden_layers):
            torch.testing.assert_close(kv.keys[layer][row][:, cols], cache.layers[layer].keys[0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(kv.values[layer][row][:, cols], cache.layers[layer].values[0],
                                       atol=1e-5, rtol=1e-4)

    return row_cache_matches_recompute
