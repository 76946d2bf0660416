"""Layer-major replay (engine/replay/layer_major.py) gives the naive per-sample gradient in float64 (1e-10):
token- and sample-mean, tied and untied heads, qk-norm and sliding windows, LoRA adapters, activation
checkpointing, deep tries with skewed branches, random tries, DPO; log-probs without autograd; a rank without
samples; and on 2 ranks
under per-layer fully_shard (tests/engine/replay/layer_major_worker.py) the 1-rank gradient with the same
all-gather / reduce-scatter sequence on both ranks although their tries differ.
Run: pytest tests/engine/replay/test_layer_major.py
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tailrace.engine.config import FSDPConfig, LoRAConfig
from tailrace.engine.core.losses import LossNormaliser
from tailrace.engine.replay import dpo_loss
from tailrace.engine.replay.layer_major import LayerMajorForwardBackward, plan_units, sample_logprobs
from tailrace.engine.replay.replay import sample_logprobs as replay_sample_logprobs
from tailrace.engine.replay.trie import build_trie
from tailrace.engine.trainer import dist, lora
from tailrace.engine.trainer.learner import NaiveForwardBackward
from tailrace.engine.trainer.loss import LossConfig, StepLoss

torch.set_num_threads(1)
TOL = 1e-10
WORKER = Path(__file__).with_name("layer_major_worker.py")
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def deep_samples(make_samples, exact_vocab):
    """A shared prompt, two middles, each with four tails of skewed lengths (1, 2, 2 and 17 tokens), one
    sample a prefix of another and one a copy: a two-level trie under one root."""
    def deep_samples(seed=0, prompt_len=10):
        gen = torch.Generator().manual_seed(seed)
        draw = lambda n: torch.randint(0, exact_vocab, (n,), generator=gen).tolist()  # noqa: E731
        prompt, seqs = draw(prompt_len), []
        for middle_len in (4, 1):
            middle = draw(middle_len)
            seqs += [prompt + middle + [b] + draw(n) for b, n in zip(range(4), (0, 1, 1, 16), strict=True)]
        seqs += [seqs[2][: prompt_len + 6], list(seqs[4])]
        return make_samples(seqs, [prompt_len] * len(seqs), seed)

    return deep_samples


def flat_grads(model, samples, strategy, loss_fn):
    model.zero_grad(set_to_none=True)
    stats = strategy(model, samples, loss_fn, LossNormaliser.from_samples(samples))
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]), stats


def test_units_are_replays_inner_segments_and_capped_leaf_runs(deep_samples):
    trie = build_trie(deep_samples())
    units = plan_units(trie, max_unit_tokens=3)
    ran = [s for u in units for s in u.segs]
    assert ran == [s for s in range(trie.num_segments) if int(trie.input_len_S[s]) > 0]  # each once, pre-order
    for u in units:
        assert u.inner == (len(u.segs) == 1 and int(trie.seg_end_S[u.segs[0]]) > int(trie.seg_start_S[u.segs[0]])
                           + int(trie.seg_len_S[u.segs[0]]))
        assert all(int(trie.seg_parent_S[s]) == (u.ancestors[-1] if u.ancestors else -1) for s in u.segs)
        assert len(u.segs) == 1 or sum(r.hi - r.lo for r in u.rows) <= 3
    assert any(len(u.segs) > 1 for u in units) and sum(u.inner for u in units) == 3  # prompt + two middles


@pytest.mark.parametrize("arch,aggregation", [("llama", "token_mean"), ("llama", "sample_mean"),
                                              ("qwen2", "token_mean"), ("qwen2", "sample_mean")])
@pytest.mark.parametrize("unit_tokens", [8192, 3])
def test_deep_trie_equals_naive_float64(arch, aggregation, unit_tokens, cached_exact_model, deep_samples, ppo_loss,
                                        rel_err):
    """llama: untied head; qwen2: tied. PPO-clip off-policy (ratios move and clip, per-sample behaviour
    log-probs on shared tokens); unit_tokens 3 splits the runs of sibling leaves."""
    model = cached_exact_model(arch)
    samples = deep_samples()
    ref, ref_stats = flat_grads(model, samples, NaiveForwardBackward(100_000, 7), ppo_loss(samples, model, aggregation))
    got, stats = flat_grads(model, samples, LayerMajorForwardBackward(5, max_unit_tokens=unit_tokens),
                            ppo_loss(samples, model, aggregation))
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)
    for key in ("loss", "tokens", "clipped", "entropy"):
        assert float(stats[key]) == pytest.approx(float(ref_stats[key]), rel=1e-9, abs=1e-12), key
    trie = build_trie(samples)
    assert float(stats["padded_tokens"]) == 2 * trie.num_forward_tokens == 2 * float(stats["recomputed_tokens"])
    assert float(stats["unique_tokens"]) == trie.num_unique_tokens


@pytest.mark.parametrize("arch,extra", [("qwen3", {}), ("mistral", {"sliding_window": 4})])
def test_qk_norm_and_sliding_window_equal_naive(arch, extra, cached_exact_model, deep_samples, ppo_loss, rel_err):
    model = cached_exact_model(arch, **extra)
    samples = deep_samples(1)
    ref, _ = flat_grads(model, samples, NaiveForwardBackward(100_000, 7), ppo_loss(samples, model))
    got, _ = flat_grads(model, samples, LayerMajorForwardBackward(5), ppo_loss(samples, model))
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


@st.composite
def tries(draw, max_samples=6, max_len=14):
    """Samples sharing prefixes at any depth, copies, prefixes of one another, one-token branches."""
    seqs = []
    for _ in range(draw(st.integers(1, max_samples))):
        if seqs and draw(st.integers(0, 3)):
            base = draw(st.sampled_from(seqs))
            seq = base[: draw(st.integers(1, len(base)))] + draw(st.lists(st.integers(0, 2), max_size=max_len // 2))
        else:
            seq = draw(st.lists(st.integers(0, 2), min_size=2, max_size=max_len))
        seqs.append(seq if len(seq) >= 2 else seq + [1])
    return seqs, [draw(st.integers(1, len(s) - 1)) for s in seqs], draw(st.integers(0, 1000))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trie=tries(), unit_tokens=st.sampled_from([8192, 2]))
def test_random_tries_equal_naive(trie, unit_tokens, cached_exact_model, make_samples, rel_err):
    samples = make_samples(*trie)
    model = cached_exact_model("llama")
    loss = lambda: StepLoss(samples, LossConfig(is_cap=50.0))  # noqa: E731
    ref, _ = flat_grads(model, samples, NaiveForwardBackward(100_000, 7), loss())
    got, _ = flat_grads(model, samples, LayerMajorForwardBackward(5, max_unit_tokens=unit_tokens), loss())
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


@pytest.mark.parametrize("arch,targets", [("llama", ("q_proj", "v_proj")), ("qwen2", ("all-linear",))])
def test_lora_adapter_gradients_equal_naive(arch, targets, exact_model, deep_samples, ppo_loss, rel_err):
    """q_proj/v_proj only: layer 0's keys reach no adapter (no graph), as in replay."""
    pytest.importorskip("peft")
    model = exact_model(arch)
    lora.attach(model, LoRAConfig(r=4, alpha=8.0, target_modules=targets))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # peft starts B at 0, where A gets no gradient
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    samples = deep_samples(2)
    ref, _ = flat_grads(model, samples, NaiveForwardBackward(100_000, 7), ppo_loss(samples, model))
    got, _ = flat_grads(model, samples, LayerMajorForwardBackward(5), ppo_loss(samples, model))
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert float(ref.norm()) > 0 and rel_err(got, ref) <= TOL, rel_err(got, ref)


def test_activation_checkpointing_composes(exact_model, deep_samples, rel_err):
    """The layers' run methods checkpoint (shard_model at world size 1): the backward pass's recompute
    is recomputed once more, with the same gradient."""
    samples = deep_samples(3)
    plain = exact_model("qwen2")
    loss = lambda: StepLoss(samples, LossConfig(aggregation="sample_mean"))  # noqa: E731
    ref, _ = flat_grads(plain, samples, NaiveForwardBackward(100_000, 7), loss())
    checkpointed = dist.shard_model(exact_model("qwen2"), FSDPConfig(), checkpointing=True)
    got, _ = flat_grads(checkpointed, samples, LayerMajorForwardBackward(5), loss())
    assert rel_err(got, ref) <= TOL, rel_err(got, ref)


def test_dpo_sequence_loss_equals_naive(cached_exact_model, make_samples, naive_dpo_grads, rel_err, exact_vocab):
    """DPO's per-sample summed log-probs come from layer-major's own forward (no depth-first pass)."""
    model = cached_exact_model("llama")
    gen = torch.Generator().manual_seed(5)
    seqs, pairs = [], []
    for _ in range(2):
        prompt = torch.randint(0, exact_vocab, (6,), generator=gen).tolist()
        pairs.append((len(seqs), len(seqs) + 1))
        seqs += [prompt + torch.randint(0, exact_vocab, (n,), generator=gen).tolist() for n in (5, 3)]
    samples = make_samples(seqs, [6] * len(seqs))
    ref_S = -torch.rand(len(samples), generator=gen, dtype=torch.float64) * 10
    expected, expected_loss = naive_dpo_grads(model, samples, pairs, ref_S, 0.5)
    got, stats = flat_grads(model, samples, LayerMajorForwardBackward(5), dpo_loss.DPOLoss(pairs, ref_S, beta=0.5))
    assert rel_err(got, expected) <= TOL, rel_err(got, expected)
    assert float(stats["loss_dpo"]) == pytest.approx(expected_loss, rel=1e-12)


def test_sample_logprobs_equal_replays(cached_exact_model, deep_samples):
    model = cached_exact_model("qwen2")
    samples = deep_samples(4)
    want = replay_sample_logprobs(model, samples, 5)
    got = sample_logprobs(model, samples, 5, max_unit_tokens=3)
    assert [g.shape for g in got] == [w.shape for w in want]
    assert max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True)) <= 1e-12
    assert sample_logprobs(model, [], 5) == []


def test_rank_without_samples_runs_a_zero_padding_unit(cached_exact_model):
    model = cached_exact_model("qwen2")
    model.zero_grad(set_to_none=True)
    stats = LayerMajorForwardBackward(5)(model, [], None, None)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())  # every layer ran, weight 0
    assert all(float(v) == 0 for v in stats.values()) and "padded_tokens" in stats


def _run_two_ranks(out: Path, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
           str(WORKER), "--out", str(out), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_two_ranks_per_layer_fsdp_equal_one_rank_with_one_collective_sequence(arch, tmp_path, rel_err):
    """Rank 0 trains a deep two-level trie, rank 1 a flat group of another prompt (different units, depths
    and leaf runs) under fully_shard per layer (reshard_after_forward=True); their summed gradient is the
    1-rank gradient of both, and both ranks ran the same all-gathers and reduce-scatters, in order:
    root, every layer forward, every layer backward (gather, then reduce) from the top, root."""
    _run_two_ranks(tmp_path / "two.pt", "--arch", arch)
    one = tmp_path / "one.pt"
    proc = subprocess.run([sys.executable, str(WORKER), "--out", str(one), "--arch", arch],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two, ref = torch.load(tmp_path / "two.pt", weights_only=True), torch.load(one, weights_only=True)
    assert sorted(two["grads"]) == sorted(ref["grads"])
    worst = max(rel_err(two["grads"][k], ref["grads"][k]) for k in ref["grads"])
    assert worst <= TOL, worst
    logs = two["collectives"]
    assert logs[0] == logs[1], "the ranks' collective sequences differ"
    num_layers = two["num_layers"]
    kinds = [kind for kind, _ in logs[0]]
    assert kinds == ["all_gather"] * (1 + num_layers) + ["all_gather", "reduce_scatter"] * num_layers \
        + ["reduce_scatter"]
    # All-gathers send a shard, reduce-scatters the whole unit: root first and last, one layer size between.
    root_shard, layer_shard = logs[0][0][1], logs[0][1][1]
    assert root_shard != layer_shard and logs[0][-1][1] == 2 * root_shard
    assert all(size == (layer_shard if kind == "all_gather" else 2 * layer_shard) for kind, size in logs[0][1:-1])
    assert two["units"][0] != two["units"][1]  # the tries really differ
    # A rank without samples (its padding unit) runs the same sequence as one with a trie.
    _run_two_ranks(tmp_path / "empty.pt", "--arch", arch, "--empty-rank")
    empty = torch.load(tmp_path / "empty.pt", weights_only=True)
    assert empty["collectives"][0] == empty["collectives"][1] == logs[0]
    # Two micro-batches per rank, gradient sync off in the first (FSDP2 accumulation without communication):
    # the same gradient; the first call's collectives are its all-gathers only.
    _run_two_ranks(tmp_path / "accum.pt", "--arch", arch, "--micro-batches", "2")
    accum = torch.load(tmp_path / "accum.pt", weights_only=True)
    worst = max(rel_err(accum["grads"][k], ref["grads"][k]) for k in ref["grads"])
    assert worst <= TOL, worst
    gathers = [entry for entry in logs[0] if entry[0] == "all_gather"]
    assert accum["collectives"][0] == accum["collectives"][1] == gathers + logs[0]
    # Log-probs without autograd (proximal / reference): the forward half, the same on both ranks.
    for run in (two, empty):
        assert run["logprob_collectives"][0] == run["logprob_collectives"][1] == logs[0][: 1 + num_layers]
