"""One trainer rank for tests/engine/trainer/test_dist.py: run it under torchrun (or plain python for one rank).

    python -m torch.distributed.run --nproc-per-node 2 tests/engine/trainer/dist_worker.py --replay replay --out OUT

Trains a tiny model (float64 or float32) for --steps optimizer steps on fixed batches of unequal groups
whose split across ranks is uneven (the last batch is one group: rank 1 has only its zero-weight unit);
--dpo: the DPO learner (engine/trainer/dpo_loop.py) on fixed batches of preference pairs split as unevenly
(pair_batches), against a reference model unlike the policy;
optionally saving a DCP checkpoint after --save-at steps or resuming from --resume. Rank 0 writes the
served weights (rank 0's gathered state dict) before training and after every step to OUT
(torch.save). --die-at-step N makes rank 1
exit hard in the middle of step N (after its forward, before the gradient reduction); --raise-at-step N
makes rank 1 raise in the middle of step N's first forward (inside a decoder layer). --instrument records
each rank's collectives (dist.CollectiveLog) and peak unsharded residency (dist.ResidencyMeter) into OUT.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from pathlib import Path

import torch

VOCAB = 64


def tiny_model(arch: str, dtype: torch.dtype, layers: int = 2, seed: int = 0, exact: bool = False) -> torch.nn.Module:
    """The trainer tests' learner_model (tests/engine/trainer/conftest.py) with room for 256 positions,
    from the tests' one builder, tests/tiny_lms.py, loaded by its path (this script runs outside pytest).
    exact: RMSNorms in the model's dtype (tiny_lms.exact_norms), for DPO's loss, a sigmoid of sequence sums
    that turns the float32 norm's ~1e-8 differences between pack layouts into gradient differences."""
    spec = importlib.util.spec_from_file_location("tiny_lms", Path(__file__).resolve().parents[2] / "tiny_lms.py")
    tiny_lms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_lms)
    model = tiny_lms.build(arch, seed=seed, dtype=dtype, max_position_embeddings=256,
                           tie_word_embeddings=arch == "qwen2", num_hidden_layers=layers)
    return tiny_lms.exact_norms(model) if exact else model


def batches():
    """Three batches: unequal groups, then one big and one tiny group, then a single group; odd samples have
    a loss mask (multi-turn), which crosses to the other ranks with the batch."""
    from tailrace.engine.core.samples import Group, TrainSample

    gen = torch.Generator().manual_seed(1)
    next_id = iter(range(1000))

    def group(size: int, prompt_len: int, max_completion: int) -> Group:
        gid = next(next_id)
        prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
        samples = []
        for i in range(size):
            t = int(torch.randint(1, max_completion + 1, (), generator=gen))
            shared = torch.randint(0, VOCAB, (3,), generator=gen) if i % 2 else torch.zeros(3, dtype=torch.int64)
            completion = torch.cat([shared, torch.randint(0, VOCAB, (t,), generator=gen)])
            samples.append(TrainSample(
                group_id=gid, sample_id=i, prompt_ids=prompt, completion_ids=completion,
                behaviour_logprobs=-4.0 - torch.rand(completion.numel(), generator=gen),
                policy_versions=torch.zeros(completion.numel(), dtype=torch.int64),
                reward=float(torch.rand((), generator=gen)), temperature=[1.0, 0.7][i % 2],
                # Odd samples are multi-turn: their first three tokens an observation, with no loss term.
                loss_mask=torch.arange(completion.numel()) >= 3 if i % 2 else None))
        return Group(group_id=gid, samples=samples)

    return [[group(4, 9, 6), group(2, 3, 4), group(3, 5, 8), group(1, 2, 2)],
            [group(5, 30, 10), group(2, 2, 1)],
            [group(3, 6, 5)]]


def pair_batches():
    """Three batches of preference pairs: four pairs (two share their prompt, one chosen/rejected share a
    first token), then a pair larger than one pack beside a small one, then a single pair."""
    from tailrace.engine.data.dpo_pairs import PreferencePair

    gen = torch.Generator().manual_seed(2)
    next_id = iter(range(1000))

    def ids(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    def pair(prompt: list[int], chosen: int, rejected: int) -> PreferencePair:
        return PreferencePair(next(next_id), prompt, ids(chosen), ids(rejected))

    shared = ids(7)
    first = [pair(shared, 5, 3), pair(ids(4), 2, 6), pair(shared, 4, 4), pair(ids(9), 3, 1)]
    first[1] = dataclasses.replace(first[1], rejected_ids=[first[1].chosen_ids[0], *first[1].rejected_ids[1:]])
    return [first, [pair(ids(30), 12, 10), pair(ids(3), 2, 2)], [pair(ids(6), 4, 3)]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replay", default="replay")
    ap.add_argument("--dtype", default="float64")
    ap.add_argument("--arch", default="qwen2")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--save-at", type=int, default=0)
    ap.add_argument("--resume", default="")
    ap.add_argument("--ckpt", default="")
    ap.add_argument("--die-at-step", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=60.0)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--adam-eps", type=float, default=1e-8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mixed-precision", default="auto")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--cpu-offload", action="store_true")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank on all linear layers; 0 = full model")
    ap.add_argument("--ppo-epochs", type=int, default=1)
    ap.add_argument("--minibatches", type=int, default=1)
    ap.add_argument("--step-residency", default="layer")
    ap.add_argument("--check-schedule", action="store_true")
    ap.add_argument("--loss-agg", default="token_mean")
    ap.add_argument("--kl", type=float, default=0.0, help="kl_coef: > 0 adds a reference model (a copy)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--raise-at-step", type=int, default=0)
    ap.add_argument("--instrument", action="store_true")
    ap.add_argument("--corrupt-plan", action="store_true", help="rank 1 plans one micro-batch more than agreed")
    ap.add_argument("--dpo", action="store_true", help="the DPO learner on pair_batches()")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from tailrace.engine.config import FSDPConfig, LoRAConfig, TrainConfig
    from tailrace.engine.trainer import checkpoint, dist
    from tailrace.engine.trainer.learner import Learner

    dist.init_from_env(timeout_s=args.timeout_s)
    config = TrainConfig(lr=args.lr, adam_eps=args.adam_eps, replay=args.replay, max_grad_norm=0.5, weight_decay=0.01,
                         lr_schedule="linear", steps=10, micro_batch_tokens=48, logprob_chunk_tokens=7,
                         fsdp=FSDPConfig(collective_timeout_s=args.timeout_s, mixed_precision=args.mixed_precision,
                                         cpu_offload=args.cpu_offload, step_residency=args.step_residency,
                                         check_schedule=args.check_schedule),
                         gradient_checkpointing=args.activation_checkpointing, ppo_epochs=args.ppo_epochs,
                         minibatches=args.minibatches, loss_agg=args.loss_agg, kl_coef=args.kl,
                         algorithm="dpo" if args.dpo else "grpo", dpo_beta=0.5)
    adapters = LoRAConfig(r=args.lora, target_modules=("all-linear",))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dtype = getattr(torch, args.dtype)
    ref = tiny_model(args.arch, dtype, args.layers).to(args.device) if args.kl > 0 else None
    model = tiny_model(args.arch, dtype, args.layers, exact=args.dpo).to(args.device)
    if args.dpo:
        from tailrace.engine.trainer.dpo_loop import DPOLearner

        ref = tiny_model(args.arch, dtype, args.layers, seed=1, exact=True).to(args.device)  # its log-probs matter
        learner = DPOLearner(model, config, lora_config=adapters, ref_model=ref)
    else:
        learner = Learner(model, config, lora_config=adapters, ref_model=ref)
    if args.die_at_step:
        _die_in_step(learner, args.die_at_step)
    if args.raise_at_step:
        _raise_in_step(learner, args.raise_at_step)
    if args.corrupt_plan and dist.rank() == 1:
        agree = learner._lockstep.agree_max

        def one_more(values):
            agreed = agree(values)
            return [agreed[0] + 1, *agreed[1:]]

        learner._lockstep = dataclasses.replace(learner._lockstep, agree_max=one_more)
    if args.resume:
        checkpoint.load(args.resume, learner)
    out: dict = {"steps": [], "grad_norms": [], "losses": [], "initial": learner.state_dict_for_broadcast()}
    collectives, meter = dist.CollectiveLog(), dist.ResidencyMeter(learner.model)
    for i, batch in enumerate((pair_batches() if args.dpo else batches())[: args.steps]):
        if i < learner.step_count:
            continue  # trained before the checkpoint
        if args.instrument:
            with collectives, meter:
                metrics = learner.step(batch)
        else:
            metrics = learner.step(batch)
        out["grad_norms"].append(metrics["trainer/grad/norm"])
        out["losses"].append(metrics["trainer/dpo/loss" if args.dpo else "trainer/loss/total"])
        out["steps"].append(learner.state_dict_for_broadcast())
        if args.save_at and learner.step_count == args.save_at:
            checkpoint.save(args.ckpt, learner, data_position={"batch": i + 1})
    if args.instrument:
        logs: list = [None] * dist.world_size()
        if dist.world_size() > 1:
            torch.distributed.all_gather_object(logs, (collectives.calls, meter.unsharded_frac))
        else:
            logs = [(collectives.calls, meter.unsharded_frac)]
        out["collectives"] = [calls for calls, _ in logs]
        out["unsharded_frac"] = [frac for _, frac in logs]
    if dist.is_rank0():
        torch.save(out, args.out)
    dist.shutdown()
    return 0


def _die_in_step(learner, step: int) -> None:
    """Rank 1 exits hard right after its strategy's forward/backward in step `step` (rank 0 then waits
    in the gradient reduction)."""
    from tailrace.engine.trainer import dist

    inner = learner.forward_backward

    def dying(*a, **k):
        stats = inner(*a, **k)
        if dist.rank() == 1 and learner.step_count + 1 == step:
            os._exit(17)
        return stats

    learner.forward_backward = dying


def _raise_in_step(learner, step: int) -> None:
    """Rank 1 raises inside its first decoder layer's first forward of step `step` (rank 0 then waits in
    a collective of that forward or the next)."""
    from tailrace.engine.trainer import dist

    mlp = learner.model.get_decoder().layers[0].mlp  # called by the HF forward and by the trie forward

    def hook(module, args):
        if dist.rank() == 1 and learner.step_count + 1 == step:
            raise RuntimeError("injected failure in layer 0")

    mlp.register_forward_pre_hook(hook)


if __name__ == "__main__":
    sys.exit(main())
