"""LoRA (engine/trainer/lora.py): config, branch-replay and packed gradients on the adapters equal the naive
ones (float64, 1e-9), only adapters train, generators get merged weights with the peft model's logits,
checkpoints hold adapter + merged model and resume exactly."""

import copy
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from tailrace.engine.config import LoRAConfig, TrainConfig, load_config
from tailrace.engine.core.losses import LossNormaliser
from tailrace.engine.replay.packed import PackedForwardBackward
from tailrace.engine.replay.replay import ReplayForwardBackward
from tailrace.engine.trainer import checkpoint, lora
from tailrace.engine.trainer.learner import Learner, NaiveForwardBackward
from tailrace.engine.trainer.loss import LossConfig, StepLoss

peft = pytest.importorskip("peft")
torch.set_num_threads(1)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapted(exact_model):
    def adapted(arch="llama", targets=("q_proj", "v_proj"), r=4, seed=0, dtype=torch.float64):
        """A tiny model with adapters whose B is random too (peft starts B at 0, where A gets no gradient)."""
        model = exact_model(arch, dtype, seed=seed)
        wrapped = lora.attach(model, LoRAConfig(r=r, alpha=8.0, target_modules=targets))
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
        return model, wrapped

    return adapted


def adapter_grads(model, samples, strategy, loss_fn):
    model.zero_grad(set_to_none=True)
    strategy(model, samples, loss_fn, LossNormaliser.from_samples(samples))
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in model.parameters() if not p.requires_grad)
    return torch.cat([p.grad.flatten() for n, p in model.named_parameters() if p.requires_grad])


@pytest.mark.parametrize("arch,targets", [("llama", ("q_proj", "v_proj")), ("qwen3", ALL), ("qwen2", ALL)])
@pytest.mark.parametrize("budget", [None, 0])
def test_replay_and_packed_adapter_gradients_equal_naive(arch, targets, budget, adapted, group_samples,
                                                         rel_err, ppo_loss):
    """Budget 0 recomputes every inner segment at close (through the adapters as well)."""
    model, _ = adapted(arch, targets)
    samples = group_samples(5)
    make_loss = lambda: ppo_loss(samples, model)  # noqa: E731
    ref = adapter_grads(model, samples, NaiveForwardBackward(100_000, 7), make_loss())
    replay = adapter_grads(model, samples, ReplayForwardBackward(5, activation_budget_bytes=budget), make_loss())
    packed = adapter_grads(model, samples, PackedForwardBackward(64, 5), make_loss())
    assert float(ref.norm()) > 0
    assert rel_err(replay, ref) <= 1e-9, rel_err(replay, ref)
    assert rel_err(packed, ref) <= 1e-9, rel_err(packed, ref)


def test_naive_reference_is_the_per_sample_gradient(adapted, group_samples, rel_err):
    """The naive strategy through peft's modules is the sum of each sample's own gradient."""
    model, _ = adapted("llama", ALL)
    samples = group_samples(6)
    loss = StepLoss(samples, LossConfig(aggregation="sample_mean"))
    together = adapter_grads(model, samples, NaiveForwardBackward(100_000, 7), loss)
    normaliser = LossNormaliser.from_samples(samples)
    model.zero_grad(set_to_none=True)
    for s in samples:
        NaiveForwardBackward(100_000, 7)(model, [s], StepLoss([s], LossConfig(aggregation="sample_mean")),
                                         normaliser)
    alone = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    assert rel_err(together, alone) <= 1e-12


def test_only_adapters_train_and_generators_get_the_peft_models_logits(checkpoint_batches, tied_model):
    model = tied_model(0).double()
    base = copy.deepcopy(model)
    learner = Learner(model, TrainConfig(lr=5e-2, seed=3, replay="naive"),
                      lora_config=LoRAConfig(r=4, target_modules=ALL))
    adapter_ids = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    assert {id(p) for g in learner.optimizer.param_groups for p in g["params"]} == adapter_ids
    trainable, total = lora.parameter_counts(model)
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) and trainable < total
    for batch in checkpoint_batches(3):
        learner.step(batch)
    merged = learner.state_dict_for_broadcast()
    assert set(merged) == set(base.state_dict())  # the base model's names: a plain state dict to load
    for name, tensor in base.state_dict().items():
        if not any(f".{t}." in name for t in ALL):
            assert torch.equal(merged[name], tensor), name  # frozen weights did not move
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           base.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    assert merged["lm_head.weight"] is merged["model.embed_tokens.weight"]  # tied stays one tensor
    generator = copy.deepcopy(base)
    generator.load_state_dict(merged, strict=True)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = learner.lora.eval()(input_ids=ids).logits
        got = generator.eval()(input_ids=ids).logits
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-12


def test_checkpoint_has_adapter_and_merged_model_and_resumes_exactly(tmp_path, checkpoint_batches,
                                                                     tied_model):
    cfg = TrainConfig(lr=1e-2, weight_decay=0.1, lr_schedule="cosine", warmup_steps=1, steps=4,
                      micro_batch_tokens=24, seed=7, replay="replay")
    adapters = LoRAConfig(r=2, alpha=4.0)
    data = checkpoint_batches(4)
    straight = Learner(tied_model(0), cfg, lora_config=adapters)
    for batch in data:
        straight.step(batch)
    first = Learner(tied_model(0), cfg, lora_config=adapters)
    for batch in data[:2]:
        first.step(batch)
    folder = checkpoint.save(tmp_path, first, data_position={})
    assert (folder / "adapter" / "adapter_config.json").is_file()
    assert (folder / "adapter" / "adapter_model.safetensors").is_file()

    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = first.lora.eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "latest").eval()(input_ids=ids).logits
        adapter = peft.PeftModel.from_pretrained(tied_model(0), folder / "adapter").eval()(input_ids=ids).logits
    assert float((merged - want).abs().max()) <= 1e-5 and float((adapter - want).abs().max()) <= 1e-6

    torch.manual_seed(1234)  # a fresh process: other adapter init, fresh optimizer
    resumed = Learner(tied_model(0), cfg, lora_config=adapters)
    checkpoint.load(folder, resumed)
    for (name, a), b in zip(first.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for batch in data[2:]:
        resumed.step(batch)
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    opt_a, opt_b = straight.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert opt_a["param_groups"] == opt_b["param_groups"] and opt_a["state"].keys() == opt_b["state"].keys()
    for key, state_a in opt_a["state"].items():
        for field, value in state_a.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b["state"][key][field])), field


def test_config_inline_table_overrides_and_errors(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nlora = {r = 8, alpha = 16, target_modules = ["q_proj", "v_proj"], dropout = 0.0}\n')
    cfg = load_config(path)
    assert cfg.model.lora == LoRAConfig(r=8, alpha=16.0, target_modules=("q_proj", "v_proj"))
    assert load_config(path, ["--model.lora.r", "4", "--model.lora.target_modules", "all-linear"]).model.lora \
        == LoRAConfig(r=4, alpha=16.0, target_modules=("all-linear",))
    assert not load_config().model.lora.enabled
    with pytest.raises(ValueError, match="model.lora.r"):
        load_config(path, ["--model.lora.r", "-1"])
    with pytest.raises(ValueError, match="model.lora.dropout"):
        load_config(path, ["--model.lora.dropout", "0.1"])
    load_config(path, ["--model.lora.dropout", "0.1", "--train.replay", "naive"])


def test_errors_name_the_setting(monkeypatch, exact_model):
    with pytest.raises(ValueError, match="model.lora.target_modules"):
        lora.attach(exact_model(), LoRAConfig(r=2, target_modules=("lm_head",)))
    with pytest.raises(ValueError, match="model.lora.target_modules"):
        lora.attach(exact_model(), LoRAConfig(r=2, target_modules=("no_such_proj",)))
    assert lora.attach(exact_model(), LoRAConfig(r=0)) is None
    monkeypatch.setitem(sys.modules, "peft", None)  # as if not installed
    with pytest.raises(ValueError, match=r"model.lora: .*pip install 'tailrace\[lora\]'"):
        lora.attach(exact_model(), LoRAConfig(r=2))


def test_dpo_reference_is_the_base_model_and_only_adapters_move(exact_model):
    from tailrace.engine.data.dpo_pairs import PreferencePair
    from tailrace.engine.trainer.dpo_loop import DPOLearner

    model = exact_model("llama")
    base = copy.deepcopy(model)
    learner = DPOLearner(model, TrainConfig(lr=1e-2, replay="replay", dpo_beta=0.1), lora_config=LoRAConfig(r=2))
    assert not any("lora_" in n for n, _ in learner.ref_model.named_parameters())
    metrics = learner.step([PreferencePair(0, [1, 2, 3], [4, 5], [6]), PreferencePair(1, [1, 2], [7], [3, 3])])
    assert metrics["trainer/dpo/reward_margin"] == pytest.approx(0.0, abs=1e-12)  # B = 0: policy == base
    merged = learner.state_dict_for_broadcast()
    moved = [k for k, v in base.state_dict().items() if not torch.equal(merged[k], v)]
    assert moved and all(".q_proj." in k or ".v_proj." in k for k in moved)
