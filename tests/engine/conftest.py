"""Fixtures shared by the gradient tests of tests/engine/replay and tests/engine/trainer: the float64 tiny
model they compare strategies on, its samples, and the naive references.

exact_model(arch="llama", dtype=float64, seed=0, **config): vocabulary EXACT_VOCAB (exact_vocab), tied
head for qwen2 only, in training mode; float64 models get `exact_norms`. Hugging Face's RMSNorm computes
in float32 even in a float64 model, which alone leaves ~1e-8 relative differences between any two
evaluation orders; with float64 norms the same models agree to ~1e-15, so 1e-9 tests the algorithm, not
the norm's rounding. cached_exact_model: the same, built once per test module (tests must not change it).
"""

import pytest
import torch
from tiny_lms import exact_norms  # tests/tiny_lms.py, on sys.path for tests/conftest.py

from tailrace.engine.core.samples import TrainSample
from tailrace.engine.replay import dpo_loss
from tailrace.engine.trainer.learner import collate, forward_logprobs, sample_logprobs
from tailrace.engine.trainer.loss import LossConfig, StepLoss

EXACT_VOCAB = 8


@pytest.fixture(scope="session")
def exact_vocab():
    return EXACT_VOCAB


@pytest.fixture(scope="session")
def exact_model(tiny_lm):
    def exact_model(arch="llama", dtype=torch.float64, seed=0, **config):
        model = tiny_lm(arch, seed=seed, dtype=dtype, intermediate_size=48, vocab_size=EXACT_VOCAB,
                        max_position_embeddings=256, tie_word_embeddings=arch == "qwen2", **config)
        model.train()
        return exact_norms(model) if dtype == torch.float64 else model

    return exact_model


@pytest.fixture(scope="module")
def cached_exact_model(exact_model):
    models = {}

    def cached_exact_model(arch, dtype=torch.float64, **config):
        key = (arch, dtype, tuple(sorted(config.items())))
        if key not in models:
            models[key] = exact_model(arch, dtype, **config)
        return models[key]

    return cached_exact_model


@pytest.fixture(scope="session")
def make_samples():
    def make_samples(seqs, prompt_lens, seed=0):
        """Samples with their own advantage, temperature and behaviour log-probs (different per sample on
        the tokens they share)."""
        gen = torch.Generator().manual_seed(seed)
        out = []
        for i, (seq, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
            t = len(seq) - p
            out.append(TrainSample(group_id=0, sample_id=i, prompt_ids=seq[:p], completion_ids=seq[p:],
                                   behaviour_logprobs=-1.5 - 2 * torch.rand(t, generator=gen),
                                   policy_versions=torch.zeros(t, dtype=torch.int64), reward=0.0,
                                   advantage=float(torch.randn((), generator=gen)), temperature=[1.0, 0.8][i % 2]))
        return out

    return make_samples


@pytest.fixture(scope="session")
def group_samples(make_samples):
    def group_samples(seed=0, num=6, prompt_len=9):
        """A GRPO-like group: one prompt, completions sharing their first tokens in places."""
        gen = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, EXACT_VOCAB, (prompt_len,), generator=gen).tolist()
        trunk = torch.randint(0, EXACT_VOCAB, (4,), generator=gen).tolist()
        seqs = [prompt + trunk[: i % 4] + torch.randint(0, EXACT_VOCAB, (1 + 2 * i,), generator=gen).tolist()
                for i in range(num)]
        seqs.append(list(seqs[1]))  # an identical sample
        seqs.append(seqs[3][: prompt_len + 2])  # a prefix of another
        return make_samples(seqs, [prompt_len] * len(seqs), seed)

    return group_samples


@pytest.fixture(scope="session")
def rel_err():
    def rel_err(g, ref):
        return float((g - ref).norm() / ref.norm()) if float(ref.norm()) > 0 else float(g.norm())

    return rel_err


@pytest.fixture(scope="session")
def ppo_loss():
    def ppo_loss(samples, model, aggregation="token_mean"):
        """PPO-clip off-policy: a proximal policy per sample that differs from the current one, so ratios
        move and clip; behaviour log-probs differ per sample even on shared tokens."""
        gen = torch.Generator().manual_seed(len(samples))
        current = sample_logprobs(model, samples, micro_batch_tokens=4096, chunk_rows=64)
        prox = [lp.double() + 0.6 * torch.rand(lp.shape, generator=gen, dtype=torch.float64) - 0.3 for lp in current]
        cfg = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, is_cap=2.0, aggregation=aggregation)
        return StepLoss(samples, cfg, prox_logprobs=prox)

    return ppo_loss


@pytest.fixture(scope="session")
def naive_dpo_grads():
    def naive_dpo_grads(model, samples, pairs, ref_S, beta):
        """(flat gradient, loss) of the DPO loss over whole-sequence log-probs of one plain forward."""
        model.zero_grad(set_to_none=True)
        mb = collate(samples, range(len(samples)), torch.device("cpu"))
        logp, _ = forward_logprobs(model, mb, chunk_rows=7)
        seq = torch.zeros(len(samples), dtype=logp.dtype).index_add(0, mb.sample_idx_N, logp)
        c, r = torch.tensor([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])
        loss = dpo_loss.dpo_loss(seq[c], seq[r], ref_S[c], ref_S[r], beta)
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()]), float(loss.detach())

    return naive_dpo_grads


BROADCAST_RUN = ["--train.groups_per_step", "1", "--sampling.group_size", "2", "--sampling.max_new_tokens", "8",
                 "--reward.mode", "builtin", "--trainer.bind", "tcp://127.0.0.1:0", "--trainer.heartbeat_interval_s",
                 "0.2", "--trainer.stats_interval_s", "0.2", "--trainer.weights_broadcast_timeout_s", "3",
                 "--trainer.weights_bucket_bytes", "65536", "--generator.max_batch_size", "4",
                 "--generator.speculation", "false", "--controller.max_staleness", "1"]


@pytest.fixture(scope="session")
def broadcast_run():
    """Settings of a small run whose new weights go by broadcast (short timeouts, small buckets)."""
    return list(BROADCAST_RUN)


@pytest.fixture(scope="session")
def weight_bits():
    """A state dict's tensors as their raw bytes, for bit-equality checks."""
    def weight_bits(state):
        return {k: v.detach().reshape(-1).view(torch.uint8).clone() for k, v in state.items()}

    return weight_bits
