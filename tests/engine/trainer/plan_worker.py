"""One rank of tests/engine/trainer/test_plan.py's measured peaks: run it under torchrun (gloo, CPU).

    python -m torch.distributed.run --nproc-per-node 2 tests/engine/trainer/plan_worker.py --out OUT.json \
        --cases '[{"tokens": 1024, "shape": {"hidden_size": 64, ...}}]'

Builds the test's tiny Qwen2 (float32, FSDP2 through the Learner), takes one warm-up step so AdamW's
moments exist, then measures the live-bytes peak of later Learner.step calls above what was alive before
each (engine/trainer/plan.py live_bytes) in each train.fsdp.step_residency, the product's own path: "full"
(every unit gathered for the step, dist.gathered) and "layer" (per-layer FSDP2: each layer gathered in its
forward, resharded after it, reduce-scattered in its backward; the micro-batches in lock step). Rank 0
writes, per case, {residency: [peak per rank]} to OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

# The profiler records the calling thread's allocations and frees; a tensor a step allocates and one of
# gloo's threads frees (a collective's input or output, when the work object goes last) stays counted and
# inflates that step's figure at random, so a rank reports the smallest peak of these steps.
MEASURED_STEPS = 3


def model_and_groups(tokens: int, **shape):
    """The tiny model and two groups (one per rank) of two samples of `tokens` padded tokens each."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from tailrace.engine.core.samples import Group, TrainSample

    config = Qwen2Config(**shape, max_position_embeddings=tokens + 8, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(0)

    def group(gid: int) -> Group:
        t = tokens - 1  # a row is prompt (2) + completion[:-1]
        return Group(group_id=gid, samples=[TrainSample(
            group_id=gid, sample_id=i, prompt_ids=torch.randint(0, config.vocab_size, (2,), generator=gen),
            completion_ids=torch.randint(0, config.vocab_size, (t,), generator=gen),
            behaviour_logprobs=torch.full((t,), -3.0), policy_versions=torch.zeros(t, dtype=torch.int64),
            reward=float(i)) for i in range(2)])

    return model, group


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True, help='JSON list of {"tokens": N, "shape": {Qwen2Config fields}, '
                        '"mixed_precision": train.fsdp.mixed_precision (default auto)}')
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    from tailrace.engine.config import FSDPConfig, TrainConfig
    from tailrace.engine.trainer import dist, plan
    from tailrace.engine.trainer.learner import Learner

    dist.init_from_env(timeout_s=120.0)
    results = []
    for case in json.loads(args.cases):
        results.append({})
        for residency in ("full", "layer"):
            model, group = model_and_groups(case["tokens"], **case["shape"])
            fsdp = FSDPConfig(mixed_precision=case.get("mixed_precision", "auto"), step_residency=residency)
            learner = Learner(model, TrainConfig(replay="naive", micro_batch_tokens=case["tokens"],
                                                 groups_per_step=2, logprob_chunk_tokens=args.chunk, fsdp=fsdp))
            peak = None
            for step in range(1 + MEASURED_STEPS):
                groups = [group(2 * step), group(2 * step + 1)]
                with plan.live_bytes() as measured:
                    learner.step(groups)
                if step > 0:
                    peak = measured["peak"] if peak is None else min(peak, measured["peak"])
            peaks: list = [None] * dist.world_size()
            torch.distributed.all_gather_object(peaks, peak)
            results[-1][residency] = peaks
            del learner, model
    if dist.is_rank0():
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    sys.exit(main())
