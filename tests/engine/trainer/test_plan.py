"""The memory plan (engine/trainer/plan.py) against measured peaks on tiny models, and `tailrace plan`.

Measured: the live bytes of CPU allocations (plan.live_bytes, the profiler's memory events) during a real
forward, a Learner step on one rank, and (slow) steps on two gloo ranks in both residencies
(tests/engine/trainer/plan_worker.py). Each prediction must be within 15% of the measurement.
Run: pytest tests/engine/trainer/test_plan.py  (the two-rank one: -m slow)
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tailrace.engine.cli import main as cli_main
from tailrace.engine.config import TrainConfig
from tailrace.engine.core.samples import Group, TrainSample
from tailrace.engine.trainer import plan
from tailrace.engine.trainer.learner import Learner, collate, forward_logprobs

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("plan_worker.py")
TOLERANCE = 0.15
# Activations dominate (many tokens, small weights), or weights and the LM head do (a large vocabulary).
ACTIVATION_HEAVY = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=256)
WEIGHT_HEAVY = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=4096)
CHUNK = 512


def _settings(**kw) -> plan.Settings:
    """The CPU's: float32 throughout, the plain-torch LM head."""
    return plan.Settings(**{"param_dtype": "float32", "compute_dtype": "float32", "logits_impl": "torch",
                            "logprob_chunk_tokens": CHUNK, **kw})


def _model(tiny_lm, **shape):
    model = tiny_lm("qwen2", **{**shape, "max_position_embeddings": 4096, "tie_word_embeddings": False})
    return model, plan.model_shape(model.config)


def _samples(vocab: int, lengths: list[int], seed: int) -> list[TrainSample]:
    """Samples whose padded rows (prompt 2 + completion - 1) have the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        t = n - 1
        out.append(TrainSample(group_id=seed, sample_id=i, prompt_ids=torch.randint(0, vocab, (2,), generator=gen),
                               completion_ids=torch.randint(0, vocab, (t,), generator=gen),
                               behaviour_logprobs=torch.full((t,), -3.0),
                               policy_versions=torch.zeros(t, dtype=torch.int64), reward=float(i)))
    return out


def _close(predicted: int, measured: int) -> None:
    assert abs(predicted - measured) <= TOLERANCE * measured, (
        f"predicted {predicted:,} B, measured {measured:,} B ({predicted / measured:.3f}x)")


def test_live_bytes_counts_allocations_exactly():
    with plan.live_bytes() as measured:
        a = torch.empty(1000, dtype=torch.float32)
        b = torch.empty(3000, dtype=torch.float64)
        del a
        c = torch.empty(500, dtype=torch.float32)
        del b, c
    assert measured == {"peak": 4000 + 24000, "end": 0}


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_counts_are_exact(tiny_lm, tied):
    model = tiny_lm("qwen2", tie_word_embeddings=tied, num_hidden_layers=3)
    shape = plan.model_shape(model.config)
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.tied == tied and shape.num_layers == 3


def test_shipped_qwen_configs_have_the_published_sizes():
    """Qwen2.5-7B has 7.61B parameters and Qwen2.5-32B 32.76B (their model cards)."""
    sizes = {name: plan.model_shape(plan.load_hf_config(ROOT / "examples" / "configs" / name)).num_params
             for name in ("qwen2.5-7b", "qwen2.5-32b")}
    assert sizes == {"qwen2.5-7b": 7_615_616_512, "qwen2.5-32b": 32_763_876_352}


def test_lora_counts_only_the_adapters(tiny_lm):
    peft = pytest.importorskip("peft")
    model = tiny_lm("qwen2", num_hidden_layers=2)
    shape = plan.model_shape(model.config)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    predicted = plan.predict(shape, _settings(lora_r=4, lora_targets=("q_proj", "down_proj")))
    assert predicted.trainable_params == trainable
    assert predicted.num_params == sum(p.numel() for p in wrapped.parameters())


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("lengths", [[1024], [400, 300, 200]], ids=["one-row", "padded"])
def test_activations_match_the_measured_forward(tiny_lm, checkpointing, lengths):
    """The bytes a forward leaves alive for its backward: every layer's saved tensors (a padding mask
    makes HF repeat the key/value heads, and SDPA keep the mask), or only the layers' inputs under
    activation checkpointing."""
    from tailrace.engine.config import FSDPConfig
    from tailrace.engine.trainer import dist

    model, shape = _model(tiny_lm, **ACTIVATION_HEAVY)
    dist.shard_model(model, FSDPConfig(), checkpointing=checkpointing)  # one rank: the checkpointing only
    model.train()
    mb = collate(_samples(256, lengths, 0), list(range(len(lengths))), torch.device("cpu"))
    with plan.live_bytes() as measured:
        logp_N, _ = forward_logprobs(model, mb, chunk_rows=CHUNK)
    row_tokens = mb.input_ids_BL.shape[1] if len(lengths) > 1 else 0
    s = _settings(tokens=mb.num_padded_tokens, gradient_checkpointing=checkpointing, row_tokens=row_tokens)
    _close(plan.activation_bytes(shape, s), measured["end"])
    del logp_N


@pytest.mark.parametrize("case", ["activations", "activations+ckpt", "weights"])
def test_one_rank_step_peak_matches(tiny_lm, case):
    """A Learner step of two micro-batches (the second's activations beside the first's gradients), after a
    first step made AdamW's moments: its peak above what was alive before it (weights and moments)."""
    shape_kw, tokens = (WEIGHT_HEAVY, 128) if case == "weights" else (ACTIVATION_HEAVY, 1024)
    model, shape = _model(tiny_lm, **shape_kw)
    checkpointing = case.endswith("ckpt")
    learner = Learner(model, TrainConfig(replay="naive", micro_batch_tokens=tokens, groups_per_step=1,
                                         gradient_checkpointing=checkpointing, logprob_chunk_tokens=CHUNK))
    vocab = shape_kw["vocab_size"]
    learner.step([Group(group_id=0, samples=_samples(vocab, [tokens, tokens], 0))])
    with plan.live_bytes() as measured:
        metrics = learner.step([Group(group_id=1, samples=_samples(vocab, [tokens, tokens], 1))])
    assert metrics["trainer/tokens/padded"] == 2 * tokens
    predicted = plan.predict(shape, _settings(tokens=tokens, gradient_checkpointing=checkpointing))
    _close(predicted.peak - predicted.params - predicted.optimizer, measured["peak"])


@pytest.mark.slow
def test_two_rank_step_peaks_match_both_residencies(tmp_path):
    """Two gloo ranks, FSDP2: the whole model gathered for the step (full) and per-layer FSDP2 (layer), in the
    model's float32 and with bf16 mixed precision (float32 master weights and reductions)."""
    cases = [{"tokens": tokens, "shape": shape, "mixed_precision": mp}
             for mp in ("auto", "bf16") for tokens, shape in ((1024, ACTIVATION_HEAVY), (128, WEIGHT_HEAVY))]
    out = tmp_path / "peaks.json"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=0",
         str(WORKER), "--out", str(out), "--cases", json.dumps(cases), "--chunk", str(CHUNK)],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from transformers import Qwen2Config

    for case, measured in zip(cases, json.loads(out.read_text()), strict=True):
        shape = plan.model_shape(Qwen2Config(**case["shape"], tie_word_embeddings=False))
        for residency in ("full", "layer"):
            compute = "bfloat16" if case["mixed_precision"] == "bf16" else "float32"
            p = plan.predict(shape, _settings(ranks=2, tokens=case["tokens"], residency=residency,
                                              compute_dtype=compute))
            for peak in measured[residency]:
                _close(p.peak - p.params - p.optimizer, peak)


def test_max_tokens_is_the_largest_that_fits():
    shape = plan.model_shape(plan.load_hf_config(ROOT / "examples" / "configs" / "qwen2.5-7b"))
    s = plan.Settings(ranks=8, residency="layer", gradient_checkpointing=True)
    budget = 92e9
    n = plan.max_tokens(shape, s, budget)
    assert n > 0
    assert plan.predict(shape, replace(s, tokens=n)).peak <= budget
    assert plan.predict(shape, replace(s, tokens=n + 1)).peak > budget


def test_cli_prints_both_residencies_as_json(capsys):
    config = ROOT / "examples" / "configs" / "qwen2.5-7b" / "config.json"
    assert cli_main(["plan", "--model", str(config), "--ranks", "8", "--tokens", "16384", "--device-gb", "96",
                     "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["model"]["num_params"] == 7_615_616_512
    assert [(p["residency"], p["checkpointing"]) for p in rep["plans"]] == [
        ("layer", False), ("layer", True), ("full", False), ("full", True)]
    layer, full = rep["plans"][0], rep["plans"][2]
    assert full["unsharded_params"] > layer["unsharded_params"] and full["peak"] > layer["peak"]


def test_cli_names_a_bad_model(tmp_path, capsys):
    assert cli_main(["plan", "--model", str(tmp_path / "nothing")]) == 2
    assert "--model" in capsys.readouterr().err
