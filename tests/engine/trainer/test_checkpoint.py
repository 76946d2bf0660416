"""Checkpoints: exact resume (weights, optimizer, schedule, RNG), transformers compatibility, atomicity."""

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from tailrace.engine.config import TrainConfig
from tailrace.engine.trainer import checkpoint
from tailrace.engine.trainer.learner import Learner

torch.set_num_threads(1)
VOCAB = 64


def config():
    # Dropout makes every step consume the torch RNG, so a resume that forgot RNG state would diverge.
    return TrainConfig(lr=1e-2, weight_decay=0.1, lr_schedule="cosine", warmup_steps=1, steps=4,
                       micro_batch_tokens=24, seed=7, replay="naive")


def test_resume_is_exact(tmp_path, checkpoint_batches, tied_model):
    data = checkpoint_batches(4)
    straight = Learner(tied_model(0, dropout=0.2), config())
    for batch in data:
        straight.step(batch)

    first = Learner(tied_model(0, dropout=0.2), config())
    for batch in data[:2]:
        first.step(batch)
    folder = checkpoint.save(tmp_path, first, data_position={"epoch": 0, "next": 12}, counters={"trained": 12})
    assert folder.name == "step_000002"

    # A fresh process: different initial weights, fresh optimizer and RNG; load must overwrite all of it.
    torch.manual_seed(1234)
    resumed = Learner(tied_model(123, dropout=0.2), config())
    state = checkpoint.load(folder, resumed)
    assert state["data_position"] == {"epoch": 0, "next": 12} and state["counters"] == {"trained": 12}
    assert (resumed.step_count, resumed.policy_version) == (2, 2)
    for batch in data[2:]:
        resumed.step(batch)

    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    opt_a, opt_b = straight.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert opt_a["param_groups"] == opt_b["param_groups"]
    for key, state_a in opt_a["state"].items():
        for field, value in state_a.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b["state"][key][field])), field
    assert straight.scheduler.state_dict() == resumed.scheduler.state_dict()


def test_rng_states_round_trip(tmp_path, tied_model):
    learner = Learner(tied_model(0), TrainConfig(replay="naive"))
    folder = checkpoint.save(tmp_path, learner, data_position={})
    expected = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    torch.manual_seed(99), np.random.seed(99), random.seed(99)
    checkpoint.load(folder, Learner(tied_model(1), TrainConfig(replay="naive")))
    # Learner() reseeds; load must bring back the streams as they were at save time.
    got = (torch.rand(3), np.random.rand(3), [random.random() for _ in range(3)])
    assert torch.equal(expected[0], got[0]) and np.array_equal(expected[1], got[1]) and expected[2] == got[2]


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB - 1)} | {"<unk>": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_checkpoint_loads_with_transformers(tmp_path, tied_model, checkpoint_batches):
    learner = Learner(tied_model(0), TrainConfig(lr=1e-2, replay="naive"))
    learner.step(checkpoint_batches(1)[0])
    folder = checkpoint.save(tmp_path, learner, data_position={}, tokenizer=_tokenizer())
    assert any(p.suffix == ".safetensors" for p in folder.iterdir())
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    for name, tensor in learner.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    learner.step(checkpoint_batches(2)[1])
    checkpoint.save(tmp_path, learner, data_position={})
    newest = AutoModelForCausalLM.from_pretrained(tmp_path / "latest")  # what the docs tell a user to load
    for name, tensor in learner.model.state_dict().items():
        assert torch.equal(newest.state_dict()[name], tensor), name
    assert (tmp_path / "latest").resolve() == (tmp_path / "step_000002").resolve()
    assert checkpoint.latest(tmp_path).name == "step_000002"  # latest is not a checkpoint of its own
    # (AutoTokenizer would pick Qwen2's tokenizer class from config.json, which this toy vocabulary is not.)
    assert PreTrainedTokenizerFast.from_pretrained(folder)("t3 t5")["input_ids"] == [3, 5]


def test_atomic_save_keep_last_and_latest(tmp_path, checkpoint_batches, tied_model):
    learner = Learner(tied_model(0), TrainConfig(lr=1e-2, replay="naive"))
    data = checkpoint_batches(3)
    (tmp_path / ".tmp-step_000009").mkdir()  # a crashed save's leftover is never a checkpoint
    (tmp_path / "step_000008").mkdir()  # nor is a folder without trainer_state.json
    assert checkpoint.latest(tmp_path) is None
    for batch in data:
        learner.step(batch)
        checkpoint.save(tmp_path, learner, data_position={"step": learner.step_count}, keep_last=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_000002", "step_000003"]
    assert checkpoint.latest(tmp_path).name == "step_000003"
    assert not list(tmp_path.glob(".tmp-step_00000[1-3]"))
    # Saving the same step again replaces it whole.
    again = checkpoint.save(tmp_path, learner, data_position={"again": True}, keep_last=2)
    assert checkpoint.load(again, Learner(tied_model(1), TrainConfig(replay="naive")))["data_position"] == {"again": True}
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint.load(tmp_path / "step_000008", learner)
    with pytest.raises(ValueError, match="keep_last"):
        checkpoint.save(tmp_path, learner, data_position={}, keep_last=0)
