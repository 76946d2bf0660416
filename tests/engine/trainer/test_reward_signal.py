"""Steps without a learning signal (engine/trainer/reward_signal.py) and the batch figures a GRPO step logs
(engine/trainer/step_metrics.py): the share of groups whose samples all got one reward, the warning after
metrics.no_signal_warn_steps such steps with the cause it names, completion lengths.
The warning in a real run (README's Python API case): tests/engine/test_api.py.
Run: pytest tests/engine/trainer/test_reward_signal.py
"""

import pytest
import torch

from tailrace.engine.config import RunConfig, load_config
from tailrace.engine.core.samples import Group, TrainSample
from tailrace.engine.trainer.reward_signal import NoSignalWatch, frac_zero_std
from tailrace.engine.trainer.step_metrics import batch_metrics


def _group(group_id, rewards, lengths=None, version=0):
    lengths = lengths or [3] * len(rewards)
    samples = [TrainSample(group_id=group_id, sample_id=i, prompt_ids=torch.tensor([1, 5]),
                           completion_ids=torch.full((n,), 7), behaviour_logprobs=torch.full((n,), -0.5),
                           policy_versions=torch.full((n,), version), reward=r)
               for i, (r, n) in enumerate(zip(rewards, lengths, strict=True))]
    return Group(group_id=group_id, samples=samples)


def test_frac_zero_std_counts_groups_whose_samples_all_got_one_reward():
    assert frac_zero_std([_group(0, [0.0, 0.0]), _group(1, [0.0, 1.0]), _group(2, [0.5, 0.5]), _group(3, [1.0])]) == 0.75
    assert frac_zero_std([_group(0, [0.2, 0.3])]) == 0.0


def test_batch_metrics_log_the_share_without_signal_and_completion_lengths():
    groups = [_group(0, [0.0, 0.0], lengths=[2, 6], version=3), _group(1, [0.0, 1.0], lengths=[4, 12], version=2)]
    metrics = batch_metrics(groups, trained_version=3)
    assert metrics["trainer/reward/frac_zero_std"] == 0.5
    assert metrics["trainer/completion/mean_tokens"] == 6.0 and metrics["trainer/completion/max_tokens"] == 12
    assert metrics["trainer/batch/completion_tokens"] == 24 and metrics["trainer/batch/samples"] == 4
    assert metrics["trainer/reward/mean"] == 0.25 and metrics["trainer/staleness/max"] == 1


def _watch(*overrides, run_dir="runs/x"):
    return NoSignalWatch(load_config(None, list(overrides)), run_dir)


def test_the_warning_comes_after_k_steps_in_a_row_then_at_2k_4k():
    watch = _watch("--metrics.no_signal_warn_steps", "3")
    dead, alive = [_group(0, [0.0] * 4), _group(1, [0.0] * 4)], [_group(0, [0.0] * 3 + [1.0]), _group(1, [0.0] * 4)]
    said = [watch.update(dead) is not None for _ in range(2)]
    assert said == [False, False] and watch.update(alive) is None  # one group with signal resets the count
    said = [watch.update(dead) is not None for _ in range(12)]
    assert [i + 1 for i, s in enumerate(said) if s] == [3, 6, 12]
    assert watch.steps_without_signal == 14 and watch.streak == 12
    assert all(_watch("--metrics.no_signal_warn_steps", "0").update(dead) is None for _ in range(20))


def test_the_warning_says_what_happened_and_what_to_check():
    dead = [_group(0, [0.0] * 8)]
    text = _watch("--metrics.no_signal_warn_steps", "1").update(dead)
    assert "no learning signal: in each of the last 1 steps every group got one reward for all its samples" in text
    assert "every sample's reward was 0" in text and "every GRPO advantage is zero" in text
    assert "`tailrace samples runs/x` prints completions beside their rewards" in text
    assert "shipped tiny model" in text and "trained only to reverse strings" in text
    own = _watch("--metrics.no_signal_warn_steps", "1", "--model.path", "/models/mine").update(dead)
    assert "tiny" not in own
    one = _watch("--metrics.no_signal_warn_steps", "1", "--sampling.group_size", "1").update([_group(0, [0.3])])
    assert "sampling.group_size is 1" in one
    greedy = _watch("--metrics.no_signal_warn_steps", "1", "--sampling.temperature", "0").update(dead)
    assert "sampling.temperature is 0" in greedy
    solved = _watch("--metrics.no_signal_warn_steps", "1").update([_group(0, [1.0] * 4), _group(1, [0.5] * 4)])
    assert "rewards 0.5, 1" in solved and "neither all solved nor all out of reach" in solved


def test_the_settings_are_checked():
    for name in ("metrics.samples_per_step", "metrics.no_signal_warn_steps", "trainer.expected_generators"):
        with pytest.raises(ValueError, match=name):
            load_config(None, [f"--{name}", "-1"])
    assert RunConfig().metrics.samples_per_step == 4 and RunConfig().metrics.no_signal_warn_steps == 5
