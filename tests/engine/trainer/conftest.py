"""Fixtures shared by the trainer's tests (the float64 gradient fixtures are in tests/engine/conftest.py).

learner_model(arch="qwen2", dtype=float32, seed=0): vocabulary 64, a tied LM head for qwen2 and an untied
one for llama, so both kinds are covered; learner_groups(seed, ...): groups of random samples for it.
tied_model(seed, dropout=0.0): the checkpoint tests' tied Qwen2 (attention dropout, when set, makes every
step consume the torch RNG); checkpoint_batches(num_steps, seed=0): a step's two groups per batch.
ppo_groups(num_groups=3) and ppo_clip: shared-prefix groups for exact_model and the clip settings the PPO
tests step with (train.* fields: TrainConfig(**ppo_clip); loss_config of that is the LossConfig they make).
"""

import pytest
import torch

from tailrace.engine.core.samples import Group, TrainSample

VOCAB = 64  # learner_model's and tied_model's vocabulary


@pytest.fixture(scope="session")
def learner_model(tiny_lm):
    def learner_model(arch="qwen2", dtype=torch.float32, seed=0):
        return tiny_lm(arch, seed=seed, dtype=dtype, tie_word_embeddings=arch == "qwen2")

    return learner_model


@pytest.fixture(scope="session")
def learner_groups():
    def learner_groups(seed, num_groups=2, group_size=3, prompt_len=(2, 7), completion_len=(1, 9)):
        gen = torch.Generator().manual_seed(seed)

        def rint(lo, hi):
            return int(torch.randint(lo, hi, (), generator=gen))

        groups = []
        for g in range(num_groups):
            prompt = torch.randint(0, VOCAB, (rint(*prompt_len),), generator=gen)
            samples = []
            for i in range(group_size):
                t = rint(*completion_len)
                samples.append(TrainSample(
                    group_id=g, sample_id=i, prompt_ids=prompt,
                    completion_ids=torch.randint(0, VOCAB, (t,), generator=gen),
                    behaviour_logprobs=-4.0 - torch.rand(t, generator=gen),
                    policy_versions=torch.zeros(t, dtype=torch.int64),
                    reward=float(torch.rand((), generator=gen)), temperature=[1.0, 0.7, 1.3][i % 3]))
            groups.append(Group(group_id=g, samples=samples))
        return groups

    return learner_groups


@pytest.fixture(scope="session")
def tied_model(tiny_lm):
    def tied_model(seed, dropout=0.0):
        return tiny_lm("qwen2", seed=seed, max_position_embeddings=64, tie_word_embeddings=True,
                       attention_dropout=dropout)

    return tied_model


@pytest.fixture(scope="session")
def checkpoint_batches():
    def checkpoint_batches(num_steps, seed=0):
        gen = torch.Generator().manual_seed(seed)
        out = []
        for step in range(num_steps):
            groups = []
            for g in range(2):
                prompt = torch.randint(0, VOCAB, (4,), generator=gen)
                samples = []
                for i in range(3):
                    t = int(torch.randint(1, 8, (), generator=gen))
                    samples.append(TrainSample(
                        group_id=10 * step + g, sample_id=i, prompt_ids=prompt,
                        completion_ids=torch.randint(0, VOCAB, (t,), generator=gen),
                        behaviour_logprobs=-4.0 - torch.rand(t, generator=gen),
                        policy_versions=torch.full((t,), max(0, step - 1)), reward=float(i == g)))
                groups.append(Group(group_id=10 * step + g, samples=samples))
            out.append(groups)
        return out

    return checkpoint_batches


@pytest.fixture(scope="session")
def ppo_clip():
    return dict(clip_eps_low=0.2, clip_eps_high=0.28, is_cap=2.0)


@pytest.fixture(scope="session")
def ppo_groups(group_samples):
    def ppo_groups(num_groups=3):
        """Groups of shared-prefix samples (so replay shares work), off-policy behaviour log-probs, rewards."""
        gen = torch.Generator().manual_seed(11)
        groups = []
        for g in range(num_groups):
            samples = group_samples(20 + g, num=3 + g, prompt_len=5 + g)
            for s in samples:
                s.group_id = g
                s.reward = float(torch.rand((), generator=gen))
            groups.append(Group(group_id=g, samples=samples))
        return groups

    return ppo_groups
