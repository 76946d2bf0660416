"""The drafter and its spot trainer: shared frozen policy parts, files and wire state, trace alignment,
packing without attention across samples, yielding to work within one step, acceptance that rises.

Run: pytest tests/engine/generator/speculation/test_drafter.py
"""

import pytest
import torch

from tailrace.engine.core.drafter import CONFIG_FILE, Drafter, DrafterConfig, load_or_create
from tailrace.engine.generator.speculation.drafter_training import (
    KeyRecorder,
    SpotConfig,
    SpotTrainer,
    TraceBuffer,
    block_causal_mask,
    drafter_passes,
    pack,
)
from tailrace.engine.generator.speculation.speculative import FixedDepth, Trace
from tailrace.engine.generator.torch_backend.backend import Request, TorchBackend
from tailrace.protocol.messages import SamplingParams

torch.set_num_threads(1)

VOCAB = 64


def prompts(num: int, seed: int, max_len: int = 10) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (num,), generator=gen).tolist()
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def rollouts(model, drafter, k: int, ps: list[list[int]], sampling: SamplingParams, seed: int = 0):
    """(backend, finished) after decoding every prompt once with speculation depth k."""
    backend = TorchBackend(model, max_batch_size=16, max_model_len=64, seed=seed)
    backend.enable_speculation(drafter, FixedDepth(k), max_traces=1000)
    for i, p in enumerate(ps):
        backend.add(Request(i, 0, p, sampling))
    finished = []
    while backend.num_running or backend.num_waiting:
        finished += backend.step()
    return backend, finished


@pytest.fixture(scope="module")
def model(make_model):
    return make_model()


def test_shares_the_policy_embedding_and_head_frozen(model):
    drafter = Drafter.for_policy(model)
    assert drafter._shared[0] is model.get_input_embeddings() and drafter._shared[1] is model.get_output_embeddings()
    names = set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    own = {p.data_ptr() for p in drafter.parameters()}
    assert model.get_input_embeddings().weight.data_ptr() not in own
    ids = torch.tensor([[3, 4]])
    torch.testing.assert_close(drafter.embed(ids), model.get_input_embeddings()(ids))
    before = {n: p.clone() for n, p in model.named_parameters()}
    backend, _ = rollouts(model, drafter, 0, prompts(4, seed=1), SamplingParams(max_new_tokens=8))
    spot = SpotTrainer(drafter, SpotConfig(tokens_per_step=64))
    spot.add_traces(backend.take_traces())
    assert spot.train_step() is not None
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]) and param.grad is None, name


def test_save_load_and_wire_state(model, tmp_path):
    drafter = Drafter.for_policy(model, seed=1)
    drafter.version = 7
    drafter.save(tmp_path / "d")
    loaded = load_or_create(tmp_path / "d", model)
    assert loaded.version == 7 and loaded.config == drafter.config
    for name, value in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value)
    fresh = load_or_create(tmp_path / "missing", model, seed=1)
    assert fresh.version == 0 and not (tmp_path / "missing" / CONFIG_FILE).exists()
    state = drafter.export_state()
    name = next(iter(state))
    with pytest.raises(ValueError, match="missing"):
        fresh.load_state({k: v for k, v in state.items() if k != name}, 8)
    with pytest.raises(ValueError, match="shape"):
        fresh.load_state({**state, name: torch.zeros(1)}, 8)
    assert fresh.version == 0
    fresh.load_state(state, 8)
    assert fresh.version == 8 and torch.equal(fresh.state_dict()[name], state[name])
    with pytest.raises(ValueError, match="num_kv_heads"):
        DrafterConfig(hidden_size=8, num_heads=3, num_kv_heads=2, head_dim=4, intermediate_size=8, vocab_size=4)


@pytest.mark.parametrize("k", [0, 3])
def test_traces_pair_each_hidden_state_with_the_next_token(model, k):
    # hidden[t] of a captured trace is the policy's final hidden state after tokens[:t + 1] (full
    # recompute), whether the tokens came from plain steps or from verified drafts.
    drafter = Drafter.for_policy(model)
    ps = prompts(5, seed=2)
    backend, finished = rollouts(model, drafter, k, ps, SamplingParams(temperature=1.0, max_new_tokens=12))
    traces = backend.take_traces()
    assert len(traces) == len(ps)
    by_tokens = {tuple(t.tokens.tolist()): t for t in traces}
    for fin in finished:
        tokens = fin.prompt_ids + fin.completion_ids.tolist()
        trace = by_tokens[tuple(tokens)]
        with torch.no_grad():
            hidden = model.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]
        torch.testing.assert_close(trace.hidden, hidden, atol=1e-4, rtol=1e-4)
        # And the logits of hidden[t] are the policy's prediction of token t + 1.
        predicted = model.lm_head(trace.hidden)
        torch.testing.assert_close(predicted, model(torch.tensor([tokens[:-1]])).logits[0], atol=1e-4, rtol=1e-4)


def test_pack_pairs_hidden_t_with_token_t_plus_1():
    def trace(tokens, base, num_prompt_tokens=1):
        n = len(tokens)
        hidden = (base + torch.arange(n - 1, dtype=torch.float32))[:, None].expand(n - 1, 3)
        return Trace(torch.tensor(tokens), hidden, policy_version=0, num_prompt_tokens=num_prompt_tokens)

    a, b, c = trace([10, 11, 12, 13], 100.0, num_prompt_tokens=2), trace([20, 21, 22], 200.0), trace([30, 31], 300.0)
    packed = pack([a, b, c], max_tokens=100, row_tokens=5)
    # Rows of at most 5 positions: [a, b] and [c, padding...].
    assert packed.ids_RT.tolist() == [[10, 11, 12, 20, 21], [30, 0, 0, 0, 0]]
    # The feature at token t is hidden[t - 1]: hidden state t goes with token t + 1.
    assert packed.features_RTH[0, :, 0].tolist() == [0.0, 100.0, 101.0, 0.0, 200.0]
    assert packed.targets_RTH[0, :, 0].tolist() == [100.0, 101.0, 102.0, 200.0, 201.0]
    assert packed.features_RTH[1, 0, 0] == 0.0 and packed.targets_RTH[1, 0, 0] == 300.0
    assert packed.positions_RT[0].tolist() == [0, 1, 2, 0, 1]
    assert packed.segments_RT.tolist() == [[0, 0, 0, 1, 1], [2, -1, -1, -1, -1]]
    # Learnt: positions predicting a completion token (from the last prompt token on), never padding.
    assert packed.loss_RT.int().tolist() == [[0, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert pack([a, b], max_tokens=4).ids_RT.tolist() == [[10, 11, 12, 20]]
    assert pack([a], max_tokens=100, row_tokens=2).ids_RT.tolist() == [[10, 11]]
    mask = block_causal_mask(packed.segments_RT)[0, 0]
    assert mask[3].tolist() == [False, False, False, True, False] and mask[2].tolist()[:3] == [True] * 3
    with pytest.raises(ValueError, match="two tokens"):
        pack([trace([5], 0.0)], max_tokens=10)


def test_no_attention_across_packed_samples(model):
    drafter = Drafter.for_policy(model, seed=2)
    gen = torch.Generator().manual_seed(0)
    traces = [Trace(torch.randint(0, VOCAB, (n,), generator=gen), torch.randn(n - 1, 32, generator=gen), 0)
              for n in (7, 5)]
    packed = pack(traces, max_tokens=100)
    assert packed.ids_RT.shape[0] == 1  # both in one row
    segments = packed.segments_RT[0]
    with torch.no_grad():
        together = drafter(packed.ids_RT, packed.features_RTH, packed.positions_RT,
                           block_causal_mask(packed.segments_RT))
        for j, trace in enumerate(traces):
            alone = pack([trace], max_tokens=100)
            out = drafter(alone.ids_RT, alone.features_RTH, alone.positions_RT, block_causal_mask(alone.segments_RT))
            torch.testing.assert_close(together[:, segments == j], out, atol=1e-5, rtol=1e-5)
        # A plain causal mask lets the second sample see the first: the test above would notice.
        leaky = drafter(packed.ids_RT, packed.features_RTH, packed.positions_RT,
                        block_causal_mask(torch.zeros_like(packed.segments_RT)))
    assert not torch.allclose(leaky[:, segments == 1], together[:, segments == 1], atol=1e-3)


class FakeClock:
    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


@torch.no_grad()
def test_unrolled_passes_are_what_later_drafts_see(model):
    # Drafting feeds the k >= 2nd draft the drafter's own prediction for the position before, with a
    # cache of keys computed from the policy's true hidden states (the catch-up) up to the step's pending
    # token, then the keys of the step's earlier drafts. Unrolled pass d must compute exactly the draft at
    # depth d + 1 at every position, two traces packed in one row included.
    drafter = Drafter.for_policy(model, seed=5)
    for p in drafter.parameters():
        p.add_(0.1 * torch.randn_like(p))  # away from the near-identity init
    gen = torch.Generator().manual_seed(3)
    traces = []
    for n in (9, 7):
        tokens = torch.randint(0, VOCAB, (n,), generator=gen)
        traces.append(Trace(tokens, model.model(tokens[None]).last_hidden_state[0, :-1], 0, 1))
    packed = pack(traces, 64, row_tokens=64)
    passes = drafter_passes(drafter, packed, unroll=3)
    assert [name for name, _ in passes] == ["tf", "unroll", "unroll2", "unroll3"]
    col = 0
    for trace in traces:
        ids, hidden = trace.tokens[:-1], trace.hidden
        features = torch.cat((torch.zeros_like(hidden[:1]), hidden[:-1]))[None]
        for pending in range(ids.numel() - 1):
            # catch-up over 0 .. pending with true features, then one draft forward per later position
            cache = KeyRecorder()
            causal = torch.ones(pending + 1, pending + 1, dtype=torch.bool).tril()[None, None]
            pred = drafter(ids[None, :pending + 1], features[:, :pending + 1], torch.arange(pending + 1)[None],
                           causal, cache=cache)[:, -1:]
            torch.testing.assert_close(passes[0][1][0, col + pending], pred[0, 0], atol=1e-5, rtol=1e-5)
            keys, values = cache.keys, cache.values
            for depth in range(1, min(3, ids.numel() - 1 - pending) + 1):
                t = pending + depth
                cache = KeyRecorder(earlier=(keys, values))
                pred = drafter(ids[None, t:t + 1], pred, torch.tensor([[t]]),
                               torch.ones(1, 1, 1, t + 1, dtype=torch.bool), cache=cache)
                keys, values = torch.cat((keys, cache.keys), dim=2), torch.cat((values, cache.values), dim=2)
                torch.testing.assert_close(passes[depth][1][0, col + t], pred[0, 0], atol=1e-5, rtol=1e-5)
        col += ids.numel()


def test_spot_trainer_yields_within_one_step_when_work_arrives(model):
    drafter = Drafter.for_policy(model)
    backend, _ = rollouts(model, drafter, 0, prompts(4, seed=3), SamplingParams(max_new_tokens=8))
    clock = FakeClock()
    spot = SpotTrainer(drafter, SpotConfig(tokens_per_step=32), clock=clock)
    assert spot.run(lambda: False) == 0  # nothing to learn from yet
    spot.add_traces(backend.take_traces())
    step_s, work_arrives_s = 0.05, 0.12
    real_step = spot.train_step

    def slow_step():
        clock.now_s += step_s  # each step takes 50 ms of (fake) time
        return real_step()

    spot.train_step = slow_step
    steps = spot.run(should_yield=lambda: clock.now_s >= work_arrives_s)
    assert steps == 3 and work_arrives_s <= clock.now_s < work_arrives_s + step_s
    assert spot.run(should_yield=lambda: True) == 0 and spot.run(lambda: False, max_steps=2) == 2
    assert spot.num_steps == 5


def test_acceptance_rises_while_training_on_a_fixed_policy(model):
    drafter = Drafter.for_policy(model, seed=4)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24)
    backend, _ = rollouts(model, drafter, 0, prompts(32, seed=5), sampling)
    spot = SpotTrainer(drafter, SpotConfig(tokens_per_step=256, lr=3e-3), seed=1)
    spot.add_traces(backend.take_traces())
    held_out = [Request(i, 0, p, SamplingParams(temperature=1.0, max_new_tokens=24, seed=i))
                for i, p in enumerate(prompts(12, seed=6))]

    def mean_accept_len() -> float:
        backend = TorchBackend(model, max_batch_size=12, max_model_len=64)
        backend.enable_speculation(drafter, FixedDepth(3), max_traces=0)
        for req in held_out:
            backend.add(req)
        while backend.num_running or backend.num_waiting:
            backend.step()
        return backend.spec_stats.mean_accept_len

    before = mean_accept_len()
    first = spot.train_step()
    spot.run(lambda: False, max_steps=39)
    after = mean_accept_len()
    assert after > before + 0.15, (before, after)
    assert spot.last_metrics["accept_tf"] > first["accept_tf"] + 0.05


def test_trace_buffer_keeps_recent_tokens_and_versions():
    def trace(n, version):
        return Trace(torch.zeros(n, dtype=torch.long), torch.zeros(n - 1, 2), version)

    buffer = TraceBuffer(max_tokens=20, keep_versions=2)
    for version in (0, 0, 1):
        buffer.add(trace(6, version))
    assert len(buffer) == 3 and buffer.num_tokens == 18
    buffer.add(trace(6, 1))  # over 20 tokens: the oldest goes
    assert len(buffer) == 3 and buffer.num_tokens == 18
    buffer.add(trace(4, 2))  # version 2: traces of version 0 are too old now
    assert {t.policy_version for t in buffer._traces} == {1, 2} and buffer.num_tokens == 16
    buffer.add(trace(4, 0))  # arrives late and too old
    buffer.add(trace(1, 2))  # too short to train on
    assert buffer.num_tokens == 16


def test_export_share_and_hot_swap_into_a_running_backend(model):
    drafter = Drafter.for_policy(model, seed=5)
    spot = SpotTrainer(drafter)
    version, state = spot.export()
    assert version == 1 == drafter.version and all(t.device.type == "cpu" for t in state.values())
    other = Drafter.for_policy(model, seed=6)
    other_spot = SpotTrainer(other)
    assert other_spot.load_shared(state, version) and other.version == 1
    assert not other_spot.load_shared(state, version)  # not newer: ignored
    # A running backend takes new drafter weights between steps; decoding stays exact.
    backend = TorchBackend(model, max_batch_size=2, max_model_len=48)
    backend.enable_speculation(Drafter.for_policy(model, seed=7), FixedDepth(3))
    p = prompts(1, seed=7)[0]
    backend.add(Request(0, 0, p, SamplingParams(temperature=0.0, max_new_tokens=16)))
    backend.step()
    backend.update_drafter(state, version)
    out = []
    while backend.num_running:
        out += backend.step()
    plain = TorchBackend(model, max_batch_size=1, max_model_len=48)
    plain.add(Request(0, 0, p, SamplingParams(temperature=0.0, max_new_tokens=16)))
    expected = []
    while plain.num_running or plain.num_waiting:
        expected += plain.step()
    assert out[0].completion_ids.tolist() == expected[0].completion_ids.tolist()
    assert backend.drafter.version == 1
    with pytest.raises(ValueError, match="not enabled"):
        plain.update_drafter(state, 2)
