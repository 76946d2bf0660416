"""What generator.speculation "auto" runs on the torch backend: on a CPU the model-free suffix drafter, and
the EAGLE drafter only from a given one (never trained in idle turns, which would take the cores the
trainer runs on); elsewhere, and with "on", both drafters with idle-time training. Tested on the real
GeneratorService path that builds the bandit and the spot trainer."""

import torch

from tailrace.engine.config import load_config
from tailrace.engine.core.drafter import Drafter
from tailrace.engine.generator.interface import speculation_drafters, spot_training, torch_backend
from tailrace.engine.generator.service import GeneratorService


def arms(gen: GeneratorService) -> set[str]:
    return {arm.drafter for arm in gen.bandit.arms if arm.k}


def test_auto_on_a_cpu_drafts_model_free_and_trains_no_drafter():
    cfg = load_config(None, [])
    gen = GeneratorService(cfg, "tcp://127.0.0.1:1")
    assert gen.backend.device.type == "cpu"
    assert arms(gen) == {"suffix"} and gen.spot is None and gen.spot_thread is None
    assert gen.drafter_store is None  # nothing trained, nothing to share
    # No drafter model either: none of its cache layer, column states or per-step bookkeeping.
    kv = gen.backend.rows.kv
    assert gen.backend.drafter is None and not kv.column_states
    assert len(kv.keys) == gen.backend.model.config.num_hidden_layers


def test_auto_on_a_cpu_uses_a_given_drafter_without_training_it(tmp_path):
    cfg = load_config(None, [])
    backend = torch_backend(cfg)
    Drafter.for_policy(backend.model, seed=1).save(tmp_path / "drafter")
    given = load_config(None, ["--generator.drafter_path", str(tmp_path / "drafter")])
    gen = GeneratorService(given, "tcp://127.0.0.1:1")
    assert arms(gen) == {"eagle", "suffix"} and gen.spot is None


def test_on_and_a_gpu_train_the_drafter_in_idle_turns():
    on = load_config(None, ["--generator.speculation", "on"])
    gen = GeneratorService(on, "tcp://127.0.0.1:1")
    assert arms(gen) == {"eagle", "suffix"} and gen.spot is not None
    gen.spot_thread.shutdown()
    backend = torch_backend(load_config(None, []))
    backend.device = torch.device("cuda")  # the rule reads the device only: a generator that owns its GPU
    auto = load_config(None, [])
    assert speculation_drafters(auto, backend) == ("eagle", "suffix") and spot_training(auto, backend)
    assert speculation_drafters(load_config(None, ["--generator.speculation", "suffix"]), backend) == ("suffix",)
