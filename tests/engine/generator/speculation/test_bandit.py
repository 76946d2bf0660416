"""The speculation bandit: per batch-size bucket it finds the best arm (off, eagle@k, suffix@k) on a
synthetic reward (including "off" where speculation loses), explores with probability epsilon that
decays, within a bounded share of decode time, and follows a reward that changes; as the backend's depth
policy it keeps decoding exact.

Run: pytest tests/engine/generator/speculation/test_bandit.py
"""

import random

import pytest

from tailrace.engine.core.drafter import Drafter
from tailrace.engine.generator.speculation.bandit import (
    DEFAULT_ARMS,
    SpecBandit,
    arm_key,
    arms_for,
    bucket_label,
    bucket_of,
)
from tailrace.engine.generator.speculation.speculative import OFF, Arm, telemetry
from tailrace.engine.generator.torch_backend.backend import Request, TorchBackend
from tailrace.protocol.messages import SamplingParams

# Synthetic tokens/s per (bucket, k) of the eagle drafter: speculation pays at small batches, less at
# medium, loses at large. Suffix arms (EAGLE_ONLY = False) are 40 tokens/s worse than eagle's.
BEST = {0: 4, 2: 2, 5: 0}
EAGLE_ONLY = tuple(a for a in DEFAULT_ARMS if a.drafter != "suffix")
CONSTANT = dict(decay_steps=0, max_explore_share=1.0)  # the plain epsilon-greedy rule


def tokens_per_s(bucket: int, arm) -> float:
    k = arm.k if isinstance(arm, Arm) else arm
    suffix = 40.0 if isinstance(arm, Arm) and arm.drafter == "suffix" else 0.0
    return 100.0 * (1.0 + 0.5 * (1 - abs(k - BEST[bucket]) / 8)) - (30.0 if k != BEST[bucket] else 0.0) - suffix


def simulate(bandit: SpecBandit, num_steps: int, rng: random.Random, reward=tokens_per_s) -> list:
    sizes = {0: [1], 2: [3, 4], 5: [17, 32]}
    choices = []
    for _ in range(num_steps):
        bucket = rng.choice(list(BEST))
        num_running = rng.choice(sizes[bucket])
        arm = bandit.choose(num_running)
        # A step's work is the arm's (its tokens); its time is noisy, as on a shared machine.
        bandit.update(num_running, arm, round(reward(bucket, arm) * 0.1), 0.1 * rng.uniform(0.8, 1.2))
        choices.append((bucket, arm.k))
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
        assert bandit.best(1 << bucket).k == best and bandit.best(1 << bucket).drafter != "suffix"
        late = [k for b, k in choices[-1500:] if b == bucket]
        assert sum(k == best for k in late) / len(late) > 0.85
    assert bandit.best(32) == OFF  # speculation off at 17-32 running rows
    stats = bandit.stats()
    assert stats["generator/spec/bucket_17-32/best_k"] == 0 and stats["generator/spec/bucket_1/best_k"] == 4
    assert sum(stats[f"generator/spec/bucket_1/{arm_key(a)}_chosen"] for a in DEFAULT_ARMS) == sum(
        1 for b, _ in choices if b == 0)


def test_first_tries_stop_past_the_peak():
    # Without exploration, a bucket where speculation loses tries k = 0 and 1 only; one where depth 4
    # is best tries 0 .. 6 (6 is past the peak) and never 8; margin 1 tries every arm.
    for bucket, tried in ((5, [0, 1]), (0, [0, 1, 2, 3, 4, 6])):
        bandit = SpecBandit(EAGLE_ONLY, epsilon=0.0, min_tries=3, seed=0)
        num_running = 1 << bucket
        for _ in range(200):
            arm = bandit.choose(num_running)
            bandit.update(num_running, arm, round(tokens_per_s(bucket, arm.k)), 1.0)
        assert [a.k for a in EAGLE_ONLY if bandit.stats()[f"generator/spec/bucket_{bucket_label(bucket)}/k{a.k}_chosen"]
                and a.k != BEST[bucket]] == [k for k in tried if k != BEST[bucket]]
        assert bandit.best(num_running).k == BEST[bucket]
    # Both drafters: each family is tried shallow to deep and pruned past its own peak; where both lose,
    # off, eagle@1 and suffix@1 are all that is tried.
    both = SpecBandit(epsilon=0.0, min_tries=3, seed=0)
    for _ in range(200):
        arm = both.choose(32)
        both.update(32, arm, round(tokens_per_s(5, arm)), 1.0)
    assert {a for a in DEFAULT_ARMS if both.stats()[f"generator/spec/bucket_17-32/{arm_key(a)}_chosen"]} == {
        OFF, Arm("eagle", 1), Arm("suffix", 1)}
    everything = SpecBandit(epsilon=0.0, prune_margin=1.0, seed=0)
    for _ in range(3 * len(DEFAULT_ARMS)):
        arm = everything.choose(32)
        everything.update(32, arm, round(tokens_per_s(5, arm)), 1.0)
    assert all(everything.stats()[f"generator/spec/bucket_17-32/{arm_key(a)}_chosen"] == 3 for a in DEFAULT_ARMS)
    with pytest.raises(ValueError, match="prune_margin"):
        SpecBandit(prune_margin=1.5)


@pytest.mark.parametrize("epsilon", [0.0, 0.2])
def test_explores_with_probability_epsilon(epsilon):
    bandit = SpecBandit(EAGLE_ONLY, epsilon=epsilon, window=64, seed=1, **CONSTANT)
    simulate(bandit, 500, random.Random(1))  # every arm tried, best arms found
    choices = simulate(bandit, 6000, random.Random(2))
    explored = sum(k != BEST[b] for b, k in choices) / len(choices)
    # Half the explorations re-measure off (the best arm in one bucket of three), the other half pick a
    # random arm, which lands on the best one 1 time in 7.
    expected = epsilon * (0.5 * 2 / 3 + 0.5 * (len(EAGLE_ONLY) - 1) / len(EAGLE_ONLY))
    assert explored == pytest.approx(expected, abs=0.01)


def test_follows_a_reward_that_changes():
    # The drafter improves: at batch 1 the best depth moves from 1 to 6; the window forgets the past.
    bandit = SpecBandit(EAGLE_ONLY, epsilon=0.2, window=8, seed=2, **CONSTANT)
    best_k = 1

    def reward(bucket, k):
        return 200.0 - 20.0 * abs(k - best_k)

    for _ in range(600):
        arm = bandit.choose(1)
        bandit.update(1, arm, round(reward(0, arm.k)), 1.0)
    assert bandit.best(1) == Arm("eagle", 1)
    best_k = 6
    for _ in range(1500):
        arm = bandit.choose(1)
        bandit.update(1, arm, round(reward(0, arm.k)), 1.0)
    assert bandit.best(1) == Arm("eagle", 6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="arms"):
        SpecBandit(arms=(0, 1, 1))
    with pytest.raises(ValueError, match="epsilon"):
        SpecBandit(epsilon=1.5)
    with pytest.raises(ValueError, match="window"):
        SpecBandit(window=0)
    with pytest.raises(ValueError, match="min_tries"):
        SpecBandit(window=4, min_tries=5)
    with pytest.raises(ValueError, match="arms"):
        SpecBandit(arms=("off", "medusa@2"))
    with pytest.raises(ValueError, match="min_epsilon"):
        SpecBandit(epsilon=0.1, min_epsilon=-0.1)
    with pytest.raises(ValueError, match="max_explore_share"):
        SpecBandit(max_explore_share=2.0)
    assert SpecBandit(arms=(0, 2, "suffix@3", Arm("eagle", 1))).arms == (OFF, Arm("eagle", 1), Arm("eagle", 2),
                                                                       Arm("suffix", 3))
    assert arms_for(("suffix",), (2, 4)) == (OFF, Arm("suffix", 2), Arm("suffix", 4))


def plain_wins(bucket, arm) -> float:
    """Speculation loses everywhere: each extra draft costs 15% of plain's 100 tokens/s."""
    return 100.0 / (1.0 + 0.15 * arm.k)


def test_where_speculation_loses_the_cost_of_exploring_stays_within_two_percent():
    # 20000 steps at batch 32 (a long run's worth): after its first tries the bandit decodes plainly,
    # explores rarely (epsilon decays, exploration capped at 1% of decode time) and its throughput is
    # within 2% of plain decoding's. The constant-epsilon rule pays several times more.
    def throughput(bandit):
        tokens = seconds = 0.0
        for _ in range(20_000):
            arm = bandit.choose(32)
            step_tokens = 32.0
            step_s = step_tokens / plain_wins(5, arm)
            bandit.update(32, arm, step_tokens, step_s)
            tokens, seconds = tokens + step_tokens, seconds + step_s
        return tokens / seconds / 100.0

    bounded = SpecBandit(seed=4)
    ratio = throughput(bounded)
    assert ratio > 0.98 and bounded.best(32) == OFF
    stats = bounded.stats()
    assert stats["generator/spec/bucket_17-32/explore_share"] <= 0.0101
    assert stats["generator/spec/bucket_17-32/epsilon"] == pytest.approx(0.01)
    assert throughput(SpecBandit(seed=4, **CONSTANT)) < 1.0 - 2 * (1.0 - ratio)


def test_epsilon_decays_with_the_buckets_steps_to_its_floor():
    bandit = SpecBandit(epsilon=0.2, decay_steps=100, min_epsilon=0.02, seed=5)
    for _ in range(100):
        bandit.update(1, bandit.choose(1), 10, 0.1)
    assert bandit.epsilon_now(1) == pytest.approx(0.1) and bandit.epsilon_now(2) == pytest.approx(0.2)
    for _ in range(10_000):
        bandit.update(1, bandit.choose(1), 10, 0.1)
    assert bandit.epsilon_now(1) == pytest.approx(0.02)


def test_as_the_backends_depth_policy_decoding_stays_exact(make_model):
    model = make_model("qwen2")
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

    bandit = SpecBandit(epsilon=0.3, seed=3, **CONSTANT)
    spec, backend = decode(bandit)
    assert spec == decode(None)[0]
    chosen = {key.rsplit("/", 1)[1] for key, v in bandit.stats().items() if key.endswith("_chosen") and v}
    assert len(chosen) >= 4 and backend.spec_stats.num_spec_steps > 0 and backend.spec_stats.num_plain_steps > 0
    assert backend.spec_stats.steps_by["suffix"] > 0 and backend.spec_stats.steps_by["eagle"] > 0
    counters = telemetry(backend, bandit)
    assert counters["generator/spec/drafter_version"] == 0 and counters["generator/spec/spec_steps"] > 0
    assert "generator/spec/bucket_2/best_k" in counters and "generator/spec/accept_len_0" in counters
    assert telemetry(TorchBackend(model, max_batch_size=1, max_model_len=8)) == {}


def test_a_preempted_step_does_not_sink_an_arm():
    # Off decodes 100 tokens/s and suffix@1 80, but one of off's first tries is preempted (10x slower):
    # the median step time ignores it and off stays the choice; a sum of seconds would have made off
    # look like 25 tokens/s.
    bandit = SpecBandit(arms=("off", "suffix@1"), epsilon=0.0, seed=6)
    slow = iter([False, True, False])
    for _ in range(20):
        arm = bandit.choose(1)
        seconds = 0.01 if arm == OFF else 0.0125
        bandit.update(1, arm, 1, seconds * (10 if arm == OFF and next(slow, False) else 1))
    assert bandit.best(1) == OFF and bandit.stats()["generator/spec/bucket_1/k0_chosen"] == 17
