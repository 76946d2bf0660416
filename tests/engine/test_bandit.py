"""The speculation-depth bandit: per batch-size bucket it finds the best depth on a synthetic reward
(including "off" where speculation loses), explores with probability epsilon, and follows a reward that
changes; as the backend's depth policy it keeps decoding exact.

Run: pytest tests/engine/test_bandit.py
"""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from tailrace.engine.drafter import Drafter
from tailrace.engine.generator.backend import Request, TorchBackend
from tailrace.engine.generator.bandit import DEFAULT_ARMS, SpecBandit, bucket_label, bucket_of
from tailrace.engine.generator.speculative import telemetry
from tailrace.protocol.messages import SamplingParams

# Synthetic tokens/s per (bucket, k): speculation pays at small batches, less at medium, loses at large.
BEST = {0: 4, 2: 2, 5: 0}


def tokens_per_s(bucket: int, k: int) -> float:
    return 100.0 * (1.0 + 0.5 * (1 - abs(k - BEST[bucket]) / 8)) - (30.0 if k != BEST[bucket] else 0.0)


def simulate(bandit: SpecBandit, num_steps: int, rng: random.Random, reward=tokens_per_s) -> list:
    sizes = {0: [1], 2: [3, 4], 5: [17, 32]}
    choices = []
    for _ in range(num_steps):
        bucket = rng.choice(list(BEST))
        num_running = rng.choice(sizes[bucket])
        k = bandit.choose(num_running)
        seconds = 0.01 * rng.uniform(0.8, 1.2)  # noisy step time, the rate is what matters
        bandit.update(num_running, k, round(reward(bucket, k) * seconds), seconds)
        choices.append((bucket, k))
    return choices


def test_buckets():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [0, 1, 2, 2, 3, 3, 4, 5, 6]
    assert [bucket_label(b) for b in (0, 1, 2, 5)] == ["1", "2", "3-4", "17-32"]
    with pytest.raises(ValueError):
        bucket_of(0)


def test_converges_to_the_best_arm_per_bucket_and_turns_speculation_off_where_it_loses():
    bandit = SpecBandit(epsilon=0.1, window=16, seed=0)
    choices = simulate(bandit, 3000, random.Random(0))
    for bucket, best in BEST.items():
        assert bandit.best(1 << bucket) == best
        late = [k for b, k in choices[-1500:] if b == bucket]
        assert sum(k == best for k in late) / len(late) > 0.85
    assert bandit.best(32) == 0  # speculation off at 17-32 running rows
    stats = bandit.stats()
    assert stats["generator/spec/bucket_17-32/best_k"] == 0 and stats["generator/spec/bucket_1/best_k"] == 4
    assert sum(stats[f"generator/spec/bucket_1/k{k}_chosen"] for k in DEFAULT_ARMS) == sum(
        1 for b, _ in choices if b == 0)


def test_first_tries_stop_past_the_peak():
    # Without exploration, a bucket where speculation loses tries k = 0 and 1 only; one where depth 4
    # is best tries 0 .. 6 (6 is past the peak) and never 8; margin 1 tries every arm.
    for bucket, tried in ((5, [0, 1]), (0, [0, 1, 2, 3, 4, 6])):
        bandit = SpecBandit(epsilon=0.0, min_tries=3, seed=0)
        num_running = 1 << bucket
        for _ in range(200):
            k = bandit.choose(num_running)
            bandit.update(num_running, k, round(tokens_per_s(bucket, k)), 1.0)
        assert [k for k in DEFAULT_ARMS if bandit.stats()[f"generator/spec/bucket_{bucket_label(bucket)}/k{k}_chosen"]
                and k != BEST[bucket]] == [k for k in tried if k != BEST[bucket]]
        assert bandit.best(num_running) == BEST[bucket]
    everything = SpecBandit(epsilon=0.0, prune_margin=1.0, seed=0)
    for _ in range(3 * len(DEFAULT_ARMS)):
        k = everything.choose(32)
        everything.update(32, k, round(tokens_per_s(5, k)), 1.0)
    assert all(everything.stats()[f"generator/spec/bucket_17-32/k{k}_chosen"] == 3 for k in DEFAULT_ARMS)
    with pytest.raises(ValueError, match="prune_margin"):
        SpecBandit(prune_margin=1.5)


@pytest.mark.parametrize("epsilon", [0.0, 0.2])
def test_explores_with_probability_epsilon(epsilon):
    bandit = SpecBandit(epsilon=epsilon, window=64, seed=1)
    simulate(bandit, 500, random.Random(1))  # every arm tried, best arms found
    choices = simulate(bandit, 6000, random.Random(2))
    explored = sum(k != BEST[b] for b, k in choices) / len(choices)
    # A random pick lands on the best arm 1 time in 7.
    expected = epsilon * (len(DEFAULT_ARMS) - 1) / len(DEFAULT_ARMS)
    assert explored == pytest.approx(expected, abs=0.025)


def test_follows_a_reward_that_changes():
    # The drafter improves: at batch 1 the best depth moves from 1 to 6; the window forgets the past.
    bandit = SpecBandit(epsilon=0.2, window=8, seed=2)
    best_k = 1

    def reward(bucket, k):
        return 200.0 - 20.0 * abs(k - best_k)

    for _ in range(600):
        k = bandit.choose(1)
        bandit.update(1, k, round(reward(0, k)), 1.0)
    assert bandit.best(1) == 1
    best_k = 6
    for _ in range(1500):
        k = bandit.choose(1)
        bandit.update(1, k, round(reward(0, k)), 1.0)
    assert bandit.best(1) == 6


def test_bad_arguments():
    with pytest.raises(ValueError, match="arms"):
        SpecBandit(arms=(0, 1, 1))
    with pytest.raises(ValueError, match="epsilon"):
        SpecBandit(epsilon=1.5)
    with pytest.raises(ValueError, match="window"):
        SpecBandit(window=0)
    with pytest.raises(ValueError, match="min_tries"):
        SpecBandit(window=4, min_tries=5)


def test_as_the_backends_depth_policy_decoding_stays_exact():
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=128,
                         initializer_range=0.3, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]

    def decode(bandit):
        backend = TorchBackend(model, max_batch_size=2, max_model_len=48)
        if bandit is not None:
            backend.enable_speculation(Drafter.for_policy(model), bandit)
        for i, p in enumerate(prompts):
            backend.add(Request(i, 0, p, SamplingParams(temperature=0.0, max_new_tokens=20)))
        done = {}
        while backend.num_running or backend.num_waiting:
            done.update({f.group_id: f.completion_ids.tolist() for f in backend.step()})
        return done, backend

    bandit = SpecBandit(epsilon=0.3, seed=3)
    spec, backend = decode(bandit)
    assert spec == decode(None)[0]
    chosen = {k for key, v in bandit.stats().items() if key.endswith("_chosen") and v
              for k in [key.rsplit("/k", 1)[1].split("_")[0]]}
    assert len(chosen) >= 4 and backend.spec_stats.num_spec_steps > 0 and backend.spec_stats.num_plain_steps > 0
    counters = telemetry(backend, bandit)
    assert counters["generator/spec/drafter_version"] == 0 and counters["generator/spec/spec_steps"] > 0
    assert "generator/spec/bucket_2/best_k" in counters and "generator/spec/accept_len_0" in counters
    assert telemetry(TorchBackend(model, max_batch_size=1, max_model_len=8)) == {}
