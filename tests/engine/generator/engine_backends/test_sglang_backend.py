"""The SGLang backend on a GPU (marked `gpu`; SGLang does not run on a CPU): the conformance checks that
matter most, against the torch backend and a Hugging Face forward. Run: tools/gpu_check.sh
"""

import importlib.util

import pytest
import torch
from backend_harness import (
    hf_greedy,
    hf_processed_logprobs,
    perturbed_state,
    prompts,
    run_to_idle,
    tiny_model,
)

from tailrace.engine.config import load_config
from tailrace.engine.generator.requests import Request
from tailrace.protocol.messages import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="sglang is not installed")]


@pytest.fixture(scope="module")
def backend():
    from tailrace.engine.generator.engine_backends.sglang_backend import sglang_backend

    made = sglang_backend(load_config(None, ["--generator.backend", "sglang", "--generator.max_batch_size", "8"]))
    yield made
    made.close()


def test_greedy_and_sampled_logprobs_match_hugging_face(backend):
    model = tiny_model()
    ps = prompts(4, seed=3)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    done = run_to_idle(backend, [Request(i, 0, p, greedy) for i, p in enumerate(ps)])
    for i, p in enumerate(ps):
        assert done[i, 0].completion_ids.tolist() == hf_greedy(model, p, 10, {2})
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=12, seed=7)
    for fin in run_to_idle(backend, [Request(9, s, ps[0], sampled) for s in range(4)]).values():
        torch.testing.assert_close(fin.behaviour_logprobs, hf_processed_logprobs(model, fin, sampled),
                                   atol=1e-3, rtol=0)


@pytest.mark.parametrize("in_flight_kv", ["keep", "recompute"])
def test_in_flight_update_stamps_versions(backend, in_flight_kv):
    backend.in_flight_kv = in_flight_kv
    backend.add(Request(0, 0, [4, 8, 15, 16, 23], SamplingParams(temperature=0.0, max_new_tokens=200)))
    while backend.stats.num_generated_tokens == 0:
        backend.step()
    backend.update_weights(perturbed_state(), backend.policy_version + 1)
    fin = run_to_idle(backend)[0, 0]
    versions = fin.policy_versions.tolist()
    assert versions == sorted(versions) and len(set(versions)) == 2
    backend.update_weights(tiny_model().state_dict(), backend.policy_version + 1)


def test_cancel_and_drain(backend):
    long = SamplingParams(temperature=1.0, max_new_tokens=200)
    for s in range(3):
        backend.add(Request(5, s, [3, 4, 5], long))
    backend.step()
    assert {f.finish_reason for f in backend.cancel([5])} == {"cancelled"}
    assert backend.num_running == backend.num_waiting == 0
    assert backend.drain() == []
