"""The DPO trainer mode: pairs from JSONL, gradients equal to the naive DPO ones through the learner the
trainer uses, the margin rising on the shipped tiny model, exact resume, data.epochs passes (shuffled,
resumable inside an epoch), the data.chat_template saved with the checkpoint's tokenizer, and `tailrace
trainer`/`run` as real processes (checkpoint loadable by transformers, metrics.jsonl, summary.json, --resume).
"""

import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tailrace.engine.config import DataConfig, TrainConfig, load_config
from tailrace.engine.core import models
from tailrace.engine.core.samples import TrainSample
from tailrace.engine.data.dpo_pairs import PairSource, PreferencePair
from tailrace.engine.trainer.dpo_loop import DPOLearner, DPOTrainer, pair_samples
from tailrace.engine.trainer.learner import sample_logprobs

ROOT = Path(__file__).resolve().parents[3]
torch.set_num_threads(1)


class CharTokenizer:
    eos_token_id = 2

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) % 50 + 4 for c in text]


def write_pairs(path, num_pairs, seed=0):
    """Prompts asking to reverse a string; chosen is the reversal, rejected the string itself."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_pairs):
        text = "".join(rng.choice("abcdefgh") for _ in range(6))
        rows.append({"prompt": f"reverse: {text}=", "chosen": text[::-1], "rejected": text})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dpo_config(tmp_path, data, *extra):
    return load_config(None, ["--train.algorithm", "dpo", "--data.source", str(data), "--train.lr", "1e-3",
                              "--train.groups_per_step", "4", "--trainer.runs_dir", str(tmp_path / "runs"),
                              "--trainer.run_name", "dpo", *extra])


def test_config_validates_algorithm_and_beta():
    for overrides, match in ((["--train.algorithm", "ppo"], "train.algorithm"),
                             (["--train.dpo_beta", "0"], "train.dpo_beta"),
                             (["--train.algorithm", "dpo", "--train.replay", "naive"], "train.replay")):
        with pytest.raises(ValueError, match=match):
            load_config(None, overrides)
    assert load_config(None, []).train.algorithm == "grpo"


def test_pairs_tokenized_like_prompts_with_eos_resumable_and_too_long_skipped(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "ab", "chosen": "c", "rejected": "dd"}, {"prompt": "x" * 30, "chosen": "y", "rejected": "z"},
            {"prompt": "e", "chosen": "f", "rejected": "g"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    source = PairSource(DataConfig(source=str(path)), CharTokenizer(), max_tokens=10)
    tok = CharTokenizer()
    first = next(source)
    assert first == PreferencePair(0, tok.encode("ab"), tok.encode("c", False) + [2], tok.encode("dd", False) + [2])
    assert [p.index for p in source.take(5)] == [2] and source.skipped_too_long == 1 and source.position == 3
    resumed = PairSource(DataConfig(source=str(path)), CharTokenizer(), max_tokens=10, position=1)
    assert [p.index for p in resumed] == [2]


def test_pairs_from_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "ab", "chosen": "c", "rejected": "d"}]), path)
    (pair,) = PairSource(DataConfig(source=str(path), prompt_field="q"), CharTokenizer(), max_tokens=10)
    assert pair.prompt_ids == CharTokenizer().encode("ab") and pair.rejected_ids[-1] == 2


@pytest.mark.parametrize("row, match", [
    ({"prompt": "a", "chosen": "b"}, "row 1 of .*: field 'rejected' must be a non-empty string, got missing"),
    ({"prompt": "a", "chosen": 3, "rejected": "c"}, "row 1 .* field 'chosen' .* got int '3'"),
    ({"text": "a", "chosen": "b", "rejected": "c"}, "row 1 .* field 'prompt' .*set data.prompt_field"),
])
def test_bad_rows_name_the_row_and_field(tmp_path, row, match):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=match):
        list(PairSource(DataConfig(source=str(path)), CharTokenizer(), max_tokens=100))
    with pytest.raises(ValueError, match="needs a .jsonl"):
        PairSource(DataConfig(), CharTokenizer(), max_tokens=100)


@pytest.mark.parametrize("replay", ["replay", "packed", "auto"])
def test_learner_gradient_equals_naive_dpo_gradient(replay, exact_model, naive_dpo_grads, cached_exact_model,
                                                    rel_err, exact_vocab):
    """DPOLearner.backward (what the trainer mode runs, reference log-probs over the trie included) gives
    the gradient of the DPO loss backpropagated through naive per-sample forwards."""
    gen = torch.Generator().manual_seed(3)
    pairs = []
    for i in range(3):
        prompt = torch.randint(0, exact_vocab, (6,), generator=gen).tolist()
        pairs.append(PreferencePair(i, prompt, *(torch.randint(0, exact_vocab, (n,), generator=gen).tolist()
                                                 for n in (5, 3))))
    pairs.append(PreferencePair(3, pairs[0].prompt_ids, [1, 2], [1, 3]))  # shares a prompt with pair 0
    ref = exact_model("llama", seed=1)  # a reference unlike the policy, so that its log-probs matter
    model = copy.deepcopy(cached_exact_model("llama"))
    learner = DPOLearner(model, TrainConfig(replay=replay, micro_batch_tokens=64, dpo_beta=0.5), ref_model=ref)
    samples, stats = learner.backward(pairs)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    ref_S = torch.stack([lp.sum() for lp in sample_logprobs(ref, samples, micro_batch_tokens=4096, chunk_rows=7)])
    expected, expected_loss = naive_dpo_grads(model, samples, [(2 * i, 2 * i + 1) for i in range(4)], ref_S.double(), 0.5)
    assert rel_err(got, expected) <= 1e-9
    assert float(stats["loss_dpo"]) == pytest.approx(expected_loss, rel=1e-12)
    assert float(stats["unique_tokens"]) < float(stats["logical_tokens"])  # shared prompts ran once


@pytest.mark.parametrize("replay", ["packed", "replay"])
def test_lockstep_path_gives_the_naive_dpo_gradient(replay, exact_model, naive_dpo_grads, cached_exact_model,
                                                    rel_err, exact_vocab):
    """The trie strategies in lock step (engine/replay/layered.py, what per-layer FSDP runs on several ranks):
    DPO's sequence log-probs by packs, one root call per pack, padding micro-batches after the agreed count
    (here one more than this rank's: a zero-weight pack that must not change the gradient)."""
    from tailrace.engine.core.lockstep import Lockstep
    from tailrace.engine.replay import STRATEGIES, layered
    from tailrace.engine.replay.dpo_loss import DPOLoss, sequence_logprobs
    from tailrace.engine.trainer.learner import zero_weight_loss
    from tailrace.engine.trainer.loss import LossNormaliser

    gen = torch.Generator().manual_seed(4)
    pairs = [PreferencePair(i, torch.randint(0, exact_vocab, (5,), generator=gen).tolist(),
                            *(torch.randint(0, exact_vocab, (n,), generator=gen).tolist() for n in (4, 2)))
             for i in range(3)]
    samples = pair_samples(pairs, 0)
    ref = exact_model("llama", seed=1)
    model = copy.deepcopy(cached_exact_model("llama")).train()
    ref_S = sequence_logprobs(ref, samples, 7)
    pads = []

    def pad(backward):
        pads.append(backward)
        with torch.set_grad_enabled(backward):
            loss = zero_weight_loss(model)
        if backward:
            loss.backward()

    lockstep = Lockstep(agree_max=lambda v: [v[0] + 1, *v[1:]], pad=pad, check=lambda entries: None)
    loss_fn = DPOLoss([(2 * i, 2 * i + 1) for i in range(3)], ref_S, beta=0.5)
    strategy = STRATEGIES[replay](TrainConfig(replay=replay, micro_batch_tokens=64, logprob_chunk_tokens=7))
    stats = layered.run_in_lockstep(strategy, model, samples, loss_fn, LossNormaliser.from_samples(samples),
                                    lockstep, chunk_rows=7)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    expected, expected_loss = naive_dpo_grads(model, samples, [(2 * i, 2 * i + 1) for i in range(3)],
                                              ref_S.double(), 0.5)
    assert rel_err(got, expected) <= 1e-9
    assert float(stats["loss_dpo"]) == pytest.approx(expected_loss, rel=1e-12)
    assert pads == [True]  # one padding pack; the sequence log-probs ran on no padding (none agreed)


def test_policy_equal_to_reference_has_zero_margin(cached_exact_model):
    samples_model = cached_exact_model("llama")
    learner = DPOLearner(copy.deepcopy(samples_model), TrainConfig(replay="replay", dpo_beta=0.1))
    metrics = learner.step([PreferencePair(0, [1, 2, 3], [4, 5], [6])])
    assert metrics["trainer/dpo/reward_margin"] == pytest.approx(0.0, abs=1e-12)
    assert metrics["trainer/dpo/loss"] == pytest.approx(0.6931471805599453, rel=1e-9)  # log 2
    assert len(pair_samples([PreferencePair(0, [1], [2], [3])], 7)) == 2


def held_out_margins(policy, rows):
    """log-ratio(chosen) - log-ratio(rejected) of each row, policy vs the shipped tiny model, computed
    apart from the trainer (naive forwards, own tokenization), so no bookkeeping of it can hide a swap."""
    tok = models.load_tokenizer("tiny")
    ref = models.load_model("tiny")
    samples = [TrainSample(group_id=0, sample_id=0, prompt_ids=tok.encode(row["prompt"]),
                           completion_ids=tok.encode(row[key], add_special_tokens=False) + [tok.eos_token_id],
                           behaviour_logprobs=torch.zeros(len(row[key]) + 1),
                           policy_versions=torch.zeros(len(row[key]) + 1, dtype=torch.int64), reward=0.0)
               for row in rows for key in ("chosen", "rejected")]
    policy_lp, ref_lp = (sample_logprobs(m, samples, micro_batch_tokens=4096, chunk_rows=64) for m in (policy, ref))
    ratio = [float(p.sum() - r.sum()) for p, r in zip(policy_lp, ref_lp, strict=True)]
    return [c - r for c, r in zip(ratio[0::2], ratio[1::2], strict=True)]


def test_dpo_steps_raise_the_margin_on_the_tiny_model(tmp_path):
    """Each step's figures are on pairs it has not trained on yet (measured before its update): the margin
    starts at 0 (policy = reference) and grows; the tiny model learns to prefer the reversal, also on
    pairs it never saw."""
    data = write_pairs(tmp_path / "pairs.jsonl", 24)
    trainer = DPOTrainer(dpo_config(tmp_path, data, "--train.steps", "5"))
    summary = trainer.run()
    margins, accuracies = summary["step_reward_margins"], summary["step_accuracies"]
    assert abs(margins[0]) < 1e-6
    assert margins[-1] > 0.2 and accuracies[-1] >= 0.75, (margins, accuracies)
    assert summary["replay_saving"] > 1.5 and summary["pairs_trained"] == 20
    held_out = write_pairs(tmp_path / "held_out.jsonl", 8, seed=1).read_text().splitlines()
    margins = held_out_margins(trainer.learner.model, [json.loads(line) for line in held_out])
    assert sum(m > 0 for m in margins) >= 6 and sum(margins) > 0, margins


def test_resume_continues_at_the_data_position(tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", 16)
    straight = DPOTrainer(dpo_config(tmp_path, data, "--train.steps", "3", "--trainer.run_name", "straight"))
    straight.run()
    DPOTrainer(dpo_config(tmp_path, data, "--train.steps", "2")).run()
    resumed = DPOTrainer(dpo_config(tmp_path, data, "--train.steps", "3"), resume=True)
    assert resumed.source.position == 8
    summary = resumed.run()
    assert summary["steps"] == 3 and summary["rows_consumed"] == 12 and summary["pairs_trained"] == 12
    for a, b in zip(straight.learner.model.parameters(), resumed.learner.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    lines = [json.loads(line) for line in (tmp_path / "runs" / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert summary["step_reward_margins"] == pytest.approx(straight.summary()["step_reward_margins"], rel=1e-4, abs=1e-6)


def test_pairs_are_read_data_epochs_times_in_a_new_order_each_and_resume_inside_an_epoch(tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", 6)
    cfg = DataConfig(source=str(data), epochs=3, shuffle=True, seed=4)
    pairs = PairSource(cfg, CharTokenizer(), max_tokens=100).take(100)
    assert len(pairs) == 18 and [p.index for p in pairs] == list(range(18))
    epochs = [[tuple(p.prompt_ids) for p in pairs[i:i + 6]] for i in (0, 6, 12)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs) and len({tuple(e) for e in epochs}) == 3
    resumed = PairSource(cfg, CharTokenizer(), max_tokens=100, position=8).take(100)
    assert [tuple(p.prompt_ids) for p in resumed] == [tuple(p.prompt_ids) for p in pairs[8:]]
    assert PairSource(cfg, CharTokenizer(), max_tokens=100).exhausted_text() == \
        "data exhausted after 3 epochs of 6 rows (data.epochs = 3)"


def test_a_dpo_run_honours_data_epochs(tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", 8)
    summary = DPOTrainer(dpo_config(tmp_path, data, "--train.steps", "100", "--data.epochs", "2")).run()
    assert summary["steps"] == 4 and summary["pairs_trained"] == 16 and summary["rows_consumed"] == 16
    assert summary["stop_reason"] == "no more pairs: data exhausted after 2 epochs of 8 rows (data.epochs = 2)"
    lines = [json.loads(line) for line in (tmp_path / "runs" / "dpo" / "metrics.jsonl").read_text().splitlines()]
    assert [m["trainer/data/epochs_done"] for m in lines] == [0, 1, 1, 2]
    assert all(m["trainer/time/elapsed_s"] > 0 for m in lines)


def test_the_chat_template_it_trained_with_is_saved_with_the_checkpoints_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    text = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }};{% endfor %}[assistant]"
    template = tmp_path / "chat.jinja"
    template.write_text(text)
    turns = [{"role": "user", "content": "rev:abc="}]
    data = tmp_path / "chat_pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": turns, "chosen": "cba", "rejected": "abc"}) + "\n" for _ in range(4)))
    summary = DPOTrainer(dpo_config(tmp_path, data, "--train.steps", "1", "--data.chat_template", str(template))).run()
    saved = AutoTokenizer.from_pretrained(summary["checkpoint"])
    assert saved.chat_template == text
    assert saved.apply_chat_template(turns, tokenize=False) == "[user]rev:abc=;[assistant]"
    assert not models.load_tokenizer("tiny").chat_template  # the shipped one has none: it came from the run


def _cli(args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "tailrace.engine.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_tailrace_run_then_trainer_resume_as_processes(tmp_path):
    data = write_pairs(tmp_path / "pairs.jsonl", 12)
    config = tmp_path / "dpo.toml"
    config.write_text(f'[train]\nalgorithm = "dpo"\ndpo_beta = 0.1\ngroups_per_step = 2\nsteps = 2\nlr = 1e-3\n'
                      f'[data]\nsource = "{data}"\n[trainer]\nrun_name = "cli"\nruns_dir = "{tmp_path / "runs"}"\n')
    first = _cli(["run", "--config", str(config), "--no-progress"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "no generators" in first.stdout
    resumed = _cli(["trainer", "--config", str(config), "--resume", "--train.steps", "3"], tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_dir = tmp_path / "runs" / "cli"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["rows_consumed"] == 6 and summary["algorithm"] == "dpo"
    assert json.loads(resumed.stdout.strip().splitlines()[-1])["steps"] == 3
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for key in ("loss", "reward_margin", "accuracy", "chosen_reward", "rejected_reward"):
        assert all(f"trainer/dpo/{key}" in m for m in metrics)
    folder = run_dir / "checkpoint" / "step_000003"
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["data_position"] == {"rows_consumed": 6} and state["policy_version"] == 3
    AutoModelForCausalLM.from_pretrained(folder)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tailrace_run_of_dpo_on_two_trainer_ranks(tmp_path):
    """`tailrace run` with launch.trainer_ranks = 2 trains DPO under torchrun (each rank its share of a
    step's pairs): rank 0's metrics are one rank's (float32), its checkpoint (saved by both ranks) resumes
    on one rank."""
    data = write_pairs(tmp_path / "pairs.jsonl", 12)
    args = ["--train.algorithm", "dpo", "--data.source", str(data), "--train.lr", "1e-3", "--train.groups_per_step",
            "3", "--train.steps", "3", "--trainer.runs_dir", str(tmp_path / "runs")]
    DPOTrainer(load_config(None, [*args, "--trainer.run_name", "one"])).run()
    proc = _cli(["run", *args, "--trainer.run_name", "two", "--launch.trainer_ranks", "2", "--no-progress"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "on 2 trainer ranks (torchrun)" in proc.stdout
    lines = {name: [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
             for name in ("one", "two")}
    assert [m["step"] for m in lines["two"]] == [1, 2, 3]  # rank 0's lines only
    for key in ("trainer/dpo/loss", "trainer/dpo/reward_margin", "trainer/grad/norm", "trainer/tokens/logical"):
        assert [m[key] for m in lines["two"]] == pytest.approx([m[key] for m in lines["one"]], rel=1e-3, abs=1e-5), key
    summary = json.loads((tmp_path / "runs" / "two" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["pairs_trained"] == 9
    state = json.loads((tmp_path / "runs" / "two" / "checkpoint" / "step_000003" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["data_position"] == {"rows_consumed": 9}
    resumed = DPOTrainer(load_config(None, [*args, "--trainer.run_name", "two", "--train.steps", "4"]), resume=True)
    assert resumed.run()["steps"] == 4
