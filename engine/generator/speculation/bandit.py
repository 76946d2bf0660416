"""Adaptive speculation: a bucketed epsilon-greedy bandit picks each step's arm — plain decoding (off), or
k drafts of the EAGLE drafter (eagle@k) or of the model-free suffix drafter (suffix@k) — per step.

    choose(num_running) -> bucket of the running-batch size (1, 2, 3-4, 5-8, ... powers of two)
                        -> the next arm owed its first tries in this bucket (see below), else with
                           probability epsilon_n (and within the exploration budget) off or a uniform
                           random arm (half each), else the best recent reward
    update(num_running, arm, num_tokens, seconds) -> reward window of (bucket, arm)

Reward = emitted tokens per second of decode time over a sliding window of the arm's last `window`
steps in that bucket (mean tokens per step / median step time: robust to preempted steps on a shared
machine), so the estimate follows a drafter that gets better (or a policy that drifts away from it). Every bucket holds every arm, off included: where
speculation loses, the bandit turns it off — for that batch size only. It duck-types as the backend's
depth policy (TorchBackend.enable_speculation).

First tries: off, then each drafter's depths shallow to deep, stopping at the first depth whose reward
falls more than prune_margin below the best before it (off's included): tokens per second against k rises
while another draft pays for itself and falls after, so deeper arms past the peak are left to
exploration. Where speculation loses (large batches) that is 3 arms tried instead of all 13.
Exploration cost is bounded twice: epsilon decays with the bucket's steps (epsilon * decay_steps /
(decay_steps + n), never below min_epsilon, so a drafter that improves is still found), and a bucket
explores only while its exploration steps took less than max_explore_share of its decode time — a
random arm that is twice as slow as the best then costs at most that share of throughput.
Test: pytest tests/engine/generator/speculation/test_bandit.py
"""

from __future__ import annotations

import random
import statistics
from collections import deque
from collections.abc import Sequence

from tailrace.engine.generator.speculation.speculative import DRAFTERS, OFF, Arm, as_arm

DEFAULT_DEPTHS = (1, 2, 3, 4, 6, 8)
DEFAULT_ARMS = (OFF, *(Arm(d, k) for d in DRAFTERS for k in DEFAULT_DEPTHS))


def arms_for(drafters: Sequence[str], depths: Sequence[int] = DEFAULT_DEPTHS) -> tuple[Arm, ...]:
    """off and every depth of these drafters (e.g. ("suffix",): model-free speculation only)."""
    return (OFF, *(Arm(d, k) for d in drafters for k in depths))


def arm_key(arm: Arm) -> str:
    """The arm's name in telemetry keys: k0 (off), k4 (eagle@4), suffix_k4."""
    return f"k{arm.k}" if arm.drafter != "suffix" else f"suffix_k{arm.k}"


def bucket_of(num_running: int) -> int:
    """0 for 1 running row, 1 for 2, 2 for 3-4, 3 for 5-8, ...: ceil(log2(num_running))."""
    if num_running < 1:
        raise ValueError(f"num_running must be >= 1, got {num_running}")
    return (num_running - 1).bit_length()


def bucket_label(bucket: int) -> str:
    low, high = (1 << (bucket - 1)) + 1 if bucket else 1, 1 << bucket
    return str(high) if low == high else f"{low}-{high}"


class _Arm:
    __slots__ = ("window", "tokens", "num_chosen", "_reward")

    def __init__(self, window: int):
        self.window: deque[tuple[int, float]] = deque(maxlen=window)
        self.tokens = 0
        self.num_chosen = 0
        self._reward: float | None = None

    def add(self, tokens: int, seconds: float) -> None:
        if len(self.window) == self.window.maxlen:
            self.tokens -= self.window[0][0]
        self.window.append((tokens, seconds))
        self.tokens += tokens
        self._reward = None

    @property
    def reward(self) -> float | None:
        """Mean tokens per step over the window divided by the median step time, None before any
        observation. A step's time at a given arm and batch size is nearly constant but for the
        machine's interruptions (a preempted step takes many times longer): the median ignores them,
        where a sum of seconds lets one slow step sink an arm's first tries."""
        if not self.window:
            return None
        if self._reward is None:
            median_s = statistics.median(seconds for _, seconds in self.window)
            mean_tokens = self.tokens / len(self.window)
            self._reward = mean_tokens / median_s if median_s > 0 else float("inf")
        return self._reward


class SpecBandit:
    """Epsilon-greedy over speculation arms, one independent set of arms per batch-size bucket. Arms are
    speculative.Arm, depths (the eagle drafter's; 0 = off) or labels ("suffix@4")."""

    def __init__(self, arms: Sequence = DEFAULT_ARMS, *, epsilon: float = 0.1, window: int = 32,
                 min_tries: int = 3, prune_margin: float = 0.1, decay_steps: int = 200,
                 min_epsilon: float = 0.01, max_explore_share: float = 0.01, seed: int | None = 0):
        try:
            parsed = [as_arm(a) for a in arms]
        except ValueError as exc:
            raise ValueError(f"arms: {exc}") from None
        if not parsed or len(set(parsed)) != len(parsed):
            raise ValueError(f"arms must be distinct arms (depths >= 0, off, eagle@K, suffix@K), got {list(arms)}")
        if not 0.0 <= epsilon <= 1.0 or not 0.0 <= min_epsilon <= 1.0:
            raise ValueError(f"epsilon and min_epsilon must lie in [0, 1], got {epsilon}, {min_epsilon}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not 1 <= min_tries <= window:
            raise ValueError(f"min_tries must lie in [1, window], got {min_tries}")
        if not 0.0 <= prune_margin <= 1.0:
            raise ValueError(f"prune_margin must lie in [0, 1] (1: every arm gets its first tries), got {prune_margin}")
        if decay_steps < 0 or not 0.0 <= max_explore_share <= 1.0:
            raise ValueError(f"decay_steps must be >= 0 (0: constant epsilon) and max_explore_share in [0, 1], "
                             f"got {decay_steps}, {max_explore_share}")
        order = {name: i for i, name in enumerate(("off", *DRAFTERS))}
        self.arms = tuple(sorted(parsed, key=lambda a: (order[a.drafter], a.k)))
        self.prune_margin = prune_margin
        self.epsilon, self.min_epsilon, self.decay_steps = epsilon, min(min_epsilon, epsilon), decay_steps
        self.max_explore_share = max_explore_share
        self.window = window
        self.min_tries = min_tries  # one noisy step per arm is a poor first estimate
        self._rng = random.Random(seed)
        self._buckets: dict[int, dict[Arm, _Arm]] = {}
        self._steps: dict[int, list] = {}  # bucket -> [steps, decode s, exploration s]
        self.last_choice: tuple[int, Arm, bool] | None = None  # (bucket, arm, explored)

    def _bucket(self, num_running: int) -> dict[Arm, _Arm]:
        bucket = bucket_of(num_running)
        if bucket not in self._buckets:
            self._buckets[bucket] = {arm: _Arm(self.window) for arm in self.arms}
            self._steps[bucket] = [0, 0.0, 0.0]
        return self._buckets[bucket]

    def best(self, num_running: int) -> Arm | None:
        """The arm with the best recent reward in this batch size's bucket (None before any data); ties
        go to the cheaper arm (off, then the shallower)."""
        arms = self._bucket(num_running)
        scored = [(arm.reward, -i) for i, arm in enumerate(arms.values()) if arm.reward is not None]
        return self.arms[-max(scored)[1]] if scored else None

    def epsilon_now(self, num_running: int) -> float:
        """The exploration probability of this bucket now, after its steps so far."""
        self._bucket(num_running)
        if not self.decay_steps:
            return self.epsilon
        steps = self._steps[bucket_of(num_running)][0]
        return max(self.min_epsilon, self.epsilon * self.decay_steps / (self.decay_steps + steps))

    def _first_try(self, arms: dict[Arm, _Arm]) -> Arm | None:
        """The next arm still owed its first tries: off, then each drafter shallow to deep until the
        reward falls past its peak."""
        base = 0.0
        off = arms.get(OFF)
        if off is not None:
            if len(off.window) < self.min_tries:
                return OFF
            base = off.reward
        for drafter in DRAFTERS:
            best = base
            for arm in (a for a in self.arms if a.drafter == drafter):  # ascending k
                state = arms[arm]
                if len(state.window) < self.min_tries:
                    return arm
                if state.reward < (1.0 - self.prune_margin) * best:
                    break
                best = max(best, state.reward)
        return None

    def choose(self, num_running: int) -> Arm:
        arms = self._bucket(num_running)
        bucket = bucket_of(num_running)
        steps, decode_s, explore_s = self._steps[bucket]
        arm, explored = self._first_try(arms), False
        if arm is None:
            explored = (self._rng.random() < self.epsilon_now(num_running)
                        and explore_s <= self.max_explore_share * decode_s)
            arm = self._explore_arm() if explored else self.best(num_running)
        arms[arm].num_chosen += 1
        self.last_choice = (bucket, arm, explored)
        return arm

    def _explore_arm(self) -> Arm:
        """Half of the explorations re-measure off (the baseline every arm is judged against, cheap
        exactly where speculation loses), the rest pick a uniform random arm."""
        if OFF in self.arms and self._rng.random() < 0.5:
            return OFF
        return self._rng.choice(self.arms)

    def update(self, num_running: int, arm, num_tokens: int, seconds: float) -> None:
        """One step's outcome: num_tokens emitted by all rows in `seconds` of decoding with `arm`."""
        arms, arm = self._bucket(num_running), as_arm(arm)
        if arm not in arms or seconds < 0:
            return
        arms[arm].add(num_tokens, seconds)
        totals = self._steps[bucket_of(num_running)]
        totals[0] += 1
        totals[1] += seconds
        if self.last_choice == (bucket_of(num_running), arm, True):
            totals[2] += seconds

    def stats(self) -> dict[str, float]:
        """Telemetry counters: per bucket the best arm (its depth best_k, 0 = off, and best_suffix: 1
        when it drafts from suffixes), the exploration probability and share of decode time, and per arm
        how often it was chosen and its windowed tokens/s. Keys generator/spec/bucket_<sizes>/..."""
        out: dict[str, float] = {}
        for bucket, arms in sorted(self._buckets.items()):
            prefix = f"generator/spec/bucket_{bucket_label(bucket)}"
            best = self.best(1 << bucket)
            out[f"{prefix}/best_k"] = -1 if best is None else best.k
            out[f"{prefix}/best_suffix"] = float(best is not None and best.drafter == "suffix")
            steps, decode_s, explore_s = self._steps[bucket]
            out[f"{prefix}/epsilon"] = self.epsilon_now(1 << bucket)
            out[f"{prefix}/explore_share"] = explore_s / decode_s if decode_s > 0 else 0.0
            for arm, state in arms.items():
                out[f"{prefix}/{arm_key(arm)}_chosen"] = state.num_chosen
                if state.reward is not None:
                    out[f"{prefix}/{arm_key(arm)}_tokens_per_s"] = state.reward
        return out
