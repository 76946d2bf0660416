"""Steps without a learning signal: a GRPO group whose samples all got the same reward gives every sample
advantage zero, so it teaches the policy nothing (TRL logs the share of such groups as frac_reward_zero_std).

    frac_zero_std(groups)   the share of a step's groups with one reward for all their samples: the metric
                            trainer/reward/frac_zero_std
    NoSignalWatch.update    counts consecutive steps in which that share is 1.0 (not one group taught
                            anything) and, after metrics.no_signal_warn_steps of them (and again at 2x, 4x,
                            ... as many), returns the warning the trainer says on its log, as Event
                            "no_signal" on the notice socket and under `tailrace run`'s progress bar

Pure (no torch). Test: pytest tests/engine/trainer/test_reward_signal.py
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def frac_zero_std(groups: Sequence[Any]) -> float:
    """Share of `groups` (each with a `rewards` list) whose rewards are all equal. A group of one counts:
    it has no variance either."""
    assert groups, "a trained step has groups"
    return sum(len(set(g.rewards)) == 1 for g in groups) / len(groups)


class NoSignalWatch:
    """Consecutive steps in which every group had zero reward variance; warn_steps = 0 never warns."""

    def __init__(self, cfg: Any, run_dir: str, *, steps_without_signal: int = 0):
        """cfg: the RunConfig (metrics.no_signal_warn_steps; sampling and model.path name causes)."""
        self.warn_steps = cfg.metrics.no_signal_warn_steps
        self.group_size = cfg.sampling.group_size
        self.temperature = cfg.sampling.temperature
        self.shipped_model = cfg.model.path in ("", "tiny")
        self.run_dir = run_dir
        self.streak = 0
        self.steps_without_signal = steps_without_signal  # in the whole run, kept across --resume

    def update(self, groups: Sequence[Any]) -> str | None:
        """Count this step's groups; the warning text when one is due, else None."""
        if frac_zero_std(groups) < 1.0:
            self.streak = 0
            return None
        self.streak += 1
        self.steps_without_signal += 1
        k = self.warn_steps
        if not k or self.streak % k or (self.streak // k) & (self.streak // k - 1):
            return None  # said at k, 2k, 4k, ... consecutive steps
        return self.text(sorted({r for g in groups for r in g.rewards}))

    def text(self, rewards: list[float]) -> str:
        seen = (f"every sample's reward was {rewards[0]:g}" if len(rewards) == 1
                else f"rewards {', '.join(f'{r:g}' for r in rewards[:4])}{', ...' if len(rewards) > 4 else ''}")
        head = (f"no learning signal: in each of the last {self.streak} steps every group got one reward for "
                f"all its samples ({seen}), so every GRPO advantage is zero and the policy learns nothing. ")
        if self.group_size == 1:
            return head + "sampling.group_size is 1: a group needs 2 or more samples to compare."
        if self.temperature == 0:
            return head + "sampling.temperature is 0: greedy sampling gives every sample of a group the same text."
        samples = f"`tailrace samples {self.run_dir}` prints completions beside their rewards"
        if len(rewards) == 1 and rewards[0] <= 0:
            tiny = (" The shipped tiny model (model.path \"tiny\") was trained only to reverse strings: on "
                    "another task it scores 0 and stays there; give it data.task reverse or copy, or a model "
                    "that can solve some of your prompts.") if self.shipped_model else ""
            return head + (f"Check that the reward can pay for what this model writes ({samples}): a model "
                           f"that solves none of the prompts gets 0 everywhere.{tiny}")
        return head + (f"Check that the reward depends on the completion ({samples}), and that the prompts "
                       "are neither all solved nor all out of reach.")
