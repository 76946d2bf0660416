"""Adaptive speculation: a bucketed epsilon-greedy bandit picks the speculation depth k per step.

    choose(num_running) -> bucket of the running-batch size (1, 2, 3-4, 5-8, ... powers of two)
                        -> the shallowest arm tried fewer than min_tries times in this bucket (see
                           below), else with probability epsilon a uniform random arm, else the
                           best recent reward
    update(num_running, k, num_tokens, seconds) -> reward window of (bucket, k)

Reward = emitted tokens per second of decode time over a sliding window of the arm's last `window`
steps in that bucket (sum of tokens / sum of seconds), so the estimate follows a drafter that gets
better (or a policy that drifts away from it). Every bucket holds every arm, k = 0 (plain decoding)
included: where speculation loses, the bandit turns it off — for that batch size only. It duck-types
as the backend's depth policy (TorchBackend.enable_speculation).

First tries go shallow to deep and stop at the first depth whose reward falls more than prune_margin
below the best before it: tokens per second against k rises while another draft pays for itself and
falls after (expected tokens grow ever slower, cost linearly), so deeper arms past the peak are left to
epsilon exploration. Where speculation loses (large batches) that is 2 arms tried instead of all 7,
which matters in short runs: each try of a bad arm is a slow step.
Test: pytest tests/engine/test_bandit.py
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

DEFAULT_ARMS = (0, 1, 2, 3, 4, 6, 8)


def bucket_of(num_running: int) -> int:
    """0 for 1 running row, 1 for 2, 2 for 3-4, 3 for 5-8, ...: ceil(log2(num_running))."""
    if num_running < 1:
        raise ValueError(f"num_running must be >= 1, got {num_running}")
    return (num_running - 1).bit_length()


def bucket_label(bucket: int) -> str:
    low, high = (1 << (bucket - 1)) + 1 if bucket else 1, 1 << bucket
    return str(high) if low == high else f"{low}-{high}"


class _Arm:
    __slots__ = ("window", "tokens", "seconds", "num_chosen")

    def __init__(self, window: int):
        self.window: deque[tuple[int, float]] = deque(maxlen=window)
        self.tokens = 0
        self.seconds = 0.0
        self.num_chosen = 0

    def add(self, tokens: int, seconds: float) -> None:
        if len(self.window) == self.window.maxlen:
            old_tokens, old_seconds = self.window[0]
            self.tokens -= old_tokens
            self.seconds -= old_seconds
        self.window.append((tokens, seconds))
        self.tokens += tokens
        self.seconds += seconds

    @property
    def reward(self) -> float | None:
        """Tokens per second over the window, None before any observation."""
        if not self.window:
            return None
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


class SpecBandit:
    """Epsilon-greedy over speculation depths, one independent set of arms per batch-size bucket."""

    def __init__(self, arms: Sequence[int] = DEFAULT_ARMS, *, epsilon: float = 0.1, window: int = 32,
                 min_tries: int = 3, prune_margin: float = 0.1, seed: int | None = 0):
        if not arms or len(set(arms)) != len(arms) or min(arms) < 0:
            raise ValueError(f"arms must be distinct depths >= 0, got {list(arms)}")
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must lie in [0, 1], got {epsilon}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 1 <= min_tries <= window:
            raise ValueError(f"min_tries must lie in [1, window], got {min_tries}")
        if not 0.0 <= prune_margin <= 1.0:
            raise ValueError(f"prune_margin must lie in [0, 1] (1: every arm gets its first tries), got {prune_margin}")
        self.arms = tuple(sorted(arms))
        self.prune_margin = prune_margin
        self.epsilon = epsilon
        self.window = window
        self.min_tries = min_tries  # one noisy step per arm is a poor first estimate
        self._rng = random.Random(seed)
        self._buckets: dict[int, dict[int, _Arm]] = {}
        self.last_choice: tuple[int, int] | None = None  # (bucket, k)

    def _bucket(self, num_running: int) -> dict[int, _Arm]:
        bucket = bucket_of(num_running)
        if bucket not in self._buckets:
            self._buckets[bucket] = {k: _Arm(self.window) for k in self.arms}
        return self._buckets[bucket]

    def best(self, num_running: int) -> int | None:
        """The arm with the best recent reward in this batch size's bucket (None before any data)."""
        arms = self._bucket(num_running)
        scored = [(arm.reward, -k) for k, arm in arms.items() if arm.reward is not None]
        return -max(scored)[1] if scored else None

    def _first_try(self, arms: dict[int, _Arm]) -> int | None:
        """The next arm still owed its first tries, shallow to deep, until the reward falls past its peak."""
        best = 0.0
        for k, arm in arms.items():  # ascending k
            if len(arm.window) < self.min_tries:
                return k
            if arm.reward < (1.0 - self.prune_margin) * best:
                return None
            best = max(best, arm.reward)
        return None

    def choose(self, num_running: int) -> int:
        arms = self._bucket(num_running)
        k = self._first_try(arms)
        if k is None:
            k = self._rng.choice(self.arms) if self._rng.random() < self.epsilon else self.best(num_running)
        arms[k].num_chosen += 1
        self.last_choice = (bucket_of(num_running), k)
        return k

    def update(self, num_running: int, k: int, num_tokens: int, seconds: float) -> None:
        """One step's outcome: num_tokens emitted by all rows in `seconds` of decoding at depth k."""
        arms = self._bucket(num_running)
        if k in arms and seconds >= 0:
            arms[k].add(num_tokens, seconds)

    def stats(self) -> dict[str, float]:
        """Telemetry counters: per bucket the chosen (best) depth, and per arm how often it was chosen
        and its windowed tokens/s. Keys generator/spec/bucket_<sizes>/..."""
        out: dict[str, float] = {}
        for bucket, arms in sorted(self._buckets.items()):
            prefix = f"generator/spec/bucket_{bucket_label(bucket)}"
            best = self.best(1 << bucket)
            out[f"{prefix}/best_k"] = -1 if best is None else best
            for k, arm in arms.items():
                out[f"{prefix}/k{k}_chosen"] = arm.num_chosen
                if arm.reward is not None:
                    out[f"{prefix}/k{k}_tokens_per_s"] = arm.reward
        return out
