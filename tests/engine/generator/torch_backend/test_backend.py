"""The torch backend against plain references on tiny grouped-query-attention models.

References: greedy full recompute (argmax of model(whole sequence), no cache), each sequence decoded
alone, and Hugging Face's own DynamicCache for the in-flight weight update.
Run: pytest tests/engine/generator/torch_backend/test_backend.py
"""

import pytest
import torch
from transformers import DynamicCache, GPT2Config

from tailrace.engine.core.models import (
    SUPPORTED_MODEL_TYPES,
    TINY_MODEL_PATH,
    cache_kwarg,
    check_supported,
    load_model,
)
from tailrace.engine.generator.requests import Request, requests_for
from tailrace.engine.generator.sampling import SamplingBatch, processed_logprobs
from tailrace.engine.generator.torch_backend.backend import TorchBackend
from tailrace.protocol.messages import SamplingParams, WorkItem

torch.set_num_threads(1)

VOCAB = 64  # make_model's (tests/engine/generator/conftest.py)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model(request, make_model):
    return make_model(request.param)


# ------------------------------------------------------------------ correctness against references


def test_greedy_in_continuous_batch_equals_full_recompute(model, run, prompts, greedy_reference):
    # 7 requests through 3 rows, arriving at different steps with different lengths and budgets:
    # rows leave and join while others run, prompts of 1 token skip prefill, a long late prompt
    # forces the running rows to shift right.
    ps = prompts(6) + [list(range(1, 20))]
    budgets = [3, 9, 5, 1, 7, 4, 6]
    reqs = [Request(i, 0, p, SamplingParams(temperature=0.0, max_new_tokens=n))
            for i, (p, n) in enumerate(zip(ps, budgets, strict=True))]
    backend = TorchBackend(model, max_batch_size=3, max_model_len=40)
    done = run(backend, {0: reqs[:2], 2: reqs[2:5], 4: reqs[5:6], 9: reqs[6:]})
    for i, (p, n) in enumerate(zip(ps, budgets, strict=True)):
        fin = done[i, 0]
        assert fin.completion_ids.tolist() == greedy_reference(model, p, n)
        assert fin.finish_reason == "length"
        assert fin.behaviour_logprobs.dtype == torch.float32 and (fin.behaviour_logprobs == 0).all()


def test_sampled_batch_equals_each_sequence_alone(model, run, prompts):
    params = [SamplingParams(temperature=1.0, max_new_tokens=9, seed=11),
              SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=4, seed=12),
              SamplingParams(temperature=1.2, top_k=10, max_new_tokens=7, seed=13),
              SamplingParams(temperature=0.0, max_new_tokens=6, seed=14)]
    reqs = [Request(i, i, p, sp) for i, (p, sp) in enumerate(zip(prompts(8, seed=2)[:4], params, strict=True))]
    alone = {}
    for req in reqs:
        alone.update(run(TorchBackend(model, max_batch_size=1, max_model_len=32), {0: [req]}))
    # Row 0 runs alone at first; the others join one by one and leave at different steps.
    batched = run(TorchBackend(model, max_batch_size=4, max_model_len=32),
                  {0: reqs[:1], 1: reqs[1:2], 3: reqs[2:4]})
    for key, fin in alone.items():
        assert batched[key].completion_ids.tolist() == fin.completion_ids.tolist()
        torch.testing.assert_close(batched[key].behaviour_logprobs, fin.behaviour_logprobs, atol=1e-5, rtol=0)


def test_a_shared_prompt_is_prefilled_once_and_each_sample_decodes_as_alone(model, prompts, run):
    # Two groups interleaved with a lone prompt, as work arrives: each distinct prompt is prefilled
    # once (its keys/values copied to the group's other rows), and every sample equals itself decoded
    # alone (its own seed; greedy rows too). The rows of a group reorder at admission; results do not.
    a, b, c = prompts(3, seed=5, max_len=10)
    a = a + [7, 8]  # distinct lengths, so left padding differs between rows of one forward
    sampling = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=31),
                SamplingParams(temperature=0.0, max_new_tokens=5)]
    reqs = [Request(1, i, a, sampling[0]) for i in range(3)] + [Request(3, 0, c, sampling[1])]
    reqs += [Request(2, i, b, sampling[i % 2]) for i in range(3)] + [Request(1, 3, a, sampling[0])]
    alone = {}
    for req in reqs:
        alone.update(run(TorchBackend(model, max_batch_size=1, max_model_len=32, seed=7), {0: [req]}))
    backend = TorchBackend(model, max_batch_size=8, max_model_len=32, seed=7)
    batched = run(backend, {0: reqs})
    assert backend.stats.num_prefill_tokens == sum(len(p) - 1 for p in (a, b, c))
    for key, fin in alone.items():
        assert batched[key].completion_ids.tolist() == fin.completion_ids.tolist(), key
        torch.testing.assert_close(batched[key].behaviour_logprobs, fin.behaviour_logprobs, atol=1e-5, rtol=0)
    assert len({tuple(batched[1, i].completion_ids.tolist()) for i in range(4)}) > 1


def test_behaviour_logprobs_equal_processed_reference_logprobs(model, prompts, run, reference_logits):
    params = [SamplingParams(temperature=1.0, max_new_tokens=6, seed=1),
              SamplingParams(temperature=0.7, top_k=8, top_p=0.9, max_new_tokens=6, seed=2)]
    ps = prompts(2, seed=3)
    done = run(TorchBackend(model, max_batch_size=2, max_model_len=32),
               {0: [Request(0, 0, ps[0], params[0])], 2: [Request(1, 0, ps[1], params[1])]})
    for i, sp in enumerate(params):
        fin, batch = done[i, 0], SamplingBatch.build([sp], [torch.Generator()])
        ids = list(ps[i])
        for token, logprob in zip(fin.completion_ids.tolist(), fin.behaviour_logprobs.tolist(), strict=True):
            expected = processed_logprobs(reference_logits(model, ids)[None], batch)[0, token].item()
            assert logprob == pytest.approx(expected, abs=1e-5)
            ids.append(token)


def test_long_run_with_compaction_matches_reference(make_model, prompts, run, greedy_reference):
    # Many short-lived sequences through a small max_model_len: the shared write column reaches the
    # end of the buffer repeatedly, so rows are compacted leftwards while others keep decoding.
    model = make_model("qwen2", seed=5)
    ps = prompts(14, seed=4, max_len=10)
    budgets = [(3 * i) % 8 + 1 for i in range(14)]
    reqs = [Request(i, 0, p, SamplingParams(temperature=0.0, max_new_tokens=n))
            for i, (p, n) in enumerate(zip(ps, budgets, strict=True))]
    backend = TorchBackend(model, max_batch_size=3, max_model_len=20)
    done = run(backend, {2 * i: [r] for i, r in enumerate(reqs)})
    for i, (p, n) in enumerate(zip(ps, budgets, strict=True)):
        assert done[i, 0].completion_ids.tolist() == greedy_reference(model, p, min(n, 20 - len(p)))
    assert backend.stats.num_generated_tokens == sum(len(f.completion_ids) for f in done.values())


@pytest.mark.parametrize("arch, attn", [("mistral", "sdpa"), ("llama", "eager")])
def test_other_family_and_eager_attention(arch, attn, make_model, prompts, run, greedy_reference):
    model = make_model(arch, attn=attn)
    ps = prompts(3, seed=6)
    done = run(TorchBackend(model, max_batch_size=2, max_model_len=32),
               {0: [Request(i, 0, p, GREEDY) for i, p in enumerate(ps)]})
    for i, p in enumerate(ps):
        assert done[i, 0].completion_ids.tolist() == greedy_reference(model, p, GREEDY.max_new_tokens)


# ------------------------------------------------------------------ finishing


def test_finish_reasons_stop_eos_and_lengths(model, greedy_reference, run):
    prompt = [5, 9, 2, 7]
    tokens = greedy_reference(model, prompt, 6)
    stop_token = tokens[2]
    cut = tokens.index(stop_token) + 1
    backend = TorchBackend(model, max_batch_size=4, max_model_len=len(prompt) + 5)
    reqs = [Request(0, 0, prompt, SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[stop_token])),
            Request(1, 0, prompt, SamplingParams(temperature=0.0, max_new_tokens=3)),
            Request(2, 0, prompt, SamplingParams(temperature=0.0, max_new_tokens=50))]
    done = run(backend, {0: reqs})
    assert (done[0, 0].finish_reason, done[0, 0].completion_ids.tolist()) == ("stop", tokens[:cut])
    assert (done[1, 0].finish_reason, done[1, 0].completion_ids.tolist()) == ("length", tokens[:3])
    # max_model_len: prompt + completion fill the context exactly.
    assert (done[2, 0].finish_reason, done[2, 0].completion_ids.tolist()) == ("length", tokens[:5])
    eos_backend = TorchBackend(model, max_batch_size=1, max_model_len=32, eos_token_ids=[stop_token])
    eos = run(eos_backend, {0: [Request(3, 0, prompt, SamplingParams(temperature=0.0, max_new_tokens=6))]})
    assert (eos[3, 0].finish_reason, eos[3, 0].completion_ids.tolist()) == ("stop", tokens[:cut])
    assert eos[3, 0].queue_s >= 0 and eos[3, 0].decode_s >= 0
    # A trainer in the same process may use behaviour log-probs inside its autograd graph.
    weights = torch.ones(cut, requires_grad=True)
    (eos[3, 0].behaviour_logprobs * weights).sum().backward()
    assert eos_backend.stats.num_generated_tokens == cut and eos_backend.stats.tokens_per_s > 0


def test_seeded_sampling_is_reproducible_and_samples_of_a_group_differ(model, run):
    item = WorkItem(group_id=4, prompt_token_ids=[3, 1, 4, 1, 5], num_samples=3,
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=12, seed=99))
    first = run(TorchBackend(model, max_batch_size=3, max_model_len=32, seed=0), {0: requests_for(item)})
    noise = Request(9, 0, [2, 2], SamplingParams(temperature=1.0, max_new_tokens=5))
    second = run(TorchBackend(model, max_batch_size=2, max_model_len=32, seed=1),
                 {0: [noise], 1: requests_for(item)})
    for key, fin in first.items():
        assert torch.equal(second[key].completion_ids, fin.completion_ids)
        torch.testing.assert_close(second[key].behaviour_logprobs, fin.behaviour_logprobs, atol=1e-5, rtol=0)
    completions = {tuple(first[4, i].completion_ids.tolist()) for i in range(3)}
    assert len(completions) == 3


# ------------------------------------------------------------------ weights, cancel, admission


def test_in_flight_weight_update_keeps_cache_and_stamps_versions(make_model, run):
    old, new = make_model("qwen3", seed=0), make_model("qwen3", seed=1)
    prompt, switch_after = [4, 8, 15, 16, 23], 3
    backend = TorchBackend(old, max_batch_size=2, max_model_len=32)
    backend.add(Request(0, 0, prompt, SamplingParams(temperature=0.0, max_new_tokens=8)))
    for _ in range(switch_after):
        assert backend.step() == []
    backend.update_weights(new.state_dict(), version=1)
    assert backend.policy_version == 1
    fin = run(backend, {})[0, 0]
    assert fin.policy_versions.tolist() == [0] * switch_after + [1] * (8 - switch_after)
    # Reference: Hugging Face's cache filled by the old weights, then decoding continued by the new.
    tokens = fin.completion_ids.tolist()
    reference = make_model("qwen3", seed=0)
    cache = {cache_kwarg(reference): DynamicCache(config=reference.config)}
    with torch.no_grad():
        out = reference(torch.tensor([prompt + tokens[:switch_after - 1]]), use_cache=True, **cache)
        assert out.logits[0, len(prompt) - 1:].argmax(-1).tolist() == tokens[:switch_after]
        reference.load_state_dict(new.state_dict())
        expected, last = [], tokens[switch_after - 1]
        for _ in range(8 - switch_after):
            last = int(reference(torch.tensor([[last]]), use_cache=True, **cache).logits[0, -1].argmax())
            expected.append(last)
    assert tokens[switch_after:] == expected


def test_update_weights_rejects_bad_input_and_leaves_model_untouched(model):
    backend = TorchBackend(model, max_batch_size=1, max_model_len=16)
    backend.update_weights({}, version=2)
    name, tensor = next(iter(model.state_dict().items()))
    before = tensor.clone()
    with pytest.raises(ValueError, match="no tensor named"):
        backend.update_weights({name: torch.zeros_like(tensor), "bogus.weight": torch.zeros(1)}, version=3)
    with pytest.raises(ValueError, match="shape"):
        backend.update_weights({name: torch.zeros(1)}, version=3)
    with pytest.raises(ValueError, match="older"):
        backend.update_weights({}, version=1)
    assert torch.equal(model.state_dict()[name], before) and backend.policy_version == 2


def test_cancel_waiting_and_running_leaves_others_intact(model, prompts, run, greedy_reference):
    ps = prompts(4, seed=7)
    backend = TorchBackend(model, max_batch_size=3, max_model_len=32)
    for i, p in enumerate(ps):
        backend.add(Request(i % 2, i, p, SamplingParams(temperature=0.0, max_new_tokens=10)))
    backend.step()
    backend.step()
    cancelled = backend.cancel([0])
    assert sorted(f.sample_id for f in cancelled) == [0, 2]
    assert all(f.finish_reason == "cancelled" for f in cancelled)
    lengths = {f.sample_id: len(f.completion_ids) for f in cancelled}
    assert lengths == {0: 2, 2: 2}  # both were running: rows 0 and 2 of 3
    done = run(backend, {})
    for i in (1, 3):
        assert done[1, i].completion_ids.tolist() == greedy_reference(model, ps[i], 10)
    waiting = TorchBackend(model, max_batch_size=1, max_model_len=32)
    waiting.add(Request(5, 0, [1, 2], GREEDY))
    (fin,) = waiting.cancel([5])
    assert fin.finish_reason == "cancelled" and len(fin.completion_ids) == 0 and waiting.num_waiting == 0


def test_pause_admission_drain_and_capacity(model):
    backend = TorchBackend(model, max_batch_size=4, max_model_len=32)
    assert backend.capacity() == 4
    for i in range(2):
        backend.add(Request(i, 0, [1, 2, 3], GREEDY))
    assert backend.capacity() == 2 and backend.num_waiting == 2
    backend.step()
    assert backend.num_running == 2 and backend.num_waiting == 0
    for i in range(2, 5):
        backend.add(Request(i, 0, [4, 5], GREEDY))
    assert backend.capacity() == 0
    finished = backend.drain()
    assert sorted(f.group_id for f in finished) == [0, 1]
    assert backend.num_running == 0 and backend.num_waiting == 3 and not backend.pause_admission
    backend.pause_admission = True
    assert backend.step() == [] and backend.num_running == 0


def test_bad_requests_and_configurations_raise_value_error(model, make_model):
    backend = TorchBackend(model, max_batch_size=2, max_model_len=8)
    with pytest.raises(ValueError, match="prompt has 8 tokens, but max_model_len is 8"):
        backend.add(Request(0, 0, list(range(8)), GREEDY))
    with pytest.raises(ValueError, match="empty prompt"):
        backend.add(Request(0, 0, [], GREEDY))
    with pytest.raises(ValueError, match=r"\[0, 64\)"):
        backend.add(Request(0, 0, [1, VOCAB], GREEDY))
    assert backend.num_waiting == 0
    with pytest.raises(ValueError, match="sliding window"):
        TorchBackend(make_model("mistral", sliding_window=16), max_batch_size=1, max_model_len=32)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        TorchBackend(model, max_batch_size=1, max_model_len=1000)


# ------------------------------------------------------------------ models.py


def test_unsupported_family_is_rejected_by_name(tmp_path):
    gpt2 = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="Llama, Mistral, Qwen2 and Qwen3"):
        check_supported(gpt2)
    gpt2.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        load_model(tmp_path)


def test_load_model_round_trip(tmp_path, make_model):
    model = make_model("llama")
    model.save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32")
    assert loaded.config.model_type in SUPPORTED_MODEL_TYPES and not loaded.training
    ids = torch.tensor([[1, 2, 3]])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert load_model(tmp_path, dtype="float64").dtype == torch.float64
    with pytest.raises(ValueError, match="dtype"):
        load_model(tmp_path, dtype="float8")
    assert TINY_MODEL_PATH.parts[-2:] == ("examples", "tiny")


def test_outputs_are_ordinary_tensors_that_autograd_accepts(make_model, prompts):
    # The backend decodes under inference_mode; what it hands out (finished, cancelled, traces) must
    # be ordinary tensors, since a trainer in the same process builds autograd graphs on them.
    from tailrace.engine.core.drafter import Drafter
    from tailrace.engine.generator.speculation.speculative import FixedDepth

    model = make_model("qwen2")
    backend = TorchBackend(model, max_batch_size=2, max_model_len=32)
    backend.enable_speculation(Drafter.for_policy(model), FixedDepth(2))
    ps = prompts(3, seed=31)
    for i, p in enumerate(ps):
        backend.add(Request(i, 0, p, SamplingParams(temperature=1.0, max_new_tokens=4 if i == 0 else 20)))
    done = []
    while not done:
        done = backend.step()
    done += backend.cancel([1, 2])  # one running, one waiting
    assert {f.finish_reason for f in done} >= {"length", "cancelled"}
    traces = backend.take_traces()
    outputs = [t for f in done for t in (f.completion_ids, f.behaviour_logprobs, f.policy_versions)]
    outputs += [t for trace in traces for t in (trace.tokens, trace.hidden)]
    assert traces and not any(t.is_inference() for t in outputs)
    weight = torch.randn(64, 3, requires_grad=True)
    loss = sum((torch.nn.functional.embedding(f.completion_ids, weight) * f.behaviour_logprobs[:, None]).sum()
               for f in done)
    loss.backward()  # the ids and log-probs were saved for backward: inference tensors would raise
    assert weight.grad is not None


def test_cpu_backend_runs_masked_grouped_query_attention_without_copies_and_the_same_logits(monkeypatch,
                                                                                            make_model):
    """A CPU TorchBackend has Transformers' SDPA attention take a mask with enable_gqa instead of
    repeat_kv (masked_gqa_on_cpu): the verify and prefill forwards of more than one token then give the
    same logits as the copying path; a value the user set is kept."""
    import os

    from tailrace.engine.generator.torch_backend.backend import masked_gqa_on_cpu

    model = make_model("qwen2")  # 4 query heads over 2 key/value heads
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 7), generator=gen)
    mask = torch.ones(2, 1, 7, 7, dtype=torch.bool).tril()
    mask[1, :, :, :3] = False  # a left-padded row: its first 3 columns are padding
    mask[1, :, torch.arange(3), torch.arange(3)] = True  # which still see themselves
    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)
    with torch.no_grad():
        copying = model(ids, attention_mask=mask).logits
        TorchBackend(model, max_batch_size=2, max_model_len=32, eos_token_ids=[])
        assert os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA") == "1"
        grouped = model(ids, attention_mask=mask).logits
    torch.testing.assert_close(grouped, copying, atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "0")
    masked_gqa_on_cpu()
    assert os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == "0"
