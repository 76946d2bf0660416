"""Speculative decoding in the torch backend: lossless, exact under greedy, right inside a continuous batch.

Lossless is checked three ways: the acceptance rule alone (exact output marginals, vectorised over many
rows), whole sampled sequences against the policy's exact sequence distribution (chi-square over
>= 20000 samples, fixed seeds, temperature 1 and with top-p/top-k; a deliberately lossy rule must fail the
same test), and greedy decoding token for token against full recompute. The chi-square tests also run on
the 12-layer shape of the long-tail benchmarks' policy (a model deepened by tools/make_tiny_model.py).
Run: pytest tests/engine/generator/speculation/test_speculative.py   (the 100000-sample variant and the exactly deepened one: -m slow)
"""

import itertools

import pytest
import torch

from tailrace.engine.core.drafter import Drafter
from tailrace.engine.generator.sampling import SamplingBatch, processed_logprobs
from tailrace.engine.generator.speculation import speculative
from tailrace.engine.generator.speculation.drafter_training import KeyRecorder, SpotConfig, SpotTrainer
from tailrace.engine.generator.speculation.speculative import FixedDepth, accept_drafts
from tailrace.engine.generator.torch_backend.backend import Request, TorchBackend
from tailrace.engine.generator.torch_backend.kv import SlotKVCache
from tailrace.protocol.messages import SamplingParams
from tools.make_tiny_model import deepen_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model(make_model):
    return make_model("qwen2")


@pytest.fixture(scope="module")
def trained_drafter(model, spec_backend, run_spec, prompts):
    """A drafter trained briefly on the model's own rollouts: accepts some drafts, rejects others."""
    drafter = Drafter.for_policy(model, seed=3)
    backend = spec_backend(model, drafter, 0, max_batch_size=32, max_model_len=48, seed=0)
    for i, p in enumerate(prompts(32, seed=9)):
        backend.add(Request(i, 0, p, SamplingParams(temperature=0.0 if i % 2 else 1.0, max_new_tokens=24)))
    run_spec(backend, {})
    spot = SpotTrainer(drafter, SpotConfig(tokens_per_step=256, lr=3e-3))
    spot.add_traces(backend.take_traces())
    spot.run(lambda: False, max_steps=40)
    return drafter


# ------------------------------------------------------------------ the acceptance rule alone


def test_accept_rule_output_marginals_equal_policy():
    # k = 2 drafts over V = 5 for 400000 independent rows: the emitted first and second tokens must
    # follow p_1 and p_2 (given the first), whatever q is, also where q puts mass on p's zeros.
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 400_000, 5
    p_NV = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.1, 0.3, 0.4], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q_KV = torch.tensor([[0.1, 0.1, 0.3, 0.3, 0.2], [0.6, 0.1, 0.1, 0.1, 0.1]])
    # The second position's p may depend on the first token in general; here it does not.
    drafts_BK = torch.stack([torch.multinomial(q, rows, replacement=True, generator=gen) for q in q_KV], 1)
    p_BNV = p_NV.log().expand(rows, -1, -1)
    q_BKV = q_KV.log().expand(rows, -1, -1)
    u_accept, u_final = torch.rand(rows, 2, generator=gen), torch.rand(rows, generator=gen)
    num_accepted, tokens, logprobs = accept_drafts(p_BNV, q_BKV, drafts_BK, u_accept, u_final)
    first = torch.bincount(tokens[:, 0], minlength=vocab) / rows
    torch.testing.assert_close(first, p_NV[0], atol=4e-3, rtol=0)
    two = num_accepted >= 1  # rows that emitted a second token
    second = torch.bincount(tokens[two, 1], minlength=vocab) / int(two.sum())
    torch.testing.assert_close(second, p_NV[1], atol=6e-3, rtol=0)
    expected_accept = torch.minimum(p_NV[0], q_KV[0]).sum()  # 1 - TV(p_1, q_1)
    assert float((num_accepted >= 1).float().mean()) == pytest.approx(float(expected_accept), abs=4e-3)
    emitted = torch.arange(3)[None, :] <= num_accepted[:, None]
    assert torch.equal(logprobs[emitted], p_BNV.gather(-1, tokens[..., None]).squeeze(-1)[emitted])
    assert bool((tokens[:, 0] != 4).all())  # p_1 gives token 4 no mass: never emitted


def test_accept_rule_greedy_and_identical_distributions():
    one_hot = torch.full((1, 3, 4), float("-inf"))
    one_hot[0, 0, 2] = one_hot[0, 1, 1] = one_hot[0, 2, 3] = 0.0
    q = torch.full((1, 2, 4), float("-inf"))
    q[0, 0, 2] = q[0, 1, 0] = 0.0  # first draft agrees with the argmax, second does not
    drafts = torch.tensor([[2, 0]])
    num, tokens, logprobs = accept_drafts(one_hot, q, drafts, torch.rand(1, 2), torch.rand(1))
    assert num.tolist() == [1] and tokens[0, :2].tolist() == [2, 1] and logprobs[0, :2].tolist() == [0.0, 0.0]
    p = torch.log_softmax(torch.randn(64, 3, 7), -1)
    drafts = torch.randint(0, 7, (64, 2))
    num, _, _ = accept_drafts(p, p[:, :2], drafts, torch.rand(64, 2) * 0.999, torch.rand(64))
    assert bool((num == 2).all())  # q == p: every draft is accepted


# ------------------------------------------------------------------ lossless: whole sequences


@pytest.fixture(scope="module")
def exact_sequence_probs(reference_logits):
    def exact_sequence_probs(model, prompt: list[int], length: int, sampling: SamplingParams) -> dict:
        """Probability of every completion of `length` tokens under the processed policy distribution."""
        batch = SamplingBatch.build([sampling], [torch.Generator()])
        probs = {(): 1.0}
        for _ in range(length):
            nxt = {}
            for seq, prob in probs.items():
                if prob == 0.0:
                    continue
                p_V = processed_logprobs(reference_logits(model, prompt + list(seq))[None], batch)[0].exp()
                for token, p in enumerate(p_V.tolist()):
                    nxt[seq + (token,)] = prob * p
            probs = nxt
        return probs

    return exact_sequence_probs


@pytest.fixture(scope="module")
def sample_sequences(spec_backend):
    def sample_sequences(model, drafter, k: int, prompt: list[int], sampling: SamplingParams, num: int,
                         seed: int, kind: str = "eagle") -> tuple[dict, TorchBackend]:
        """num samples of one prompt, 2000 at a time: for the suffix drafter, a group of 2000 siblings whose
        text (and that of the batches before) drafts for each other."""
        backend = spec_backend(model, drafter, k, max_traces=0, kind=kind, max_batch_size=2000, max_model_len=16,
                               seed=seed)
        counts: dict = {}
        for start in range(0, num, 2000):
            for i in range(start, min(num, start + 2000)):
                backend.add(Request(i, 0, prompt, sampling))
            while backend.num_running or backend.num_waiting:
                for fin in backend.step():
                    seq = tuple(fin.completion_ids.tolist())
                    counts[seq] = counts.get(seq, 0) + 1
        return counts, backend

    return sample_sequences


LOSSLESS_CASES = [  # (sampling, k, samples in the default run); the slow variant takes 100000 each
    pytest.param(SamplingParams(temperature=1.0, max_new_tokens=3), 2, 20_000, id="temperature1-k2"),
    pytest.param(SamplingParams(temperature=0.8, top_p=0.8, max_new_tokens=3), 2, 20_000, id="top_p-k2"),
    # k beyond the tokens left: surplus accepted drafts are cut at the budget.
    pytest.param(SamplingParams(temperature=1.3, top_k=5, top_p=0.95, max_new_tokens=3), 5, 5_000, id="top_k-k5"),
]


@pytest.fixture(scope="module")
def lossless_model(make_model):
    def lossless_model(shape: str):
        """The chi-square tests' policy: 2 layers, or that model deepened to 12 (tools/make_tiny_model.py
        --deepen, the long-tail benchmarks' policy shape: the same function in 12 layers' caches), or deepened
        with its added layers' zero output projections perturbed, so that all 12 layers change the output."""
        model = make_model("qwen2", seed=4, vocab_size=8)
        if shape == "layers2":
            return model
        deep = deepen_model(model, 12)
        if shape == "deepened12-perturbed":
            gen = torch.Generator().manual_seed(6)
            with torch.no_grad():
                for i, layer in enumerate(deep.model.layers):
                    if i % 6:  # the copies; layer 6 is the source's second layer
                        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
                            proj.weight.copy_(0.3 * torch.randn(proj.weight.shape, generator=gen))
        return deep

    return lossless_model


@pytest.fixture(scope="module")
def check_lossless(lossless_model, exact_sequence_probs, sample_sequences, chi_square_pvalue):
    def check_lossless(sampling: SamplingParams, k: int, num: int, kind: str = "eagle",
                       shape: str = "layers2") -> None:
        model = lossless_model(shape)
        drafter = Drafter.for_policy(model, seed=5)  # untrained: many rejections, some acceptances
        prompt = [1, 5, 3]
        probs = exact_sequence_probs(model, prompt, sampling.max_new_tokens, sampling)
        counts, backend = sample_sequences(model, drafter, k, prompt, sampling, num, seed=7, kind=kind)
        stats = backend.spec_stats
        # Both branches of the rule ran many times: rejections, and enough acceptances to fill a sequence.
        assert stats.accept_len_hist[0] > num // 20 and sum(stats.accept_len_hist[2:]) > num // 20
        assert stats.steps_by[kind.removesuffix("_only")] == stats.num_spec_steps > 0
        assert chi_square_pvalue(counts, probs, num) > 1e-3

    return check_lossless


@pytest.mark.parametrize("kind", ["eagle", "suffix", "suffix_only"])
@pytest.mark.parametrize("sampling, k, num", LOSSLESS_CASES)
def test_sampled_sequences_follow_the_policy_exactly(sampling, k, num, kind, check_lossless):
    check_lossless(sampling, k, num, kind)


@pytest.mark.parametrize("shape", [pytest.param("deepened12", marks=pytest.mark.slow), "deepened12-perturbed"])
@pytest.mark.parametrize("kind", ["eagle", "suffix"])
@pytest.mark.parametrize("sampling, k, num", LOSSLESS_CASES)
def test_sampled_sequences_follow_the_policy_exactly_12_layers(sampling, k, num, kind, shape, check_lossless):
    check_lossless(sampling, k, num, kind, shape)


def test_deepened_policy_computes_the_same_function(lossless_model):
    # The drafter reads the policy's last hidden states: the deepened policy's are the source's, bit for
    # bit, so one drafter serves both (tools/benches/spec.py --workload longtail relies on it).
    source, deep = lossless_model("layers2"), lossless_model("deepened12")
    assert deep.config.num_hidden_layers == 12
    ids = torch.tensor([[1, 5, 3, 2, 7, 0, 4]])
    with torch.inference_mode():
        assert torch.equal(deep.model(input_ids=ids).last_hidden_state, source.model(input_ids=ids).last_hidden_state)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "suffix"])
@pytest.mark.parametrize("sampling, k, num", LOSSLESS_CASES)
def test_sampled_sequences_follow_the_policy_exactly_100k(sampling, k, num, kind, check_lossless):
    check_lossless(sampling, k, 100_000, kind)


def test_chi_square_detects_a_lossy_rule(monkeypatch, make_model, exact_sequence_probs, sample_sequences,
                                         chi_square_pvalue):
    # The same test must fail for a rule that keeps every draft (the drafter's distribution). The
    # speculative step calls the rule with q as probabilities (accept_drafts_q_probs).
    rule = speculative.accept_drafts_q_probs

    def accept_all(p, q_probs, drafts, u_accept, u_final):
        num, tokens, logprobs = rule(p, q_probs, drafts, torch.zeros_like(u_accept), u_final)
        return torch.full_like(num, drafts.shape[1]), tokens, logprobs

    monkeypatch.setattr(speculative, "accept_drafts_q_probs", accept_all)
    model = make_model("qwen2", seed=4, vocab_size=8)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3)
    probs = exact_sequence_probs(model, [1, 5, 3], 3, sampling)
    counts, _ = sample_sequences(model, Drafter.for_policy(model, seed=5), 2, [1, 5, 3], sampling, 4000, seed=7)
    assert chi_square_pvalue(counts, probs, 4000) < 1e-9


@pytest.mark.parametrize("lossy", ["accept_all", "residual_keeps_the_draft"])
def test_chi_square_detects_a_lossy_point_mass_rule(monkeypatch, lossy, make_model, exact_sequence_probs,
                                                    sample_sequences, chi_square_pvalue):
    # Suffix drafts: keeping every draft, or drawing a rejected position from p itself (the draft not
    # removed), must fail the same test.
    rule = speculative.accept_point_drafts

    def accept_all(p, drafts, u_accept, u_final):
        num, tokens, logprobs = rule(p, drafts, torch.zeros_like(u_accept), u_final)
        return torch.full_like(num, drafts.shape[1]), tokens, logprobs

    def residual_keeps_the_draft(p, drafts, u_accept, u_final):
        q = torch.full_like(p[:, :-1], float("-inf"))  # q = 0: the residual is p itself
        kept = u_accept < p[:, :-1].gather(-1, drafts[..., None]).squeeze(-1).exp()
        num, tokens, logprobs = accept_drafts(p, q, drafts, torch.zeros_like(u_accept), u_final)
        num = kept.to(torch.int64).cumprod(-1).sum(-1)
        final = speculative.sample_probs(p[torch.arange(len(num)), num].exp(), u_final[:, None])
        tokens = torch.cat((drafts, final), 1).scatter_(1, num[:, None], final)
        return num, tokens, p.gather(-1, tokens[..., None]).squeeze(-1)

    monkeypatch.setattr(speculative, "accept_point_drafts", locals()[lossy])
    model = make_model("qwen2", seed=4, vocab_size=8)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=3)
    probs = exact_sequence_probs(model, [1, 5, 3], 3, sampling)
    counts, _ = sample_sequences(model, Drafter.for_policy(model, seed=5), 2, [1, 5, 3], sampling, 20_000, seed=7,
                                 kind="suffix")
    assert chi_square_pvalue(counts, probs, 20_000) < 1e-6


# ------------------------------------------------------------------ greedy and the continuous batch


@pytest.mark.parametrize("kind", ["eagle", "suffix", "suffix_only"])
@pytest.mark.parametrize("arch, attn", [("qwen2", "sdpa"), ("qwen3", "sdpa"), ("llama", "eager")])
def test_greedy_is_token_for_token_identical(arch, attn, trained_drafter, kind, make_model, prompts,
                                             run_spec, spec_backend, greedy_reference):
    model = make_model(arch, attn=attn)
    drafter = trained_drafter if arch == "qwen2" else Drafter.for_policy(model)
    ps = prompts(6, seed=2) + [list(range(1, 20))]
    budgets = [3, 9, 5, 1, 12, 4, 6]
    reqs = [Request(i, 0, p, SamplingParams(temperature=0.0, max_new_tokens=n))
            for i, (p, n) in enumerate(zip(ps, budgets, strict=True))]
    for k in (1, 3, 8):
        done = run_spec(spec_backend(model, drafter, k, kind=kind, max_batch_size=3, max_model_len=40),
                        {0: reqs[:2], 2: reqs[2:5], 4: reqs[5:6], 7: reqs[6:]})
        for i, (p, n) in enumerate(zip(ps, budgets, strict=True)):
            assert done[i, 0].completion_ids.tolist() == greedy_reference(model, p, n), (k, i)
            assert (done[i, 0].behaviour_logprobs == 0).all() and done[i, 0].finish_reason == "length"


def test_mixed_acceptance_batch_equals_each_sequence_alone(model, trained_drafter, spec_backend, run_spec,
                                                           greedy_reference, row_cache_matches_recompute,
                                                           prompts, reference_logits):
    params = [SamplingParams(temperature=1.0, max_new_tokens=20, seed=11),
              SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=9, seed=12),
              SamplingParams(temperature=1.2, top_k=10, max_new_tokens=16, seed=13),
              SamplingParams(temperature=0.0, max_new_tokens=14, seed=14)]
    reqs = [Request(i, i, p, sp) for i, (p, sp) in enumerate(zip(prompts(4, seed=5), params, strict=True))]
    alone = {}
    for req in reqs:
        alone.update(run_spec(spec_backend(model, trained_drafter, 3, max_batch_size=1, max_model_len=48), {0: [req]}))
    batched = spec_backend(model, trained_drafter, 3, max_batch_size=4, max_model_len=48)
    # Check the cache mid-flight: every running row holds exactly its fed tokens' keys/values.
    done = {}
    for schedule in [reqs[:1], reqs[1:2], [], reqs[2:4], [], []]:
        for req in schedule:
            batched.add(req)
        done.update({(f.group_id, f.sample_id): f for f in batched.step()})
        for row, seq in enumerate(batched.rows.seqs):
            fed = seq.request.prompt_ids + batched.rows.completion(row, int(batched.rows.num_gen_R[row]))[0].tolist()
            row_cache_matches_recompute(model, batched, row, fed[:-1])
    done.update(run_spec(batched, {}))
    for key, fin in alone.items():
        assert done[key].completion_ids.tolist() == fin.completion_ids.tolist(), key
        torch.testing.assert_close(done[key].behaviour_logprobs, fin.behaviour_logprobs, atol=1e-5, rtol=0)
    hist = batched.spec_stats.accept_len_hist
    assert sum(1 for count in hist[:4] if count) >= 3  # rows accepted different numbers of drafts
    # Greedy rows still equal full recompute; sampled rows report the policy's processed log-probs.
    assert done[3, 3].completion_ids.tolist() == greedy_reference(model, reqs[3].prompt_ids, 14)
    for i in range(3):
        fin, batch = done[i, i], SamplingBatch.build([params[i]], [torch.Generator()])
        ids = list(reqs[i].prompt_ids)
        for token, logprob in zip(fin.completion_ids.tolist(), fin.behaviour_logprobs.tolist(), strict=True):
            expected = processed_logprobs(reference_logits(model, ids)[None], batch)[0, token].item()
            assert logprob == pytest.approx(expected, abs=1e-5)
            ids.append(token)


def test_compaction_stop_tokens_and_versions(model, trained_drafter, monkeypatch, prompts, spec_backend,
                                             greedy_reference, run_spec):
    # A small max_model_len with many rejected columns forces kv.compact(); an in-flight weight
    # update in the middle stamps the later tokens with the new version.
    num_compactions = []
    compact = SlotKVCache.compact
    monkeypatch.setattr(SlotKVCache, "compact", lambda kv, n: num_compactions.append(n) or compact(kv, n))
    ps = prompts(10, seed=4, max_len=8)
    reference = {i: greedy_reference(model, p, 20 - len(p)) for i, p in enumerate(ps)}
    stop = reference[0][2]
    reqs = [Request(i, 0, p, SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=[stop] * (i == 0)))
            for i, p in enumerate(ps)]
    backend = spec_backend(model, trained_drafter, 4, max_batch_size=3, max_model_len=20)
    for req in reqs[:3]:
        backend.add(req)
    done = {(f.group_id, f.sample_id): f for _ in range(3) for f in backend.step()}
    backend.update_weights({}, version=1)
    done.update(run_spec(backend, {2 * i: [r] for i, r in enumerate(reqs[3:])}))
    for i in range(len(ps)):
        expected = reference[i][:reference[i].index(stop) + 1] if i == 0 else reference[i]
        assert done[i, 0].completion_ids.tolist() == expected, i
        assert done[i, 0].finish_reason == ("stop" if i == 0 else "length")
    assert num_compactions
    versions = done[1, 0].policy_versions.tolist()
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)


def test_depth_zero_and_enable_errors(model, trained_drafter, spec_backend, run_spec, prompts,
                                      greedy_reference):
    backend = spec_backend(model, trained_drafter, 0, max_batch_size=2, max_model_len=32)
    p = prompts(1, seed=8)[0]
    done = run_spec(backend, {0: [Request(0, 0, p, SamplingParams(temperature=0.0, max_new_tokens=6))]})
    assert done[0, 0].completion_ids.tolist() == greedy_reference(model, p, 6)
    assert backend.spec_stats.num_spec_steps == 0 and backend.spec_stats.num_plain_steps == 6
    (trace,) = backend.take_traces()
    assert trace.tokens.tolist() == p + done[0, 0].completion_ids.tolist()
    with pytest.raises(ValueError, match="already enabled"):
        backend.enable_speculation(trained_drafter, FixedDepth(1))
    busy = TorchBackend(model, max_batch_size=1, max_model_len=32)
    busy.add(Request(0, 0, p, SamplingParams(max_new_tokens=4)))
    busy.step()
    with pytest.raises(ValueError, match="before the backend runs"):
        busy.enable_speculation(trained_drafter, FixedDepth(1))
    with pytest.raises(ValueError, match="depth k"):
        FixedDepth(9)


def test_every_arm_combination_runs(model, trained_drafter, prompts, run_spec, greedy_reference):
    # Arms changing every step (as the bandit does) keep the drafter cache consistent.
    depths = itertools.cycle([0, 2, "suffix@3", 0, 0, 5, "suffix@8", 1, 8, "suffix@1", 3])

    class Cycling(FixedDepth):
        def choose(self, num_running):
            return next(depths)

    backend = TorchBackend(model, max_batch_size=2, max_model_len=40)
    backend.enable_speculation(trained_drafter, Cycling(0))
    ps = prompts(3, seed=12)
    done = run_spec(backend, {0: [Request(i, 0, p, SamplingParams(temperature=0.0, max_new_tokens=15))
                                  for i, p in enumerate(ps)]})
    for i, p in enumerate(ps):
        assert done[i, 0].completion_ids.tolist() == greedy_reference(model, p, 15)


def test_drafter_cache_holds_keys_of_true_features(model, trained_drafter, prompts):
    # After speculative (eagle and suffix) and plain steps, every drafter key/value left of the stale
    # window equals the drafter run over the row's tokens with the policy's true hidden states.
    depths = itertools.cycle([3, 0, "suffix@2", 2, 4, "suffix@4"])

    class Cycling(FixedDepth):
        def choose(self, num_running):
            return next(depths)

    backend = TorchBackend(model, max_batch_size=2, max_model_len=48)
    backend.enable_speculation(trained_drafter, Cycling(0))
    for i, p in enumerate(prompts(2, seed=13)):
        backend.add(Request(i, i, p, SamplingParams(temperature=1.0, max_new_tokens=30, seed=i)))
    for step in range(7):
        backend.step()
        if step >= 5:  # after a suffix step (its columns join the stale window), then an eagle step
            _check_drafter_cache(model, trained_drafter, backend)


def _check_drafter_cache(model, trained_drafter, backend):
    kv, spec = backend.rows.kv, backend._spec
    for row in range(backend.num_running):
        seq = backend.rows.seqs[row]
        fed = seq.request.prompt_ids + backend.rows.completion(row, int(backend.rows.num_gen_R[row]))[0].tolist()
        assert spec.ids_RC[row, kv.valid_RC[row, kv.lo:kv.end].nonzero().flatten() + kv.lo].tolist() == fed[:-1]
        cols = kv.valid_RC[row, kv.lo:kv.end - spec.stale_back].nonzero().flatten() + kv.lo
        tokens = spec.ids_RC[row, cols]
        with torch.no_grad():
            hidden = model.model(tokens[None]).last_hidden_state
            features = torch.cat((torch.zeros_like(hidden[:, :1]), hidden[:, :-1]), dim=1)
            causal = torch.ones(len(cols), len(cols), dtype=torch.bool).tril()[None, None]
            cache = KeyRecorder()
            trained_drafter(tokens[None], features, torch.arange(len(cols))[None], causal, cache=cache)
        assert spec.pos_RC[row, cols].tolist() == list(range(len(cols)))
        torch.testing.assert_close(kv.keys[spec.layer][row][:, cols], cache.keys[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(kv.values[spec.layer][row][:, cols], cache.values[0], atol=1e-4, rtol=1e-4)


def test_draft_loop_equals_the_drafter_run_over_its_own_drafts(model, trained_drafter, spec_backend, prompts):
    # The drafting loop's shortcuts (cached drafter keys, rotary factors looked up once per step, draws
    # written into preallocated buffers) compute what one cacheless drafter forward over the row's
    # tokens, true features and then its own drafts and predicted features computes, draft by draft.
    backend = spec_backend(model, trained_drafter, 4, max_batch_size=2, max_model_len=48)
    spec, kv, checked = backend._spec, backend.rows.kv, []
    draft = spec._draft

    def spy(num_rows, k, batch, u_BK):
        drafts_BK, q_BKV = draft(num_rows, k, batch, u_BK)
        for row in range(num_rows):
            cols = kv.valid_RC[row, kv.lo:kv.end + 1].nonzero().flatten() + kv.lo  # through the pending column
            ids, feats = spec.ids_RC[row, cols], spec.feats_RCH[row, cols]
            assert spec.pos_RC[row, cols].tolist() == list(range(len(cols)))
            seq = backend.rows.seqs[row]
            row_batch = SamplingBatch.build([seq.request.sampling], [seq.generator])
            for j in range(k):
                num = len(ids)
                causal = torch.ones(num, num, dtype=torch.bool).tril()[None, None]
                hidden = trained_drafter(ids[None], feats[None], torch.arange(num)[None], causal)[0, -1]
                q_V = processed_logprobs(trained_drafter.logits(hidden[None]), row_batch)[0].exp()
                torch.testing.assert_close(q_BKV[row, j], q_V, atol=1e-5, rtol=1e-4)
                ids, feats = torch.cat((ids, drafts_BK[row, j:j + 1])), torch.cat((feats, hidden[None]))
            checked.append(row)
        return drafts_BK, q_BKV

    spec._draft = spy
    for i, p in enumerate(prompts(2, seed=21)):
        backend.add(Request(i, i, p, SamplingParams(temperature=1.0, max_new_tokens=20, seed=i)))
    for _ in range(4):
        backend.step()
    assert len(checked) >= 6


def test_rejected_columns_past_every_row_are_handed_back(model, trained_drafter, spec_backend, prompts,
                                                         greedy_reference):
    # A step's columns past the widest row's emitted tokens are reused at the next step: a single row
    # never leaves holes (its window is exactly its cached tokens), and in a batch every column right
    # of the last one any row kept is free. Output stays exactly the greedy reference.
    p = prompts(1, seed=21)[0]
    single = spec_backend(model, trained_drafter, 5, max_batch_size=1, max_model_len=64)
    single.add(Request(0, 0, p, SamplingParams(temperature=0.0, max_new_tokens=30)))
    done, kv = {}, single.rows.kv
    while single.num_running or single.num_waiting:
        for fin in single.step():
            done[fin.group_id, fin.sample_id] = fin
        if single.num_running:
            cached = len(p) - 1 + int(single.rows.num_gen_R[0])  # the pending token is not cached yet
            assert kv.end - kv.lo == cached and bool(kv.valid_RC[0, kv.lo:kv.end].all())
    assert done[0, 0].completion_ids.tolist() == greedy_reference(model, p, 30)
    assert single.spec_stats.num_accepted < single.spec_stats.num_drafted  # some drafts were rejected
    batched = spec_backend(model, trained_drafter, 5, max_batch_size=3, max_model_len=64)
    for i, q in enumerate(prompts(3, seed=22)):
        batched.add(Request(i, 0, q, SamplingParams(temperature=1.0, max_new_tokens=30, seed=i)))
    for _ in range(4):
        batched.step()
        if batched.num_running:
            assert bool(batched.rows.kv.valid_RC[:batched.num_running, batched.rows.kv.end - 1].any())


def test_acceptance_by_depth_counts_only_tested_drafts():
    stats = speculative.SpecStats()
    stats.record(3, [2, 1, 0, 3])  # depth 3: rows accepting 0, 1 and all 3 drafts
    stats.record(1, [1, 1])        # depth 1: no second draft was ever tested in this step
    assert stats.tested_by_depth[:4] == [8, 4, 3, 0] and stats.accepted_by_depth[:4] == [5, 3, 3, 0]
    assert stats.accept_rate_by_depth == [5 / 8, 3 / 4, 1.0]
    assert stats.accept_len_hist[:4] == [3, 2, 0, 3] and stats.num_accepted == 1 * 2 + 3 * 3
    assert stats.num_spec_steps == 2 and stats.mean_accept_len == 11 / 8
