"""Learner: chunked log-probs, micro-batching exactness, a step that learns, schedules, snapshots, dist helpers."""

import copy
import math

import pytest
import torch

from tailrace.engine.config import TrainConfig
from tailrace.engine.core.losses import LossNormaliser
from tailrace.engine.trainer import dist
from tailrace.engine.trainer.learner import (
    Learner,
    LRSchedule,
    NaiveForwardBackward,
    plan_micro_batches,
    sample_logprobs,
)
from tailrace.engine.trainer.loss import LossConfig, StepLoss, assign_advantages, policy_loss
from tailrace.kernels.logprobs import chunked_logprobs

torch.set_num_threads(1)
VOCAB = 64


def test_chunked_logprobs_match_full_log_softmax():
    gen = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(8, VOCAB, bias=False).double()
    hidden = torch.randn(11, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, VOCAB, (11,), generator=gen)
    temp = torch.rand(11, generator=gen, dtype=torch.float64) + 0.5
    # what forward_logprobs calls with a model's LM head
    logp, entropy = chunked_logprobs(hidden, head.weight, labels, temperature=temp, chunk_size=4,
                                     return_entropy=True)
    logp.sum().backward()
    grads = (hidden.grad.clone(), head.weight.grad.clone())
    hidden.grad, head.weight.grad = None, None

    full = torch.log_softmax(head(hidden) / temp[:, None], dim=-1)
    ref = full.gather(-1, labels[:, None]).squeeze(-1)
    ref.sum().backward()
    torch.testing.assert_close(logp, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1).detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[0], hidden.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grads[1], head.weight.grad, rtol=1e-12, atol=1e-12)


def test_plan_micro_batches_respects_budget():
    lengths = [5, 12, 3, 3, 8, 20]
    batches = plan_micro_batches(lengths, 16)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 16
    assert [5] in batches  # 20 > budget: alone


def _reference_grads(model, samples, cfg):
    """Per-sample plain HF forward with full [T, V] logits: the definition the strategy must match."""
    norm = LossNormaliser.from_samples(samples)
    model.zero_grad(set_to_none=True)
    for s in samples:
        ids = torch.cat([s.prompt_ids, s.completion_ids])[None]
        logits = model(input_ids=ids).logits[0, s.num_prompt_tokens - 1 : -1] / s.temperature
        logp = torch.log_softmax(logits, -1).gather(-1, s.completion_ids[:, None]).squeeze(-1)
        lengths = torch.full((s.num_completion_tokens,), s.num_completion_tokens)
        loss, _ = policy_loss(logp, s.behaviour_logprobs, torch.full_like(logp, s.advantage),
                              norm.token_weights(lengths, cfg.aggregation), cfg)
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch,aggregation", [("qwen2", "token_mean"), ("llama", "sample_mean")])
def test_micro_batching_gives_the_same_gradient(arch, aggregation, learner_model, learner_groups):
    model = learner_model(arch, torch.float64)
    model.train()
    samples = [s for g in learner_groups(2, num_groups=2, group_size=3) for s in g.samples]
    cfg = LossConfig(aggregation=aggregation, is_cap=50.0)
    assign_advantages(learner_groups(2, num_groups=2, group_size=3), cfg)  # same rewards -> same advantages
    for i, s in enumerate(samples):
        s.advantage = [0.7, -1.2, 0.4][i % 3] * (1 + i)
    expected = _reference_grads(model, samples, cfg)
    norm = LossNormaliser.from_samples(samples)
    for budget in (10_000, 24, 1):
        model.zero_grad(set_to_none=True)
        NaiveForwardBackward(budget, logprob_chunk_tokens=5)(model, samples, StepLoss(samples, cfg), norm)
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, expected[name], rtol=1e-10, atol=1e-13, msg=f"{name} {budget}")


def _surrogate(model, samples):
    """sum A * logp / tokens: what the policy gradient pushes up."""
    logps = sample_logprobs(model, samples, micro_batch_tokens=256, chunk_rows=64)
    total = sum(s.advantage * float(lp.sum()) for s, lp in zip(samples, logps, strict=True))
    return total / sum(s.num_completion_tokens for s in samples)


def test_step_improves_the_objective_on_a_fixed_batch(learner_model, learner_groups):
    model = learner_model()
    groups = learner_groups(3, num_groups=3, group_size=4)
    samples = [s for g in groups for s in g.samples]
    # On-policy data: behaviour log-probs from the model itself, so w = 1 at the first step.
    for s, lp in zip(samples, sample_logprobs(model, samples, micro_batch_tokens=256, chunk_rows=64), strict=True):
        s.behaviour_logprobs = lp
    learner = Learner(model, TrainConfig(lr=3e-3, micro_batch_tokens=40, replay="naive"))
    assign_advantages(groups, learner.loss)
    before = _surrogate(model, samples)
    metrics = {}
    for _ in range(3):
        metrics = learner.step(groups)
    assert _surrogate(model, samples) > before + 0.05
    for key in ("trainer/loss/pg", "trainer/grad/norm", "trainer/lr", "trainer/tokens/logical",
                "trainer/policy/clip_frac", "trainer/policy/entropy", "trainer/staleness/max"):
        assert math.isfinite(metrics[key]), key
    assert metrics["trainer/tokens/logical"] == sum(s.num_tokens for s in samples)
    assert metrics["trainer/lr"] == 3e-3
    assert learner.policy_version == 3 and learner.step_count == 3
    assert metrics["trainer/staleness/max"] == 2.0  # samples of version 0 trained at version 2


def test_kl_to_reference_and_validation(learner_model, learner_groups):
    model = learner_model()
    with pytest.raises(ValueError, match="train.kl_coef"):
        Learner(model, TrainConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="train.replay"):
        TrainConfig(replay="nope")
    learner = Learner(model, TrainConfig(lr=1e-2, kl_coef=0.5, replay="naive"), ref_model=copy.deepcopy(model))
    groups = learner_groups(4)
    first = learner.step(groups)
    assert first["trainer/policy/kl_ref"] == pytest.approx(0.0, abs=1e-12)
    second = learner.step(groups)
    assert second["trainer/policy/kl_ref"] > 0.0 and second["trainer/loss/kl"] > 0.0


def test_non_finite_gradient_skips_the_update(learner_model, learner_groups):
    model = learner_model()

    def poisoned(model, samples, loss_fn, normaliser):
        for p in model.parameters():
            p.grad = torch.full_like(p, float("nan"))
        return {}

    learner = Learner(model, TrainConfig(lr=1e-2, replay="naive"), forward_backward=poisoned)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    metrics = learner.step(learner_groups(5))
    assert metrics["trainer/grad/skipped"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert learner.policy_version == 1


def test_broadcast_snapshot_is_a_frozen_copy(learner_model, learner_groups):
    model = learner_model()  # Qwen2 config ties embedding and LM head
    learner = Learner(model, TrainConfig(lr=1e-2, replay="naive"))
    snapshot = learner.state_dict_for_broadcast()
    frozen = {k: v.clone() for k, v in snapshot.items()}
    learner.step(learner_groups(6))
    assert all(torch.equal(frozen[k], snapshot[k]) for k in snapshot)
    assert not torch.equal(snapshot["model.norm.weight"], model.model.norm.weight.detach())
    assert snapshot["lm_head.weight"] is snapshot["model.embed_tokens.weight"]
    assert all(t.device.type == "cpu" for t in snapshot.values())


def test_lr_schedules(learner_model, learner_groups):
    warm_cos = LRSchedule("cosine", warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    assert [warm_cos(s) for s in range(2)] == [0.5, 1.0]
    assert warm_cos(2) == 1.0 and warm_cos(4) == pytest.approx(0.55) and warm_cos(6) == pytest.approx(0.1)
    assert warm_cos(100) == pytest.approx(0.1)
    linear = LRSchedule("linear", warmup_steps=0, total_steps=4, min_lr_ratio=0.0)
    assert [linear(s) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert LRSchedule("constant", 0, 0, 0.0)(10) == 1.0
    with pytest.raises(ValueError, match="train.steps: cosine decay needs train.steps > train.warmup_steps"):
        TrainConfig(lr_schedule="cosine", warmup_steps=5, steps=5)
    learner = Learner(learner_model(), TrainConfig(lr=1e-3, lr_schedule="linear", steps=4, replay="naive"))
    lrs = [learner.step(learner_groups(7, num_groups=1))["trainer/lr"] for _ in range(3)]
    assert lrs == pytest.approx([1e-3, 7.5e-4, 5e-4])


def test_the_learner_takes_every_setting_from_the_train_section(learner_model, learner_groups):
    """TrainConfig is the learner's one source: each optimizer, schedule, loss and strategy setting set to
    a value other than its default reaches what the learner built."""
    train = TrainConfig(lr=2e-3, betas=(0.8, 0.95), adam_eps=1e-6, weight_decay=0.05, lr_schedule="cosine",
                        warmup_steps=1, steps=3, min_lr_ratio=0.25, clip_eps_low=0.1, clip_eps_high=0.3, is_cap=3.0,
                        loss_agg="sample_mean", adv_norm_std=False, micro_batch_tokens=48, logprob_chunk_tokens=5,
                        log_entropy=False, replay="naive", seed=11)
    torch.manual_seed(0)
    learner = Learner(learner_model(), train)
    assert torch.initial_seed() == 11
    decay, no_decay = learner.optimizer.param_groups
    assert (decay["betas"], decay["eps"], decay["weight_decay"], no_decay["weight_decay"]) == ((0.8, 0.95), 1e-6, 0.05, 0.0)
    assert learner.loss == LossConfig(clip_eps_low=0.1, clip_eps_high=0.3, is_cap=3.0, aggregation="sample_mean",
                                      scale_advantages=False)
    strategy = learner.forward_backward
    assert (strategy.micro_batch_tokens, strategy.logprob_chunk_tokens, strategy.log_entropy) == (48, 5, False)
    metrics = [learner.step(learner_groups(8, num_groups=1)) for _ in range(3)]
    assert [m["trainer/lr"] for m in metrics] == pytest.approx([2e-3, 2e-3, 2e-3 * (0.25 + 0.75 * 0.5)])
    assert not any("entropy" in key for key in metrics[0])


def test_dist_helpers_at_world_size_one():
    info = dist.init_from_env()
    assert (info.rank, info.world_size) == (0, 1) and dist.is_rank0() and not dist.is_initialized()
    t = torch.ones(3)
    assert dist.all_reduce_sum_(t) is t and torch.equal(t, torch.ones(3))
    stats = {"a": torch.tensor(2.0)}
    assert dist.all_reduce_stats_(stats) is stats
    items = list(range(7))
    assert dist.shard(items, lambda i: i, 0, 1) == items
    # Balanced by cost, deterministic, a partition in original order.
    shards = [dist.shard(items, lambda i: i + 1, r, 3) for r in range(3)]
    assert sorted(i for s in shards for i in s) == items
    assert all(s == sorted(s) for s in shards)
    loads = [sum(i + 1 for i in s) for s in shards]
    assert max(loads) - min(loads) <= 2
