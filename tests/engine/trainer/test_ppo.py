"""PPO epochs and mini-batches (engine/trainer/ppo.py): one step of ppo_epochs x minibatches updates equals a
naive per-sample implementation of the same algorithm (float64) under naive and branch-replay strategies;
the clip acts against the start-of-step policy in later epochs and never with one pass; one step is one
policy version and every sample counts once; settings are validated.
Run: pytest tests/engine/trainer/test_ppo.py
"""

import copy

import numpy as np
import pytest
import torch

from tailrace.engine.config import TrainConfig, load_config
from tailrace.engine.core.losses import LossNormaliser
from tailrace.engine.trainer import ppo
from tailrace.engine.trainer.learner import Learner
from tailrace.engine.trainer.loss import group_advantages, loss_config, policy_loss


def _full_logprobs(model, s):
    """The definition: one plain HF forward of the sample, full [T, V] log-softmax."""
    ids = torch.cat([s.prompt_ids, s.completion_ids])[None]
    logits = model(input_ids=ids).logits[0, s.num_prompt_tokens - 1: -1] / s.temperature
    return torch.log_softmax(logits, -1).gather(-1, s.completion_ids[:, None]).squeeze(-1)


def naive_ppo_step(model, groups, *, lr, epochs, minibatches, max_grad_norm, weight_decay, loss):
    """The algorithm written out sample by sample: GRPO advantages per whole group; groups in consecutive
    parts; proximal log-probs of the policy before the step; per epoch and part: the part's token-mean
    PPO-clip loss with the truncated behaviour->proximal weight, clip, AdamW."""
    for g in groups:
        for s, a in zip(g.samples, group_advantages(g.rewards).tolist(), strict=True):
            s.advantage = a
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.999), eps=1e-8)
    with torch.no_grad():
        prox = {id(s): _full_logprobs(model, s) for g in groups for s in g.samples}
    parts = [[groups[i] for i in idx] for idx in np.array_split(np.arange(len(groups)), minibatches)]
    for _ in range(epochs):
        for part in parts:
            samples = [s for g in part for s in g.samples]
            norm = LossNormaliser.from_samples(samples)
            opt.zero_grad(set_to_none=True)
            for s in samples:
                logp = _full_logprobs(model, s)
                weights = norm.token_weights(torch.full_like(s.completion_ids, s.num_completion_tokens), "token_mean")
                out, _ = policy_loss(logp, s.behaviour_logprobs, torch.full_like(logp, s.advantage), weights, loss,
                                     prox_logp_N=prox[id(s)])
                out.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_grad_norm)
            opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("replay", ["naive", "replay"])
def test_epochs_and_minibatches_equal_the_naive_algorithm_float64(replay, exact_model, rel_err, ppo_clip,
                                                                  ppo_groups):
    base = exact_model("qwen2")
    loss = loss_config(TrainConfig(**ppo_clip))  # what the learner makes of the settings, for the reference
    kwargs = dict(lr=3e-2, epochs=2, minibatches=2, max_grad_norm=1.0, weight_decay=0.01, loss=loss)
    expected = naive_ppo_step(copy.deepcopy(base), ppo_groups(), **kwargs)
    model = copy.deepcopy(base)
    learner = Learner(model, TrainConfig(lr=3e-2, replay=replay, ppo_epochs=2, minibatches=2, max_grad_norm=1.0,
                                         weight_decay=0.01, betas=(0.9, 0.999), micro_batch_tokens=64,
                                         logprob_chunk_tokens=5, **ppo_clip))
    metrics = learner.step(ppo_groups())
    got = torch.cat([p.detach().flatten() for p in model.parameters()])
    before = torch.cat([p.detach().flatten() for p in base.parameters()])
    assert rel_err(got - before, expected - before) <= 1e-9, rel_err(got - before, expected - before)
    # The test exercises what it claims: the clip and the truncated weight act, four updates ran.
    assert metrics["trainer/ppo/epoch2/clip_frac"] > 0.0
    assert metrics["trainer/policy/is_truncated_frac"] > 0.0
    assert metrics["trainer/ppo/updates"] == 4.0 and metrics["trainer/ppo/minibatches"] == 2.0


def test_clip_acts_in_epoch_two_and_never_with_one_pass(exact_model, ppo_groups, ppo_clip):
    base = exact_model("llama")
    one = Learner(copy.deepcopy(base), TrainConfig(lr=5e-2, replay="replay", **ppo_clip)).step(ppo_groups())
    assert one["trainer/policy/clip_frac"] == 0.0
    assert one["trainer/policy/ratio_mean"] == 1.0 and one["trainer/policy/ratio_std"] == 0.0
    assert not any(k.startswith("trainer/ppo/epoch") for k in one)

    learner = Learner(copy.deepcopy(base), TrainConfig(lr=5e-2, replay="replay", ppo_epochs=2, **ppo_clip))

    def no_extra_forward(samples):
        raise AssertionError("one part: the proximal log-probs are recorded in epoch 1, no extra forward")

    learner._policy_logprobs = no_extra_forward
    two = learner.step(ppo_groups())
    # Epoch 1 runs the start-of-step policy itself: ratio exactly 1.
    assert two["trainer/ppo/epoch1/clip_frac"] == 0.0
    assert two["trainer/ppo/epoch1/ratio_mean"] == 1.0 and two["trainer/ppo/epoch1/ratio_std"] == 0.0
    assert two["trainer/ppo/epoch2/clip_frac"] > 0.0
    assert two["trainer/ppo/epoch2/ratio_std"] > 1e-3
    assert two["trainer/policy/clip_frac"] == pytest.approx(two["trainer/ppo/epoch2/clip_frac"] / 2)


def test_a_step_is_one_version_and_counts_each_sample_once(ppo_groups, exact_model, ppo_clip):
    groups = ppo_groups()
    samples = [s for g in groups for s in g.samples]
    learner = Learner(exact_model("llama"), TrainConfig(lr=1e-3, replay="packed", ppo_epochs=3, minibatches=2,
                                                        **ppo_clip))
    once = Learner(exact_model("llama"), TrainConfig(lr=1e-3, replay="packed", **ppo_clip)).step(ppo_groups())
    metrics = learner.step(groups)
    assert (learner.step_count, learner.policy_version) == (1, 1)
    assert metrics["trainer/policy_version"] == 1.0 and metrics["trainer/ppo/updates"] == 6.0
    assert learner.scheduler.last_epoch == 1  # the LR schedule moves once per step
    assert all(float(state["step"]) == 6.0 for state in learner.optimizer.state.values())  # six AdamW updates
    assert metrics["trainer/samples"] == len(samples)
    assert metrics["trainer/tokens/loss"] == sum(s.num_completion_tokens for s in samples)
    # Strategy counts are one pass over the data, as with a single update.
    for key in ("trainer/tokens/padded", "trainer/strategy/logical_tokens", "trainer/strategy/unique_tokens",
                "trainer/strategy/saving"):
        assert metrics[key] == once[key], key


def test_split_keeps_groups_whole_and_in_order():
    assert ppo.split_minibatches([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert ppo.split_minibatches([1, 2], 4) == [[1], [2]]  # a smaller last batch: one group per part
    assert ppo.split_minibatches([1, 2, 3], 1) == [[1, 2, 3]]


def test_settings_are_validated():
    with pytest.raises(ValueError, match="train.minibatches"):
        TrainConfig(groups_per_step=2, minibatches=3)
    with pytest.raises(ValueError, match="train.ppo_epochs"):
        TrainConfig(ppo_epochs=0)
    with pytest.raises(ValueError, match="train.ppo_epochs: dpo"):
        TrainConfig(algorithm="dpo", replay="replay", ppo_epochs=2)
    with pytest.raises(ValueError, match="renamed: set train.gradient_checkpointing"):
        load_config(overrides=["--train.fsdp.activation_checkpointing", "true"])


def test_dpo_learner_rejects_several_updates(exact_model):
    from tailrace.engine.trainer.dpo_loop import DPOLearner

    with pytest.raises(ValueError, match="ppo_epochs"):
        DPOLearner(exact_model("llama"), TrainConfig(replay="replay", ppo_epochs=2))
