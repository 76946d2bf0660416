"""Loss math against hand computations on tiny tensors; GRPO advantages."""

import math

import pytest
import torch

from tailrace.engine.core.losses import LossNormaliser, add_stats
from tailrace.engine.core.samples import Group, TrainSample
from tailrace.engine.trainer.loss import (
    LossConfig,
    StepLoss,
    assign_advantages,
    finalize_metrics,
    group_advantages,
    policy_loss,
)

torch.set_num_threads(1)
F64 = torch.float64


def _t(values):
    return torch.tensor(values, dtype=F64)


def test_clip_active_and_inactive_with_is_truncation():
    # ratios 1.25, 0.75, 0.7, 1.3 against the proximal policy; advantages +, +, -, -.
    prox = torch.log(_t([0.4, 0.4, 0.5, 0.5]))
    logp = (prox + torch.log(_t([1.25, 0.75, 0.7, 1.3]))).requires_grad_()
    # proximal/behaviour = 2, 0.5, 10 (truncated at 5), 1.
    behaviour = prox - torch.log(_t([2.0, 0.5, 10.0, 1.0]))
    adv = _t([1.0, 1.0, -1.0, -1.0])
    weights = torch.full((4,), 0.25, dtype=F64)
    cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.2, is_cap=5.0)

    loss, stats = policy_loss(logp, behaviour, adv, weights, cfg, prox_logp_N=prox)
    loss.backward()

    # Token by token: -w * min(r A, clip(r) A):
    #   1: A>0, r=1.25 > 1.2 -> clipped, -2 * 1.2 = -2.4, no gradient
    #   2: A>0, r=0.75 -> unclipped, -0.5 * 0.75 = -0.375, d/dlogp = -0.5 * 0.75
    #   3: A<0, r=0.7 < 0.8 -> clipped, -5 * (-0.8) = 4.0, no gradient
    #   4: A<0, r=1.3 -> unclipped (min picks -1.3), -1 * (-1.3) = 1.3, d/dlogp = +1.3
    assert loss.item() == pytest.approx(0.25 * (-2.4 - 0.375 + 4.0 + 1.3), abs=1e-12)
    expected_grad = 0.25 * _t([0.0, -0.5 * 0.75, 0.0, 1.3])
    torch.testing.assert_close(logp.grad, expected_grad, rtol=0, atol=1e-12)
    metrics = finalize_metrics(stats)
    assert metrics["trainer/policy/clip_frac"] == 0.5
    assert metrics["trainer/policy/is_truncated_frac"] == 0.25
    assert metrics["trainer/policy/is_weight_mean"] == pytest.approx((2 + 0.5 + 5 + 1) / 4)
    assert metrics["trainer/loss/pg"] == pytest.approx(loss.item())


def test_default_proximal_is_current_policy_before_update():
    logp = torch.log(_t([0.2, 0.9, 0.5])).requires_grad_()
    behaviour = logp.detach() - torch.log(_t([1.5, 1.0, 0.25]))  # w = 1.5, 1, 0.25
    adv = _t([2.0, -1.0, 0.5])
    weights = _t([0.1, 0.2, 0.3])
    loss, stats = policy_loss(logp, behaviour, adv, weights, LossConfig(clip_eps_low=0.1, clip_eps_high=0.1))
    loss.backward()
    # r = 1 in value: never clipped, loss = -sum(weight * w * A), gradient = -weight * w * A.
    w = _t([1.5, 1.0, 0.25])
    assert loss.item() == pytest.approx(float(-(weights * w * adv).sum()), abs=1e-12)
    torch.testing.assert_close(logp.grad, -(weights * w * adv), rtol=0, atol=1e-12)
    assert float(stats["clipped"]) == 0.0


def test_asymmetric_clip_higher():
    prox = torch.zeros(2, dtype=F64)
    logp = torch.log(_t([1.25, 1.25])).requires_grad_()
    adv = _t([1.0, 1.0])
    loss, stats = policy_loss(logp, prox, adv, _t([1.0, 1.0]), LossConfig(clip_eps_low=0.2, clip_eps_high=0.28),
                              prox_logp_N=prox)
    loss.backward()
    assert float(stats["clipped"]) == 0.0  # 1.25 < 1.28
    torch.testing.assert_close(logp.grad, _t([-1.25, -1.25]), rtol=0, atol=1e-12)


def test_kl_k3_to_reference():
    logp = torch.log(_t([0.5, 0.25])).requires_grad_()
    ref = torch.log(_t([0.25, 0.5]))
    weights = _t([0.5, 0.5])
    cfg = LossConfig(kl_coef=0.1)
    loss, stats = policy_loss(logp, logp.detach(), torch.zeros(2, dtype=F64), weights, cfg, ref_logp_N=ref)
    loss.backward()
    # k3 = exp(ref - logp) - (ref - logp) - 1 with ref - logp = -log 2 and +log 2.
    k3 = _t([0.5 + math.log(2) - 1, 2 - math.log(2) - 1])
    assert loss.item() == pytest.approx(0.1 * float((weights * k3).sum()), abs=1e-12)
    # d k3 / d logp = 1 - exp(ref - logp)
    torch.testing.assert_close(logp.grad, 0.1 * weights * _t([1 - 0.5, 1 - 2.0]), rtol=0, atol=1e-12)
    assert finalize_metrics(stats)["trainer/policy/kl_ref"] == pytest.approx(float(k3.mean()))
    with pytest.raises(ValueError, match="reference"):
        policy_loss(logp, logp.detach(), torch.zeros(2, dtype=F64), weights, cfg)


def _sample(i, completion_len, advantage, reward=0.0):
    return TrainSample(group_id=0, sample_id=i, prompt_ids=[1, 2], completion_ids=list(range(completion_len)),
                       behaviour_logprobs=[-1.0] * completion_len, policy_versions=[0] * completion_len,
                       reward=reward, advantage=advantage)


def test_token_mean_and_sample_mean_normalisation():
    samples = [_sample(0, 1, 1.0), _sample(1, 3, -1.0)]
    sample_idx, pos = torch.tensor([0, 1, 1, 1]), torch.tensor([0, 0, 1, 2])
    logp = torch.full((4,), -1.0, dtype=F64, requires_grad=True)  # on-policy: w = 1, r = 1
    norm = LossNormaliser.from_samples(samples)
    assert (norm.num_tokens, norm.num_samples) == (4, 2)

    loss_tok, _ = StepLoss(samples, LossConfig(aggregation="token_mean"))(logp, sample_idx, pos, norm)
    # -(1/4) * (1 - 1 - 1 - 1)
    assert loss_tok.item() == pytest.approx(0.5, abs=1e-12)
    loss_smp, _ = StepLoss(samples, LossConfig(aggregation="sample_mean"))(logp, sample_idx, pos, norm)
    # -(1/2) * (mean over sample 0 of +1 + mean over sample 1 of -1) = 0
    assert loss_smp.item() == pytest.approx(0.0, abs=1e-12)
    loss_smp.backward()
    torch.testing.assert_close(logp.grad, _t([-0.5, 1 / 6, 1 / 6, 1 / 6]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("aggregation", ["token_mean", "sample_mean"])
def test_step_loss_is_additive_over_any_partition_of_rows(aggregation):
    gen = torch.Generator().manual_seed(0)
    samples = [_sample(i, n, float(a)) for i, (n, a) in enumerate([(3, 1.0), (1, -0.5), (4, 2.0)])]
    for s in samples:
        s.behaviour_logprobs = -torch.rand(s.num_completion_tokens, generator=gen)
    sample_idx = torch.cat([torch.full((s.num_completion_tokens,), i) for i, s in enumerate(samples)])
    pos = torch.cat([torch.arange(s.num_completion_tokens) for s in samples])
    logp = -torch.rand(sample_idx.numel(), generator=gen, dtype=F64)
    prox = [s.behaviour_logprobs.double() + 0.3 * torch.randn(s.num_completion_tokens, generator=gen, dtype=F64)
            for s in samples]
    step_loss = StepLoss(samples, LossConfig(aggregation=aggregation, is_cap=1.5), prox_logprobs=prox)
    norm = LossNormaliser.from_samples(samples)

    whole, whole_stats = step_loss(logp, sample_idx, pos, norm)
    perm = torch.randperm(logp.numel(), generator=gen)
    total, stats = 0.0, {}
    for part in (perm[:3], perm[3:4], perm[4:]):
        loss, part_stats = step_loss(logp[part], sample_idx[part], pos[part], norm)
        total = total + loss
        add_stats(stats, part_stats)
    assert total.item() == pytest.approx(whole.item(), rel=1e-12, abs=1e-15)
    for key, value in whole_stats.items():
        assert float(stats[key]) == pytest.approx(float(value), rel=1e-12, abs=1e-15), key


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], scale=True, eps=1e-6)
    torch.testing.assert_close(adv, _t([1, -1, -1, 1]) * 0.5 / (0.5 + 1e-6), rtol=0, atol=1e-15)
    torch.testing.assert_close(group_advantages([1.0, 0.0, 0.0, 1.0], scale=False), _t([0.5, -0.5, -0.5, 0.5]))
    torch.testing.assert_close(group_advantages([3.0, 1.0], scale=False), _t([1.0, -1.0]))
    # Identical rewards: exactly zero, even where the float mean is not exactly the common value.
    assert torch.equal(group_advantages([0.1, 0.1, 0.1]), torch.zeros(3, dtype=F64))
    assert torch.equal(group_advantages([7.0]), torch.zeros(1, dtype=F64))
    with pytest.raises(ValueError, match="non-finite"):
        group_advantages([1.0, float("nan")])
    with pytest.raises(ValueError, match="empty"):
        group_advantages([])


def test_assign_advantages_per_group():
    g1 = Group(group_id=0, samples=[_sample(0, 1, 0.0, reward=1.0), _sample(1, 1, 0.0, reward=0.0)])
    g2 = Group(group_id=0, samples=[_sample(2, 1, 9.0, reward=0.5)])
    assign_advantages([g1, g2], LossConfig(scale_advantages=False))
    assert [s.advantage for s in g1.samples] == [0.5, -0.5]
    assert g2.samples[0].advantage == 0.0


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="aggregation"):
        LossConfig(aggregation="mean")
    with pytest.raises(ValueError, match="is_cap"):
        LossConfig(is_cap=0.5)
    with pytest.raises(ValueError, match="clip_eps_low"):
        LossConfig(clip_eps_low=1.0)
