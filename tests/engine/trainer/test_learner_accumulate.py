"""Learner.accumulate: the forward/backward of a step's complete groups run early, while its other groups are
still generated, give the same gradient, update and loss as the whole step at once (float64, 1e-9), under
both aggregations and the branch-replay strategy. Run: pytest tests/engine/trainer/test_learner_accumulate.py

The increments are summed under normaliser 1 and scaled by 1 / (step's tokens or samples) at the end.
Hugging Face's RMSNorm computes in float32 even in a float64 model, so a scale that is not a power of two
rounds differently (about 1e-7 relative): the 1e-9 cases use counts that make it one (64 tokens, 16
samples), and one case checks an arbitrary count at float32 precision.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tailrace.engine.config import TrainConfig
from tailrace.engine.trainer.learner import Learner


def _learner(model, aggregation: str, replay: str) -> Learner:
    # SGD-like AdamW settings do not matter: the grad norm before clipping is compared, and the weights after.
    cfg = TrainConfig(lr=1e-2, max_grad_norm=0.0, replay=replay, loss_agg=aggregation, is_cap=50.0)
    return Learner(copy.deepcopy(model), cfg)


@pytest.mark.parametrize("aggregation,group_size,replay,rel", [
    ("token_mean", 3, "naive", 1e-9), ("sample_mean", 4, "naive", 1e-9), ("token_mean", 3, "replay", 1e-9),
    ("sample_mean", 3, "naive", 1e-6)])
def test_accumulated_groups_give_the_same_step(aggregation, group_size, replay, rel, learner_model,
                                               learner_groups):
    model = learner_model("llama", torch.float64)
    whole, early = _learner(model, aggregation, replay), _learner(model, aggregation, replay)
    expected = whole.step(learner_groups(5, num_groups=4, group_size=group_size))
    batch = learner_groups(5, num_groups=4, group_size=group_size)
    assert early.accumulate([batch[2]]) and early.accumulate([batch[0], batch[3]])
    got = early.step(batch)
    assert got["trainer/accumulated_groups"] == 3.0
    for key in ("trainer/grad/norm", "trainer/loss/pg", "trainer/loss/total", "trainer/tokens/loss"):
        assert got[key] == pytest.approx(expected[key], rel=rel, abs=1e-12), key
    for (name, a), b in zip(whole.model.named_parameters(), early.model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=rel, atol=1e-12 if rel < 1e-6 else 1e-5, msg=name)  # Adam amplifies grads near eps
    # the next step starts clean: nothing accumulated carries over
    again_whole = whole.step(learner_groups(6, num_groups=2, group_size=3))
    again_early = early.step(learner_groups(6, num_groups=2, group_size=3))
    assert again_early["trainer/grad/norm"] == pytest.approx(again_whole["trainer/grad/norm"], rel=max(rel, 1e-6))


def test_a_batch_without_the_accumulated_groups_is_refused(learner_groups, learner_model):
    learner = _learner(learner_model("llama", torch.float64), "token_mean", "naive")
    batch = learner_groups(7, num_groups=3, group_size=2)
    learner.accumulate([batch[0]])
    with pytest.raises(ValueError, match="accumulate"):
        learner.step(batch[1:])
