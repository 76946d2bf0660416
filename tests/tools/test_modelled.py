"""Modelled compute (tools/benches/modelled.py): the backend keeps TorchBackend's interface without running
a model, lengths are reproducible per (group, sample), versions are stamped, the modelled learner sleeps
its modelled time and advances versions without touching the weights, and the services take both
through their seams.
Run: pytest tests/tools/test_modelled.py
"""

import dataclasses
import functools
import random
import time
import types

import pytest
import torch

import tools.benches.modelled as modelled_module
from tailrace.engine.config import TrainConfig
from tailrace.engine.core.samples import Group, TrainSample
from tailrace.engine.generator.torch_backend.backend import Request, TorchBackend
from tailrace.protocol.messages import SamplingParams
from tools.benches.modelled import (
    Completion,
    Costs,
    LinearCost,
    MeasuredCost,
    ModelledBackend,
    ModelledLearner,
    load_costs,
    train_tokens,
)

torch.set_num_threads(1)

VOCAB, EOS, MAX_NEW = 64, 2, 12
SAMPLING = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=[EOS])
SERVICE_USES = ("add", "step", "cancel", "update_weights", "capacity", "num_running", "num_waiting",
                "policy_version", "pause_admission", "stats", "max_model_len", "drain")


@pytest.fixture(scope="module")
def tiny_model(tiny_lm):
    def tiny_model():
        return tiny_lm("qwen2", attn="sdpa", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                       max_position_embeddings=64).eval()

    return tiny_model


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model()


FREE = LinearCost(0.0, 0.0)


def make_costs(decode_s: float = 1e-4, train: LinearCost = FREE) -> Costs:
    completions = [Completion(4, n, "stop") for n in (1, 3, 5, 8)] + [Completion(4, MAX_NEW, "length")]
    completions += [Completion(20, n, "stop") for n in (20, 30)]
    return Costs(decode_step_s={1: [decode_s], 4: [decode_s, 2 * decode_s]}, prefill=LinearCost(0.0, 0.0),
                 train=train, completions=completions, seed=3)


def modelled(model, costs=None, max_batch_size=4) -> ModelledBackend:
    real = TorchBackend(model, max_batch_size=max_batch_size, max_model_len=64, eos_token_ids=[EOS])
    return ModelledBackend(real, costs or make_costs())


def requests(num_groups: int, group_size: int, prompt=(1, 5, 6, 7)) -> list[Request]:
    return [Request(g, s, list(prompt), SAMPLING) for g in range(num_groups) for s in range(group_size)]


def run_all(backend: ModelledBackend, reqs: list[Request]) -> dict:
    for r in reqs:
        backend.add(r)
    out = {}
    while backend.num_running or backend.num_waiting:
        out |= {(f.group_id, f.sample_id): f for f in backend.step()}
    return out


def test_interface_matches_what_the_generator_service_uses(model):
    backend = modelled(model)
    for name in SERVICE_USES:
        assert hasattr(backend, name), name
    assert backend.max_model_len == 64 and backend.policy_version == 0
    assert backend.stats.num_generated_tokens == 0 and backend.stats.tokens_per_s == 0.0


def test_lengths_reproducible_by_group_and_sample_whatever_the_batch(model):
    reqs = requests(3, 4)
    one = run_all(modelled(model, max_batch_size=4), reqs)
    other = run_all(modelled(model, max_batch_size=2), list(reversed(reqs)))
    assert one.keys() == other.keys() == {(r.group_id, r.sample_id) for r in reqs}
    assert {k: len(f.completion_ids) for k, f in one.items()} == {k: len(f.completion_ids) for k, f in other.items()}
    assert len({len(f.completion_ids) for f in one.values()}) > 1  # drawn, not constant


def test_prefill_charged_once_per_distinct_prompt_of_an_admission(model):
    # As TorchBackend prefills a group's shared prompt once: 3 rows of one prompt and 1 of another are
    # charged the padded width (the longer prompt less its last token) times 2 prompts, not times 4.
    costs = dataclasses.replace(make_costs(), prefill=LinearCost(0.0, 1e-3))
    backend = modelled(model, costs)
    for r in [*requests(1, 3, prompt=(1, 5, 6, 7, 8)), Request(5, 0, [1, 5], SAMPLING)]:
        backend.add(r)
    backend.step()
    assert backend.stats.prefill_s == pytest.approx(1e-3 * 4 * 2)


def test_finish_reasons_tokens_and_logprobs_consistent(model):
    finished = run_all(modelled(model), requests(8, 4))
    reasons = {f.finish_reason for f in finished.values()}
    assert reasons <= {"stop", "length"} and "stop" in reasons
    for f in finished.values():
        ids = f.completion_ids.tolist()
        assert 1 <= len(ids) <= MAX_NEW and all(0 <= t < VOCAB for t in ids)
        if f.finish_reason == "stop":
            assert ids[-1] == EOS and EOS not in ids[:-1] and len(ids) < MAX_NEW
        else:
            assert len(ids) == MAX_NEW and EOS not in ids
        assert f.behaviour_logprobs.dtype == torch.float32 and f.behaviour_logprobs.shape == (len(ids),)
        assert bool(torch.isfinite(f.behaviour_logprobs).all()) and bool((f.behaviour_logprobs <= 0).all())


def test_length_cut_by_max_new_tokens_and_nearest_prompt_length(model):
    backend = modelled(model)
    sampling = SamplingParams(max_new_tokens=10, stop_token_ids=[EOS])
    prompt = [1] + [5] * 18  # 19 tokens: the nearest measured prompt length is 20, completions of 20 / 30
    finished = []
    backend.add(Request(0, 0, prompt, sampling))
    while backend.num_running or backend.num_waiting:
        finished += backend.step()
    assert len(finished) == 1 and len(finished[0].completion_ids) == 10 and finished[0].finish_reason == "length"


def test_policy_versions_stamped_per_token_across_an_update(model):
    backend = modelled(model)
    backend.add(Request(0, 4, [1, 5, 6, 7], SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=[])))
    backend.step()
    backend.update_weights({}, 1)
    finished = []
    while backend.num_running:
        finished += backend.step()
    versions = finished[0].policy_versions.tolist()
    assert versions[0] == 0 and set(versions[1:]) == {1} and finished[0].policy_versions.dtype == torch.long
    with pytest.raises(ValueError, match="older"):
        backend.update_weights({}, 0)


def test_capacity_pause_cancel_and_drain(model):
    backend = modelled(model, max_batch_size=4)
    for r in requests(2, 3):
        backend.add(r)
    assert backend.num_waiting == 6 and backend.capacity() == 0
    done = backend.step()
    assert backend.num_running + len(done) == 4 and backend.num_waiting == 2
    cancelled = backend.cancel([0])
    assert {f.finish_reason for f in cancelled} == {"cancelled"} and all(f.group_id == 0 for f in cancelled)
    assert all(r.request.group_id == 1 for r in backend._rows) and all(r.request.group_id == 1 for r in backend._waiting)
    backend.pause_admission = True
    waiting = backend.num_waiting
    backend.drain()
    assert backend.num_running == 0 and backend.num_waiting == waiting and backend.pause_admission
    assert backend.capacity() == 4 - waiting


def test_add_rejects_what_the_real_backend_rejects(model):
    backend = modelled(model)
    for prompt in ([], [1] * 64, [1, VOCAB]):
        with pytest.raises(ValueError):
            backend.add(Request(0, 0, prompt, SAMPLING))


def test_step_sleeps_the_measured_decode_cost(model):
    backend = modelled(model, make_costs(decode_s=0.02))
    backend.add(Request(0, 0, [1, 5, 6, 7], SamplingParams(max_new_tokens=3, stop_token_ids=[])))
    start = time.monotonic()
    while backend.num_running or backend.num_waiting:
        backend.step()
    elapsed = time.monotonic() - start
    assert 0.055 <= elapsed < 2.0
    assert backend.stats.num_steps == 3 and backend.stats.num_generated_tokens == 3
    assert backend.stats.decode_s >= 0.055 and backend.stats.tokens_per_s > 0


def test_decode_steps_take_oversleeping_off_the_next_step(model, monkeypatch):
    """A machine that wakes every sleeper 4 ms late: n modelled steps of 10 ms take n * 10 + 4 ms, not
    n * 14 (the learner's sleeps go through the same Sleeper)."""
    clock = [0.0]

    def late_sleep(seconds):
        clock[0] += seconds + 0.004

    monkeypatch.setattr(modelled_module, "time", types.SimpleNamespace(sleep=late_sleep, monotonic=lambda: clock[0]))
    backend = modelled(model, dataclasses.replace(make_costs(), decode_step_s={1: [0.01], 4: [0.01]}))
    for sample_id in range(8):  # lengths drawn per sample: the longest sets the number of steps
        backend.add(Request(0, sample_id, [1, 5, 6, 7], SamplingParams(max_new_tokens=10, stop_token_ids=[])))
    while backend.num_running or backend.num_waiting:
        backend.step()
    assert backend.stats.num_steps >= 5
    assert clock[0] == pytest.approx(backend.stats.num_steps * 0.01 + 0.004)


def test_speculation_modelled_as_the_measured_speedup_of_the_nearest_batch_size(model):
    """Costs.speculate: each step sleeps the decode cost over spec_speedup at the nearest measured batch
    size (4 rows: 2.5x; 1 row: 1.25x, nearer 1 than 4), the same tokens come out."""
    plain = make_costs(decode_s=0.02)
    spec = dataclasses.replace(plain, spec_speedup={1: 1.25, 4: 2.5}, speculate=True)
    rng = random.Random(0)
    assert spec.spec_decode_s(4, rng) in (0.02 / 2.5, 0.04 / 2.5)
    assert spec.spec_decode_s(2, rng) == pytest.approx(0.02 / 1.25)
    times, outputs = [], []
    for costs in (plain, spec):
        backend = modelled(model, costs)
        start = time.monotonic()
        outputs.append(run_all(backend, requests(1, 4)))
        times.append(time.monotonic() - start)
    assert {k: f.completion_ids.tolist() for k, f in outputs[0].items()} == \
        {k: f.completion_ids.tolist() for k, f in outputs[1].items()}
    assert times[1] < 0.75 * times[0]
    with pytest.raises(ValueError, match="speculate needs spec_speedup"):
        dataclasses.replace(plain, speculate=True)
    with pytest.raises(ValueError, match="spec_speedup must be positive"):
        dataclasses.replace(plain, spec_speedup={1: 0.0})


def test_costs_file_round_trip_and_errors(tmp_path):
    costs = make_costs()
    costs.save(tmp_path / "costs.json")
    loaded = load_costs(tmp_path / "costs.json")
    assert loaded.to_json() == costs.to_json()
    spec = dataclasses.replace(costs, spec_speedup={1: 1.5, 8: 1.2}, speculate=True)
    spec.save(tmp_path / "spec.json")
    assert load_costs(tmp_path / "spec.json").to_json() == spec.to_json()
    assert load_costs(tmp_path / "spec.json").spec_speedup == {1: 1.5, 8: 1.2}
    calls = dataclasses.replace(costs, call=MeasuredCost.of([(10, 0.03), (50, 0.04)]), optimizer_s=0.01)
    calls.save(tmp_path / "calls.json")
    assert load_costs(tmp_path / "calls.json").to_json() == calls.to_json()
    assert load_costs(tmp_path / "calls.json").call == calls.call
    (tmp_path / "bad.json").write_text('{"format": 99}')
    with pytest.raises(ValueError, match="costs file"):
        load_costs(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="costs file"):
        load_costs(tmp_path / "missing.json")


def test_linear_fit():
    fit = LinearCost.fit([(100, 0.2), (200, 0.3), (400, 0.5)])
    assert fit.intercept_s == pytest.approx(0.1) and fit.per_token_s == pytest.approx(0.001)
    through_origin = LinearCost.fit([(100, 0.0), (200, 0.5)])  # a negative intercept is noise
    assert through_origin.intercept_s == 0.0 and through_origin(0) == 0.0 and through_origin(200) > 0


def _group(group_id: int, lengths: list[int]) -> Group:
    samples = [TrainSample(group_id=group_id, sample_id=i, prompt_ids=[1, 5, 6], completion_ids=[7] * n,
                           behaviour_logprobs=[-1.0] * n, policy_versions=[0] * n, reward=float(i))
               for i, n in enumerate(lengths)]
    return Group(group_id=group_id, samples=samples)


def test_modelled_learner_sleeps_and_advances_versions_without_touching_weights(model, tiny_model):
    learner = ModelledLearner(tiny_model(), TrainConfig(micro_batch_tokens=64, replay="naive"),
                              costs=make_costs(train=LinearCost(0.02, 1e-4)))
    before = {k: v.clone() for k, v in learner.model.state_dict().items()}
    batch = [_group(0, [2, 5]), _group(1, [9, 1])]
    start = time.monotonic()
    metrics = learner.step(batch)
    elapsed = time.monotonic() - start
    tokens = train_tokens([s for g in batch for s in g.samples], 64)
    assert tokens >= sum(s.num_tokens - 1 for g in batch for s in g.samples)  # padding counted
    assert 0.02 + 1e-4 * tokens - 0.005 <= elapsed < 2.0
    assert learner.step_count == 1 and learner.policy_version == 1
    assert metrics["trainer/policy_version"] == 1.0 and metrics["trainer/samples"] == 4.0
    assert metrics["trainer/tokens/padded"] == tokens and metrics["trainer/staleness/max"] == 0.0
    learner.step(batch)
    assert learner.policy_version == 2
    assert all(torch.equal(before[k], v) for k, v in learner.model.state_dict().items())
    with pytest.raises(ValueError):
        learner.step([])


def test_every_early_call_pays_the_measured_fixed_cost_of_a_call(model, tiny_model):
    """accumulate() sleeps a whole call (Costs.call), fixed part included, and a step the optimizer's share
    plus one call over the groups not accumulated: three early calls of one group each cost three fixed
    parts, as on the real learner, against one for a step that runs all four."""
    call, optimizer = MeasuredCost.of([(10, 0.03), (40, 0.033), (80, 0.04), (40, 0.031)]), 0.01
    learner = ModelledLearner(tiny_model(), TrainConfig(micro_batch_tokens=64, replay="naive"),
                              costs=dataclasses.replace(make_costs(), call=call, optimizer_s=optimizer))
    slept = []
    learner._sleep = slept.append
    batch = [_group(i, [2, 5, 3]) for i in range(4)]
    tokens = [train_tokens(g.samples, 64) for g in batch]
    all_tokens = train_tokens([s for g in batch for s in g.samples], 64)
    for group in batch[:3]:
        assert learner.accumulate([group])
    metrics = learner.step(batch)
    assert slept == pytest.approx([call(t) for t in tokens[:3]] + [optimizer + call(tokens[3])])
    assert metrics["trainer/modelled/step_s"] == pytest.approx(optimizer + call(tokens[3]))
    slept.clear()
    learner.step(batch)  # nothing accumulated: one call over all of it
    assert slept == pytest.approx([optimizer + call(all_tokens)])
    assert sum(call(t) for t in tokens) > 3 * 0.03 > call(all_tokens)
    slept.clear()
    learner.accumulate(batch)
    learner.step(batch)  # everything accumulated: the optimizer alone
    assert slept == pytest.approx([call(all_tokens), optimizer])


def test_measured_cost_interpolates_its_points():
    cost = MeasuredCost.of([(100, 0.05), (20, 0.03), (100, 0.07), (60, 0.02), (300, 0.25)])
    # medians per token count, then non-decreasing: (20, 0.03), (60, 0.03), (100, 0.06), (300, 0.25)
    assert [t for t, _ in cost.points] == [20.0, 60.0, 100.0, 300.0]
    assert [s for _, s in cost.points] == pytest.approx([0.03, 0.03, 0.06, 0.25])
    assert cost(5) == 0.03 and cost(20) == 0.03 and cost(80) == pytest.approx(0.045)
    assert cost(300) == 0.25 and cost(580) == pytest.approx(0.25 + 280 * 0.22 / 280)
    with pytest.raises(ValueError):
        MeasuredCost.of([])


def test_the_services_take_modelled_compute_through_their_seams(tmp_path):
    from tailrace.engine.config import load_config
    from tailrace.engine.generator.service import GeneratorService
    from tailrace.engine.trainer.service import TrainerService
    from tools.benches.modelled import backend_factory

    costs = make_costs()
    cfg = load_config(None, ["--trainer.runs_dir", str(tmp_path), "--trainer.run_name", "seams"])
    trainer = TrainerService(cfg, make_learner=functools.partial(ModelledLearner, costs=costs))
    assert type(trainer.learner) is ModelledLearner and trainer.learner.costs is costs
    generator = GeneratorService(cfg, "tcp://127.0.0.1:1", make_backend=backend_factory(costs))
    assert type(generator.backend) is ModelledBackend and generator.backend.costs is costs
    assert generator.backend.max_batch_size == cfg.generator.max_batch_size
    with pytest.raises(ValueError, match="generator.speculation"):
        GeneratorService(load_config(None, ["--generator.speculation", "true"]), "tcp://127.0.0.1:1",
                         make_backend=backend_factory(costs))
