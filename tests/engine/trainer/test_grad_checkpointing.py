"""train.gradient_checkpointing: each decoder layer recomputes its activations in backward, in every forward
the learner runs (the HF forward of `naive`, branch-replay's own per-layer forward, packed tries): the
gradient is unchanged (float64), and autograd keeps a small fraction of the activations on a longer
sequence (bytes of the tensors saved for backward, counted by saved_tensors_hooks).
Run: pytest tests/engine/trainer/test_grad_checkpointing.py
"""

import copy

import pytest
import torch

from tailrace.engine.config import FSDPConfig, TrainConfig
from tailrace.engine.core.losses import LossNormaliser
from tailrace.engine.replay.packed import PackedForwardBackward
from tailrace.engine.replay.replay import ReplayForwardBackward
from tailrace.engine.trainer import dist
from tailrace.engine.trainer.learner import Learner, NaiveForwardBackward
from tailrace.engine.trainer.loss import LossConfig, StepLoss

STRATEGIES = {"naive": lambda: NaiveForwardBackward(4096, 5), "replay": lambda: ReplayForwardBackward(5),
              "packed": lambda: PackedForwardBackward(4096, 5)}


@pytest.fixture(scope="module")
def checkpointed_pair(exact_model):
    def checkpointed_pair(arch="llama", **extra):
        """The same weights twice: plain, and with gradient checkpointing installed as the learner does."""
        plain = dist.shard_model(exact_model(arch, **extra), FSDPConfig())
        checkpointed = dist.shard_model(exact_model(arch, **extra), FSDPConfig(), checkpointing=True)
        return plain, checkpointed

    return checkpointed_pair


def grads_and_saved_bytes(model, samples, strategy):
    """Flat gradient, and the bytes of every distinct storage autograd saved for backward outside the
    checkpointed layers (the tensors stay referenced until the end, so no storage is counted twice)."""
    saved: list[torch.Tensor] = []

    def pack(t):
        saved.append(t)
        return t

    model.zero_grad(set_to_none=True)
    loss_fn = StepLoss(samples, LossConfig(is_cap=50.0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        strategy(model, samples, loss_fn, LossNormaliser.from_samples(samples))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return torch.cat([p.grad.flatten() for p in model.parameters()]), sum(storages.values())


@pytest.mark.parametrize("mode", sorted(STRATEGIES))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_checkpointing_keeps_the_gradient_float64(mode, arch, checkpointed_pair, group_samples, rel_err):
    plain, checkpointed = checkpointed_pair(arch)
    samples = group_samples(3)
    expected, _ = grads_and_saved_bytes(plain, samples, STRATEGIES[mode]())
    got, _ = grads_and_saved_bytes(checkpointed, samples, STRATEGIES[mode]())
    assert rel_err(got, expected) <= 1e-9, rel_err(got, expected)


@pytest.mark.parametrize("mode", sorted(STRATEGIES))
def test_checkpointing_saves_activations_on_a_long_sequence(mode, checkpointed_pair, make_samples):
    plain, checkpointed = checkpointed_pair()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 8, (160,), generator=gen).tolist()
    samples = make_samples([prompt + torch.randint(0, 8, (64,), generator=gen).tolist() for _ in range(2)], [160, 160])
    _, plain_bytes = grads_and_saved_bytes(plain, samples, STRATEGIES[mode]())
    _, checkpointed_bytes = grads_and_saved_bytes(checkpointed, samples, STRATEGIES[mode]())
    print(f"{mode}: saved for backward {plain_bytes / 2**20:.2f} MiB plain, "
          f"{checkpointed_bytes / 2**20:.2f} MiB checkpointed")
    assert checkpointed_bytes * 4 < plain_bytes


@pytest.mark.parametrize("replay", ["naive", "replay"])
def test_learner_step_with_checkpointing_and_ppo_epochs_is_the_same(replay, exact_model, rel_err, ppo_clip,
                                                                    ppo_groups):
    """Also the proximal forward (no autograd) runs through the checkpointed layers."""
    base = exact_model("qwen2")
    params = []
    for checkpointing in (False, True):
        model = copy.deepcopy(base)
        config = TrainConfig(lr=3e-2, replay=replay, ppo_epochs=2, minibatches=2, micro_batch_tokens=64,
                             gradient_checkpointing=checkpointing, **ppo_clip)
        Learner(model, config).step(ppo_groups())
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    before = torch.cat([p.detach().flatten() for p in base.parameters()])
    assert rel_err(params[1] - before, params[0] - before) <= 1e-9
