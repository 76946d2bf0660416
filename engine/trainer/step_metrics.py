"""The figures a GRPO step logs about its batch, beside the learner's own: reward, the share of groups
without signal, completion lengths, staleness and batch size, under trainer/<group>/<name>. Pure (no
torch). Test: pytest tests/engine/trainer/test_reward_signal.py
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from tailrace.engine.trainer.reward_signal import frac_zero_std
from tailrace.engine.trainer.scoring import reward_detail_metrics


def batch_metrics(groups: Sequence[Any], trained_version: int) -> dict[str, float]:
    """`groups` (engine/core/samples.py Groups) as trained by policy version `trained_version`."""
    samples = [s for g in groups for s in g.samples]
    staleness = [trained_version - s.min_policy_version for s in samples]
    tokens = [s.num_completion_tokens for s in samples]
    return {
        "trainer/reward/mean": statistics.fmean(s.reward for s in samples),
        "trainer/reward/frac_zero_std": frac_zero_std(groups),  # groups whose samples all got one reward
        "trainer/completion/mean_tokens": statistics.fmean(tokens),
        "trainer/completion/max_tokens": max(tokens),
        "trainer/staleness/max": max(staleness),
        "trainer/staleness/mean": statistics.fmean(staleness),
        "trainer/batch/groups": len(groups),
        "trainer/batch/samples": len(samples),
        "trainer/batch/completion_tokens": sum(tokens),
    } | reward_detail_metrics(groups)
