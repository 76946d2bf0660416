"""The trainer on several ranks: real ranks under torchrun (gloo, CPU), each run bounded in time.

The workers (tests/engine/trainer/dist_worker.py) train a tiny model on batches of unequal groups whose split is
uneven (the second batch gives the ranks unequal pack counts, the last leaves rank 1 no samples: only padding
micro-batches under per-layer residency, only its zero-weight unit under "full"); one rank is the reference.
Depth-first replay runs across ranks only under train.fsdp.step_residency = "full" (FULL below). With
--dpo the workers run the DPO learner on preference pairs split as unevenly.
Run: pytest tests/engine/trainer/test_dist.py  (the slow ones: -m slow)
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tailrace.engine.trainer import ranks
from tailrace.engine.trainer.dist import partition

WORKER = Path(__file__).with_name("dist_worker.py")
ROOT = Path(__file__).resolve().parents[3]
RUN_TIMEOUT_S = 240
FULL = ("--step-residency", "full")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _worker(out: Path, *args: str, nproc: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "--max-restarts=0"] if nproc > 1 else [sys.executable]
    proc = subprocess.run([*launcher, str(WORKER), "--out", str(out), *args], env=_env(), capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _max_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).norm() / a[k].norm()) for k in a)


def _load_worker():
    spec = importlib.util.spec_from_file_location("dist_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker


def _train(tmp_path: Path, name: str, *args: str, nproc: int) -> dict:
    """nproc = 1 runs in this process (no process group: the plain, unsharded learner)."""
    out = tmp_path / f"{name}.pt"
    if nproc == 1:
        assert _load_worker().main(["--out", str(out), *args]) == 0
    else:
        _worker(out, *args, nproc=nproc)
    return torch.load(out, weights_only=True)


def test_partition_is_balanced_deterministic_and_whole():
    items = [9, 1, 1, 7, 3, 2, 2]
    parts = partition(items, float, 2)
    assert parts == partition(items, float, 2)
    assert sorted(x for p in parts for x in p) == sorted(items)
    assert abs(sum(parts[0]) - sum(parts[1])) <= 1
    assert partition([5], float, 3) == [[5], [], []]  # ranks without work run only the zero-weight unit


def test_batch_codec_round_trips_every_field():
    groups = _load_worker().batches()[0]
    multi_turn = groups[0].samples[0]  # a multi-turn sample: its observation tokens carry no loss term
    multi_turn.loss_mask = torch.arange(multi_turn.num_completion_tokens) % 2 == 0
    back = ranks.decode_batch(*ranks.encode_batch(groups))
    assert [g.group_id for g in back] == [g.group_id for g in groups]
    for g, h in zip(groups, back, strict=True):
        for s, t in zip(g.samples, h.samples, strict=True):
            for name in ("prompt_ids", "completion_ids", "behaviour_logprobs", "policy_versions"):
                assert torch.equal(getattr(s, name), getattr(t, name)), name
            ones = torch.ones(s.num_completion_tokens, dtype=torch.bool)
            assert torch.equal(ones if s.loss_mask is None else s.loss_mask, ones if t.loss_mask is None else t.loss_mask)
            assert (s.sample_id, s.reward, s.advantage, s.temperature) == (t.sample_id, t.reward, t.advantage,
                                                                           t.temperature)


def test_two_ranks_train_and_serve_as_one_and_checkpoints_reshard(tmp_path):
    """replay (whole-model residency), float64: 3 steps on 2 ranks == 1 rank; served weights equal; the DCP checkpoint of step 2
    on 2 ranks resumes on 1 rank to the uninterrupted run, and its HF export is the served weights."""
    from transformers import AutoModelForCausalLM

    one = _train(tmp_path, "one", nproc=1)
    two = _train(tmp_path, "two", *FULL, "--save-at", "2", "--ckpt", str(tmp_path / "ck2"), nproc=2)
    for name, tensor in one["initial"].items():  # before training the served bytes are the same
        assert torch.equal(tensor, two["initial"][name]) and tensor.dtype == two["initial"][name].dtype, name
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert _max_rel_err(a, b) < 1e-10
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-10)

    folder = tmp_path / "ck2" / "step_000002"
    exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).state_dict()
    assert _max_rel_err(two["steps"][1], {k: exported[k] for k in two["steps"][1]}) == 0.0
    resumed = _train(tmp_path, "resumed1", "--resume", str(folder), nproc=1)
    assert _max_rel_err(one["steps"][-1], resumed["steps"][-1]) < 1e-10
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and state["data_position"] == {"batch": 2}


@pytest.mark.slow
@pytest.mark.parametrize("replay,checkpointing", [("naive", False), ("packed", False), ("replay", True)])
def test_two_ranks_equal_one_rank_float64_full_residency(tmp_path, replay, checkpointing):
    args = ("--replay", replay, "--arch", "llama", *FULL)
    one = _train(tmp_path, "one", *args, nproc=1)
    two = _train(tmp_path, "two", *args, *(["--activation-checkpointing"] if checkpointing else []), nproc=2)
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert _max_rel_err(a, b) < 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("replay", ["naive", "replay"])
def test_two_ranks_equal_one_rank_with_ppo_epochs_and_minibatches(tmp_path, replay):
    """2 epochs x 2 minibatches of whole groups per step, proximal log-probs per rank: 2 ranks == 1 rank
    (the last batch's one group leaves rank 1 without samples in every pass)."""
    args = ("--replay", replay, "--ppo-epochs", "2", "--minibatches", "2", *FULL)
    one = _train(tmp_path, "one", *args, nproc=1)
    two = _train(tmp_path, "two", *args, nproc=2)
    plain = _train(tmp_path, "plain", "--replay", replay, nproc=1)
    assert _max_rel_err(plain["steps"][0], one["steps"][0]) > 1e-6  # four updates, not one
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert _max_rel_err(a, b) < 1e-10
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-10)


@pytest.mark.slow
def test_two_ranks_equal_one_rank_float32(tmp_path):
    # A larger adam_eps keeps Adam's update a smooth function of the gradient: with eps = 1e-8 an element
    # whose gradient is at float32 rounding level moves by +-lr either way, whatever the ranks do.
    args = ("--dtype", "float32", "--adam-eps", "1e-3", *FULL)
    one = _train(tmp_path, "one", *args, nproc=1)
    two = _train(tmp_path, "two", *args, nproc=2)
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert _max_rel_err(a, b) < 1e-5


@pytest.mark.slow
def test_checkpoint_of_one_rank_resumes_on_two_and_two_on_two(tmp_path):
    one = _train(tmp_path, "one", "--save-at", "2", "--ckpt", str(tmp_path / "ck1"), nproc=1)
    on_two = _train(tmp_path, "on_two", *FULL, "--resume", str(tmp_path / "ck1" / "step_000002"), nproc=2)
    assert _max_rel_err(one["steps"][-1], on_two["steps"][-1]) < 1e-10
    _train(tmp_path, "two", *FULL, "--save-at", "2", "--ckpt", str(tmp_path / "ck2"), nproc=2)
    again = _train(tmp_path, "again", *FULL, "--resume", str(tmp_path / "ck2" / "step_000002"), nproc=2)
    assert _max_rel_err(one["steps"][-1], again["steps"][-1]) < 1e-10


def _pids_running(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_a_rank_that_dies_mid_step_takes_the_trainer_down(tmp_path):
    out = tmp_path / "dies.pt"
    started = time.monotonic()
    proc = _worker(out, *FULL, "--die-at-step", "2", "--timeout-s", "20", nproc=2, check=False)
    assert proc.returncode != 0 and not out.exists()
    assert time.monotonic() - started < 120
    assert "exitcode  : 17" in proc.stderr  # torchrun names the rank that died
    deadline = time.monotonic() + 10
    while _pids_running(str(out)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _pids_running(str(out)), "a rank outlived its trainer"


@pytest.mark.slow
def test_tailrace_run_with_two_trainer_ranks(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tailrace.engine.cli", "run", "--trainer.runs_dir",
                           str(tmp_path / "runs"), "--trainer.run_name", "two", "--launch.trainer_ranks", "2",
                           "--train.steps", "20", "--no-progress"], env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "two" / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["policy_version"] == 20
    assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())
    assert min(summary["generator_policy_versions"].values()) >= 19
    assert summary["reward_last"] > summary["reward_first"], summary
    state = json.loads((tmp_path / "runs" / "two" / "checkpoint" / "step_000020" / "trainer_state.json").read_text())
    assert state["world_size"] == 2


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: 2 GPUs")
def test_two_gpu_ranks_with_nccl_equal_one(tmp_path):
    args = ("--device", "cuda", "--dtype", "float32", "--adam-eps", "1e-3", "--mixed-precision", "off", *FULL)
    one = _train(tmp_path, "one", *args, nproc=1)
    two = _train(tmp_path, "two", *args, nproc=2)
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert _max_rel_err(a, b) < 1e-5
    bf16 = _train(tmp_path, "bf16", "--device", "cuda", "--dtype", "float32", "--mixed-precision", "bf16", *FULL,
                  nproc=2)
    assert all(0 < n < float("inf") for n in bf16["grad_norms"])  # bf16 parameters, fp32 reduction
    offload = _train(tmp_path, "offload", *args, "--cpu-offload", nproc=2)
    for a, b in zip(one["steps"], offload["steps"], strict=True):
        assert _max_rel_err(a, b) < 1e-5


@pytest.mark.slow
def test_lora_on_two_ranks_equals_one_rank_and_its_checkpoint_resumes_on_one(tmp_path):
    """LoRA on every linear layer, replay, float64: the served (merged) weights of 2 ranks == 1 rank; the
    checkpoint of step 2 on 2 ranks holds the merged model and an adapter that peft loads, and resumes on
    1 rank to the uninterrupted run."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    one = _train(tmp_path, "one", "--lora", "4", nproc=1)
    two = _train(tmp_path, "two", *FULL, "--lora", "4", "--save-at", "2", "--ckpt", str(tmp_path / "ck2"), nproc=2)
    base = _load_worker().tiny_model("qwen2", torch.float64).state_dict()
    assert sorted(one["initial"]) == sorted(base)  # the base model's names, merged: no adapter tensors
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert _max_rel_err(a, b) < 1e-10
    assert _max_rel_err(base, one["steps"][-1]) > 1e-6  # the adapters moved the merged weights
    folder = tmp_path / "ck2" / "step_000002"
    exported = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    assert _max_rel_err(two["steps"][1], {k: v for k, v in exported.state_dict().items() if k in base}) < 1e-15
    ids = torch.arange(20).reshape(2, 10)
    adapted = PeftModel.from_pretrained(_load_worker().tiny_model("qwen2", torch.float64), folder / "adapter")
    with torch.no_grad():
        want, got = exported.eval()(input_ids=ids).logits, adapted.eval()(input_ids=ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-12
    resumed = _train(tmp_path, "resumed1", "--lora", "4", "--resume", str(folder), nproc=1)
    assert _max_rel_err(one["steps"][-1], resumed["steps"][-1]) < 1e-10


# ------------------------------------------------------------- per-layer residency (the default on ranks > 1)

RESIDENCY_BOUND = 0.35  # peak unsharded parameters + gradients on a rank, over P, 8 layers (issue #29)


def _assert_equal_steps(one: dict, two: dict) -> None:
    for a, b in zip(one["steps"], two["steps"], strict=True):
        assert _max_rel_err(a, b) < 1e-10
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-10)


def test_layer_residency_equals_one_rank_with_equal_collectives_and_about_a_layer_resident(tmp_path):
    """packed, 8 layers, float64, the default residency: 3 steps on 2 ranks == 1 rank (unequal pack counts,
    then a rank without samples); both ranks ran the same all-gathers and reduce-scatters in the same order,
    each unit gathered per micro-batch; no rank ever held more than RESIDENCY_BOUND x P unsharded."""
    args = ("--replay", "packed", "--layers", "8")
    one = _train(tmp_path, "one", *args, nproc=1)
    two = _train(tmp_path, "two", *args, "--instrument", nproc=2)
    _assert_equal_steps(one, two)
    rank0, rank1 = two["collectives"]
    assert rank0 == rank1
    gathers = sum(name == "all_gather_single" for name, _, _ in rank0)
    reductions = sum(name == "reduce_scatter_single" for name, _, _ in rank0)
    assert gathers >= 3 * 9 and reductions >= 3 * 9  # 8 layers + the root, at least once in each of 3 steps
    # Per micro-batch: 9 gathers in forward + the 8 layers again in backward, 9 reduce-scatters; a second
    # root call per pack (the LM head apart from the decoder) would reduce the root twice.
    assert gathers * 9 == reductions * 17
    assert 0 < max(two["unsharded_frac"]) <= RESIDENCY_BOUND


def test_an_exception_on_one_rank_mid_forward_ends_the_run_within_the_timeout(tmp_path):
    out = tmp_path / "raises.pt"
    timeout_s, grace_s = 20, 60  # grace: torchrun's start and teardown on a loaded machine
    started = time.monotonic()
    proc = _worker(out, "--replay", "packed", "--raise-at-step", "2", "--timeout-s", str(timeout_s), nproc=2,
                   check=False)
    assert proc.returncode != 0 and not out.exists()
    assert time.monotonic() - started < timeout_s + grace_s
    assert "tailrace trainer rank 1 of 2 failed: RuntimeError: injected failure in layer 0" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("replay,arch,agg,checkpointing", [
    ("naive", "llama", "token_mean", False),  # untied LM head
    ("naive", "qwen2", "sample_mean", True),  # tied
    ("packed", "qwen2", "sample_mean", True),
    ("packed", "llama", "token_mean", True),
    ("auto", "llama", "sample_mean", False),
])
def test_layer_residency_two_ranks_equal_one_rank(tmp_path, replay, arch, agg, checkpointing):
    args = ("--replay", replay, "--arch", arch, "--loss-agg", agg)
    one = _train(tmp_path, "one", *args, nproc=1)
    two = _train(tmp_path, "two", *args, "--check-schedule",
                 *(["--activation-checkpointing"] if checkpointing else []), nproc=2)
    _assert_equal_steps(one, two)


@pytest.mark.slow
@pytest.mark.parametrize("replay", ["naive", "packed"])
def test_layer_residency_ppo_epochs_minibatches_and_reference_model(tmp_path, replay):
    """2 epochs x 2 minibatches (proximal log-probs by agreed forwards) and a KL reference model sharded
    per layer: 2 ranks == 1 rank."""
    args = ("--replay", replay, "--ppo-epochs", "2", "--minibatches", "2", "--kl", "0.1")
    one = _train(tmp_path, "one", *args, nproc=1)
    two = _train(tmp_path, "two", *args, nproc=2)
    _assert_equal_steps(one, two)


@pytest.mark.slow
def test_layer_residency_lora_equals_one_rank(tmp_path):
    args = ("--replay", "packed", "--lora", "4", "--activation-checkpointing")
    _assert_equal_steps(_train(tmp_path, "one", *args, nproc=1), _train(tmp_path, "two", *args, nproc=2))


@pytest.mark.slow
def test_layer_residency_four_ranks_and_full_residency_holds_the_whole_model(tmp_path):
    """4 ranks (two without samples in the last step) == 1 rank with equal collectives; "full" residency
    measured by the same meter holds every parameter and gradient at once."""
    args = ("--replay", "naive", "--layers", "8")
    one = _train(tmp_path, "one", *args, nproc=1)
    four = _train(tmp_path, "four", *args, "--instrument", nproc=4)
    _assert_equal_steps(one, four)
    assert all(log == four["collectives"][0] for log in four["collectives"])
    assert max(four["unsharded_frac"]) <= RESIDENCY_BOUND
    full = _train(tmp_path, "full", *args, *FULL, "--instrument", nproc=2)
    assert min(full["unsharded_frac"]) == pytest.approx(2.0)


@pytest.mark.slow
def test_check_schedule_names_the_rank_whose_plan_differs(tmp_path):
    out = tmp_path / "differs.pt"
    proc = _worker(out, "--replay", "packed", "--check-schedule", "--corrupt-plan", "--timeout-s", "60", nproc=2,
                   check=False)
    assert proc.returncode != 0 and not out.exists()
    assert "train.fsdp.check_schedule: rank(s) [1] planned a schedule different from rank 0's" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("replay", ["replay", "layer_major"])
def test_replay_too_large_for_a_pack_runs_layer_major_on_every_rank(tmp_path, replay):
    """Tries larger than one pack (the worker's replay settings): replay under per-layer residency runs
    each rank's trie as one layer-major micro-batch, as train.replay = "layer_major" does every pass, with
    PPO epochs (proximal log-probs layer by layer): 2 ranks == 1 rank, the same collectives on both ranks."""
    args = ("--replay", replay, "--ppo-epochs", "2", "--minibatches", "2")
    one = _train(tmp_path, "one", *args, nproc=1)
    two = _train(tmp_path, "two", *args, "--instrument", "--check-schedule", nproc=2)
    _assert_equal_steps(one, two)
    assert two["collectives"][0] == two["collectives"][1]


def test_layer_major_refuses_full_residency(tmp_path):
    proc = _worker(tmp_path / "full.pt", "--replay", "layer_major", *FULL, "--timeout-s", "60", nproc=2, check=False)
    assert proc.returncode != 0
    assert 'train.replay = "layer_major" runs FSDP\'s per-layer schedule itself' in proc.stderr


# ---------------------------------------------------------------------------------------- DPO on ranks


@pytest.mark.parametrize("replay,residency,nproc,extra", [
    ("packed", "layer", 2, ()),
    pytest.param("replay", "layer", 2, (), marks=pytest.mark.slow),  # a pair larger than a pack: layer-major
    pytest.param("layer_major", "layer", 2, (), marks=pytest.mark.slow),
    pytest.param("replay", "full", 2, (), marks=pytest.mark.slow),  # depth-first replay, each model gathered whole
    pytest.param("auto", "layer", 4, (), marks=pytest.mark.slow),  # ranks without a pair in every step but the first
    pytest.param("packed", "layer", 2, ("--lora", "4", "--activation-checkpointing"), marks=pytest.mark.slow,
                 id="packed-layer-2-lora-checkpointing"),
])
def test_dpo_on_several_ranks_equals_one_rank(tmp_path, replay, residency, nproc, extra):
    """The DPO learner, float64, 3 steps of pairs split unevenly (the last step leaves rank 1 no pair): its
    share of the pairs on each rank, the loss the mean over all ranks' pairs, the reference model sharded
    like the policy: the weights, gradient norms and DPO losses of 2 (4) ranks == 1 rank; every rank ran
    the same collectives (the reference's log-probs included)."""
    args = ("--dpo", "--replay", replay, "--step-residency", residency, *extra)
    one = _train(tmp_path, "one", *args, nproc=1)
    many = _train(tmp_path, "many", *args, "--instrument", "--check-schedule", nproc=nproc)
    _assert_equal_steps(one, many)
    assert many["losses"] == pytest.approx(one["losses"], rel=1e-12)
    assert min(one["grad_norms"]) > 0.1  # the pairs move the policy: equal weights are not the initial ones
    assert all(log == many["collectives"][0] for log in many["collectives"])
