"""Branch-replay and packed tries give the naive per-sample gradient: GRPO, PPO-clip off-policy, DPO, on
tiny Llama / Qwen2 / Qwen3 / Mistral configs with grouped-query attention; budgets, learner, errors.

float64 runs use `exact_norms` (exact_model, tests/engine/conftest.py): Hugging Face's RMSNorm computes in
float32 even in a float64 model, which alone leaves ~1e-8 relative differences between any two evaluation
orders; with float64 norms the same models agree to ~1e-15, so 1e-9 tests the algorithm, not the norm's
rounding.
"""

import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from tailrace.engine.config import TrainConfig
from tailrace.engine.core.losses import LossNormaliser
from tailrace.engine.core.samples import Group
from tailrace.engine.replay import dpo_loss
from tailrace.engine.replay.packed import AutoForwardBackward, PackedForwardBackward, choose_mode
from tailrace.engine.replay.replay import ReplayForwardBackward
from tailrace.engine.replay.trie import build_trie
from tailrace.engine.trainer.learner import Learner, NaiveForwardBackward
from tailrace.engine.trainer.loss import LossConfig, StepLoss

torch.set_num_threads(1)


@st.composite
def tries(draw, max_samples=6, max_len=14):
    """Samples that share prefixes: branches at any depth, copies, prefixes of one another, one-token runs;
    drawn as make_samples' arguments (seqs, prompt_lens, seed)."""
    tokens = st.integers(0, 2)
    seqs = []
    for _ in range(draw(st.integers(1, max_samples))):
        if seqs and draw(st.integers(0, 3)):
            base = draw(st.sampled_from(seqs))
            seq = base[: draw(st.integers(1, len(base)))] + draw(st.lists(tokens, max_size=max_len // 2))
        else:
            seq = draw(st.lists(tokens, min_size=2, max_size=max_len))
        seqs.append(seq if len(seq) >= 2 else seq + [1])
    prompt_lens = [draw(st.integers(1, len(s) - 1)) for s in seqs]
    return seqs, prompt_lens, draw(st.integers(0, 1000))


def flat_grads(model, samples, strategy, loss_fn):
    model.zero_grad(set_to_none=True)
    stats = strategy(model, samples, loss_fn, LossNormaliser.from_samples(samples))
    return torch.cat([p.grad.flatten() for p in model.parameters()]), stats


@pytest.fixture(scope="module")
def check_all_modes(rel_err):
    def check_all_modes(model, samples, make_loss, tol, replay=None):
        ref, ref_stats = flat_grads(model, samples, NaiveForwardBackward(100_000, 7), make_loss())
        replay, stats = flat_grads(model, samples, replay or ReplayForwardBackward(5), make_loss())
        packed, _ = flat_grads(model, samples, PackedForwardBackward(64, 5), make_loss())
        assert rel_err(replay, ref) <= tol, rel_err(replay, ref)
        assert rel_err(packed, ref) <= tol, rel_err(packed, ref)
        assert rel_err(packed, replay) <= tol
        for key in ("loss", "tokens", "clipped", "entropy"):
            assert float(stats[key]) == pytest.approx(float(ref_stats[key]), rel=1e-6, abs=1e-9), key
        return stats

    return check_all_modes


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trie=tries(), budget=st.sampled_from([None, 0]), batch_tokens=st.sampled_from([8192, 3]))
def test_grpo_float64_random_tries(arch, trie, budget, batch_tokens, cached_exact_model, make_samples,
                                   check_all_modes):
    """Budget 0 recomputes every inner segment; 3 tokens splits runs of sibling leaves."""
    samples = make_samples(*trie)
    model = cached_exact_model(arch)
    replay = ReplayForwardBackward(5, activation_budget_bytes=budget, max_batch_tokens=batch_tokens)
    check_all_modes(model, samples, lambda: StepLoss(samples, LossConfig(is_cap=50.0)), 1e-9, replay)


@pytest.mark.parametrize("arch,aggregation", [("llama", "sample_mean"), ("qwen2", "token_mean")])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trie=tries())
def test_ppo_off_policy_float64_random_tries(arch, aggregation, trie, cached_exact_model, make_samples,
                                             ppo_loss, check_all_modes):
    samples = make_samples(*trie)
    model = cached_exact_model(arch)
    check_all_modes(model, samples, lambda: ppo_loss(samples, model, aggregation), 1e-9)


@pytest.mark.parametrize("arch,extra", [("qwen3", {}), ("mistral", {"sliding_window": 4}),
                                        ("qwen2", {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1})])
def test_qk_norm_and_sliding_windows_float64(arch, extra, cached_exact_model, group_samples, ppo_loss,
                                             check_all_modes):
    model = cached_exact_model(arch, **extra)
    samples = group_samples(1)
    stats = check_all_modes(model, samples, lambda: ppo_loss(samples, model), 1e-9)
    assert 0 < float(stats["clipped"]) < float(stats["tokens"])  # the clip is active on some rows only


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_float32_within_1e5(arch, cached_exact_model, group_samples, ppo_loss, check_all_modes):
    model = cached_exact_model(arch, torch.float32)
    samples = group_samples(2, num=8, prompt_len=20)
    check_all_modes(model, samples, lambda: ppo_loss(samples, model), 1e-5)


def test_bfloat16_prefix_gradient_accumulates_in_float32(exact_model, group_samples, rel_err):
    model = exact_model("qwen2", torch.bfloat16)
    samples = group_samples(3)
    ref, _ = flat_grads(model, samples, NaiveForwardBackward(100_000, 7), StepLoss(samples, LossConfig()))
    replay, _ = flat_grads(model, samples, ReplayForwardBackward(5), StepLoss(samples, LossConfig()))
    assert rel_err(replay.double(), ref.double()) < 3e-2


def test_memory_budget_recomputes_with_the_same_gradient(cached_exact_model, group_samples, rel_err):
    model = cached_exact_model("llama")
    samples = group_samples(4)
    loss = lambda: StepLoss(samples, LossConfig(aggregation="sample_mean"))  # noqa: E731
    kept, kept_stats = flat_grads(model, samples, ReplayForwardBackward(5), loss())
    recomputed, stats = flat_grads(model, samples, ReplayForwardBackward(5, activation_budget_bytes=0), loss())
    assert float(kept_stats["recomputed_tokens"]) == 0 and float(stats["recomputed_tokens"]) > 0
    assert rel_err(recomputed, kept) <= 1e-12
    trie = build_trie(samples)
    assert float(stats["unique_tokens"]) == trie.num_unique_tokens
    assert float(stats["logical_tokens"]) == sum(s.num_tokens for s in samples)
    assert float(stats["saving"]) == pytest.approx(trie.num_logical_tokens / trie.num_unique_tokens)
    assert float(stats["padded_tokens"]) == trie.num_forward_tokens + float(stats["recomputed_tokens"])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dpo_pairs_sharing_their_prompt(arch, cached_exact_model, make_samples, naive_dpo_grads, rel_err,
                                        exact_vocab):
    model = cached_exact_model(arch)
    gen = torch.Generator().manual_seed(5)
    seqs, pairs = [], []
    for _ in range(3):
        prompt = torch.randint(0, exact_vocab, (6,), generator=gen).tolist()
        chosen, rejected = (prompt + torch.randint(0, exact_vocab, (n,), generator=gen).tolist() for n in (5, 3))
        pairs.append((len(seqs), len(seqs) + 1))
        seqs += [chosen, rejected]
    samples = make_samples(seqs, [6] * len(seqs))
    ref_S = -torch.rand(len(samples), generator=gen, dtype=torch.float64) * 10
    expected, expected_loss = naive_dpo_grads(model, samples, pairs, ref_S, 0.5)
    for strategy in (ReplayForwardBackward(5), PackedForwardBackward(64, 5)):
        loss_fn = dpo_loss.DPOLoss(pairs, ref_S, beta=0.5)
        got, stats = flat_grads(model, samples, strategy, loss_fn)
        assert rel_err(got, expected) <= 1e-9
        assert float(stats["loss_dpo"]) == pytest.approx(expected_loss, rel=1e-12)
        assert float(stats["pairs"]) == 3


@pytest.mark.parametrize("replay", ["replay", "packed", "auto", "layer_major"])
def test_learner_step_equals_naive_step(replay, cached_exact_model, group_samples, rel_err):
    base = cached_exact_model("qwen2")
    gen = torch.Generator().manual_seed(7)
    groups = []
    for g in range(2):
        samples = group_samples(10 + g)
        for s in samples:
            s.group_id = g
            s.reward = float(torch.rand((), generator=gen))
        groups.append(Group(group_id=g, samples=samples))
    params = {}
    for mode in ("naive", replay):
        model = copy.deepcopy(base)
        learner = Learner(model, TrainConfig(lr=1e-2, replay=mode, max_grad_norm=0.5, micro_batch_tokens=64))
        metrics = learner.step(groups)
        params[mode] = torch.cat([p.detach().flatten() for p in model.parameters()])
        before = torch.cat([p.detach().flatten() for p in base.parameters()])
    assert rel_err(params[replay] - before, params["naive"] - before) <= 1e-9
    assert metrics["trainer/strategy/saving"] > 1.0
    assert metrics["trainer/strategy/unique_tokens"] < metrics["trainer/strategy/logical_tokens"]


def test_auto_picks_packed_for_many_short_branches_and_replay_for_long_tails(cached_exact_model,
                                                                             make_samples, exact_vocab):
    model = cached_exact_model("llama")
    gen = torch.Generator().manual_seed(0)
    bushy = []  # a tree-sampled group: forks every two tokens
    frontier = [[1, 2, 3]]
    for _ in range(5):
        frontier = [f + torch.randint(0, exact_vocab, (2,), generator=gen).tolist() for f in frontier for _ in range(2)]
    bushy = make_samples(frontier, [3] * len(frontier))
    prompt = torch.randint(0, exact_vocab, (2000,), generator=gen).tolist()
    tails = make_samples([prompt + torch.randint(0, exact_vocab, (300,), generator=gen).tolist() for _ in range(8)],
                         [2000] * 8)
    assert choose_mode(model, build_trie(bushy), max_tokens=4096, budget_bytes=1 << 30) == "packed"
    assert choose_mode(model, build_trie(tails), max_tokens=4096, budget_bytes=1 << 30) == "replay"
    assert choose_mode(model, build_trie(bushy), max_tokens=4096, budget_bytes=0) == "replay"
    auto = AutoForwardBackward(ReplayForwardBackward(5), PackedForwardBackward(4096, 5))
    _, stats = flat_grads(model, bushy, auto, StepLoss(bushy, LossConfig()))
    assert float(stats["packed_calls"]) == 1.0


def test_unsupported_architectures_are_named(group_samples, exact_model, exact_vocab):
    from transformers import GPT2Config, MambaConfig

    samples = group_samples(0)
    loss = StepLoss(samples, LossConfig())
    norm = LossNormaliser.from_samples(samples)
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=exact_vocab,
                                                       bos_token_id=0, eos_token_id=0))
    mamba = AutoModelForCausalLM.from_config(MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=exact_vocab))
    hybrid = exact_model("qwen2", torch.float32)
    hybrid.config.layer_types = ["full_attention", "linear_attention"]
    for model, match in ((gpt2, "gpt2"), (mamba, "mamba"), (hybrid, "linear_attention")):
        for strategy in (ReplayForwardBackward(), PackedForwardBackward()):
            with pytest.raises(ValueError, match=match) as info:
                strategy(model, samples, loss, norm)
            assert "Llama, Mistral, Qwen2 and Qwen3" in str(info.value)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.bfloat16, 3e-2)])
def test_flash_paths_attention_matches_masked_sdpa(dtype, tol):
    """The CPU flash path (split prefix/own parts, merged by log-sum-exp, custom backward) against one
    masked SDPA per segment, with an external prefix and in-call ancestors, siblings sharing a run."""
    from tailrace.engine.replay.attention import SegmentRows, paths_attention, paths_attention_sdpa

    gen = torch.Generator().manual_seed(0)
    # Rows: root [0, 5), child A [5, 8) with leaves A1 [8, 10), A2 [10, 11); child B [11, 15).
    segments = [SegmentRows(0, 5, (), 3, True), SegmentRows(5, 8, ((0, 5),), 8, True),
                SegmentRows(8, 10, ((0, 5), (5, 8)), 11, True), SegmentRows(10, 11, ((0, 5), (5, 8)), 11, True),
                SegmentRows(11, 15, ((0, 5),), 8, True)]
    q = torch.randn(4, 15, 8, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 15, 8, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for _ in range(2))
    ext = [torch.randn(2, n, 8, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() for n in (2, 1, 2, 1)]
    grad = torch.randn(4, 15, 8, generator=gen, dtype=torch.float64).to(dtype)
    results = []
    for attend in (paths_attention, paths_attention_sdpa):
        kwargs = {"window": None} if attend is paths_attention_sdpa else {}
        out = attend(q, k, v, segments, scale=0.3, external=(ext[:2], ext[2:]), **kwargs)
        results.append([out, *torch.autograd.grad(out, [q, k, v, *ext], grad)])
    for got, want in zip(*results, strict=True):
        got, want = got.detach().double(), want.detach().double()
        assert float((got - want).norm() / want.norm()) <= tol


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.bfloat16, 3e-2)])
def test_cpu_tree_attention_mixes_dense_and_path_subtrees_exactly(dtype, tol):
    """A packed call on the CPU: root subtrees of many short branches run as one masked dense call,
    a long one segment by segment (tree_attention_cpu's plan holds both kinds); output and gradients equal
    one masked SDPA per segment, the reference of the paths test above."""
    from tailrace.engine.replay.attention import SegmentRows, paths_attention_sdpa, tree_attention_cpu

    gen = torch.Generator().manual_seed(1)
    segments, subtree_end, n = [], [], 0
    for prompt_len, tails in ((3, (1, 2, 1, 3)), (4, (40,) * 6), (2, (2, 1)), (4, ())):
        root = (n, n + prompt_len)
        segments.append(SegmentRows(n, n + prompt_len, (), 0))
        subtree_end += [n + prompt_len + sum(tails)] * prompt_len
        n += prompt_len
        for t in tails:
            segments.append(SegmentRows(n, n + t, (root,), prompt_len))
            subtree_end += [n + t] * t
            n += t
    heads, head_dim = 8, 64  # wide enough that the long subtree's dense square costs more than its paths
    q = torch.randn(heads, n, head_dim, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    k, v = (torch.randn(2, n, head_dim, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
            for _ in range(2))
    grad = torch.randn(heads, n, head_dim, generator=gen, dtype=torch.float64).to(dtype)
    masks: dict = {}
    got = tree_attention_cpu(q, k, v, segments, torch.tensor(subtree_end), scale=0.2, masks=masks)
    kinds = [isinstance(how, torch.Tensor) for _, _, how in masks["cpu_plan"]]
    assert kinds == [True, False, True, False], kinds  # dense, paths, dense, a lone prompt (paths)
    want = paths_attention_sdpa(q, k, v, segments, scale=0.2, window=None, external=((), ()))
    for a, b in zip([got, *torch.autograd.grad(got, [q, k, v], grad)],
                    [want, *torch.autograd.grad(want, [q, k, v], grad)], strict=True):
        a, b = a.detach().double(), b.detach().double()
        assert float((a - b).norm() / b.norm()) <= tol


def test_train_config_accepts_the_replay_modes():
    from tailrace.engine.config import TrainConfig

    for mode in ("auto", "naive", "replay", "packed", "layer_major"):
        assert TrainConfig(replay=mode).replay == mode
    with pytest.raises(ValueError, match="train.replay"):
        TrainConfig(replay="tree")


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trie=tries(max_samples=9, max_len=24), arch=st.sampled_from(["llama", "qwen2", "qwen3", "mistral"]),
       budget=st.sampled_from([None, 0]), loss=st.sampled_from(["grpo", "ppo"]))
def test_many_random_tries_all_families_float64(trie, arch, budget, loss, cached_exact_model, make_samples,
                                                ppo_loss, check_all_modes):
    samples = make_samples(*trie)
    model = cached_exact_model(arch, **({"sliding_window": 5} if arch == "mistral" else {}))
    make = (lambda: ppo_loss(samples, model)) if loss == "ppo" else (lambda: StepLoss(samples, LossConfig()))
    check_all_modes(model, samples, make, 1e-9, ReplayForwardBackward(5, activation_budget_bytes=budget))
