"""Scale benchmark: one optimizer step over >= 2.1 million logical token positions with a tiny model.

    python tools/bench.py scale [--quick] [--json] [--ranks N]

Data: 8 GRPO groups of 32 samples, each group one 8192-token prompt with log-normal completion lengths of
median 64: 2.1M+ logical positions (sum over samples of prompt + completion), ~85k unique. The model is
the shipped tiny model's architecture (tools/benches/replay.bench_model). In a forked process: one
Learner step with replay = "replay" (exact gradients, only the root-to-current path alive), timed in
wall and CPU seconds on one torch thread, peak RSS. The naive baseline cannot run this step in a sensible
time, so it is estimated in the same run: a second forked process times the naive strategy on ONE sample
and reports its peak RSS; naive_est_step_s = that time x number of samples; naive_est_memory_mb = the
activations autograd would hold for the whole step's logical tokens at once (per-token activation bytes
from the model's shapes), naive_micro_batch_memory_mb = the same for one micro-batch of the replay step's
train.micro_batch_tokens (tools/benches/replay.MICRO_BATCH_TOKENS).
--quick: 2 groups of 8 samples of 2048-token prompts (a smoke run, far below 2.1M).
--ranks N: the same step on 1 rank and on N FSDP2 ranks instead, plus each mode's peak unsharded residency
per rank and whether the ranks' collectives were equal (tools/benches/scale_ranks.py).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tools.benches.replay import MICRO_BATCH_TOKENS, bench_model, prompt_group

SIZES = {False: dict(groups=8, group_size=32, prompt_len=8192, median=64),
         True: dict(groups=2, group_size=8, prompt_len=2048, median=64)}
THREADS = 1


def scale_groups(quick: bool):
    size = SIZES[quick]
    return [prompt_group(g, size["group_size"], size["prompt_len"], size["median"], seed=g)
            for g in range(size["groups"])]


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _replay_worker(quick: bool, out: str) -> None:
    import torch

    from tailrace.engine.config import TrainConfig
    from tailrace.engine.trainer.learner import Learner

    torch.set_num_threads(THREADS)
    model = bench_model()
    groups = scale_groups(quick)
    learner = Learner(model, TrainConfig(lr=1e-6, replay="replay", log_entropy=False,
                                         micro_batch_tokens=MICRO_BATCH_TOKENS))
    rss_before = _peak_rss_mb()
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    metrics = learner.step(groups)
    result = {"step_s": time.perf_counter() - start_wall, "step_cpu_s": time.process_time() - start_cpu,
              "peak_rss_mb": _peak_rss_mb(), "rss_before_step_mb": rss_before,
              "grad_norm": metrics["trainer/grad/norm"], "loss": metrics["trainer/loss/total"],
              "recomputed_tokens": metrics["trainer/strategy/recomputed_tokens"]}
    Path(out).write_text(json.dumps(result))


def _naive_one_sample_worker(quick: bool, out: str) -> None:
    import torch

    from tailrace.engine.core.losses import LossNormaliser
    from tailrace.engine.trainer.learner import NaiveForwardBackward
    from tailrace.engine.trainer.loss import LossConfig, StepLoss

    torch.set_num_threads(THREADS)
    model = bench_model().train()
    sample = scale_groups(quick)[0].samples[0]
    sample.advantage = 1.0
    rss_before = _peak_rss_mb()
    start = time.process_time()
    NaiveForwardBackward(1, 1024, False)(model, [sample], StepLoss([sample], LossConfig()),
                                         LossNormaliser.from_samples([sample]))
    Path(out).write_text(json.dumps({"cpu_s": time.process_time() - start, "peak_rss_mb": _peak_rss_mb(),
                                     "rss_before_mb": rss_before, "tokens": sample.num_tokens}))


def _forked(target, quick: bool, out_dir: str, name: str) -> dict:
    out = str(Path(out_dir) / f"{name}.json")
    process = mp.get_context("fork").Process(target=target, args=(quick, out))
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"{name} worker failed with exit code {process.exitcode}")
    return json.loads(Path(out).read_text())


def run(quick: bool, log: Callable[[str], None], ranks: int = 1) -> dict:
    if ranks > 1:  # the same step on 1 and on `ranks` trainer ranks (tools/benches/scale_ranks.py)
        from tailrace.engine.core.samples import flatten_samples
        from tailrace.engine.replay.trie import build_trie
        from tools.benches import scale_ranks

        trie = build_trie(flatten_samples(scale_groups(quick)))
        log(f"{trie.num_logical_tokens:,} logical / {trie.num_unique_tokens:,} unique tokens: 1 rank vs {ranks}")
        return {"logical_tokens": trie.num_logical_tokens, "unique_tokens": trie.num_unique_tokens,
                **scale_ranks.run(quick, ranks, log)}
    import torch  # noqa: F401  (imported once; the forked workers share it)

    from tailrace.engine.core.samples import flatten_samples
    from tailrace.engine.replay.forward import activation_bytes_per_token
    from tailrace.engine.replay.trie import build_trie

    samples = flatten_samples(scale_groups(quick))
    trie = build_trie(samples)
    log(f"{len(samples)} samples: {trie.num_logical_tokens:,} logical / {trie.num_unique_tokens:,} unique tokens")
    with tempfile.TemporaryDirectory(prefix="tailrace-scale-bench-") as out_dir:
        replay = _forked(_replay_worker, quick, out_dir, "replay")
        log(f"replay step: {replay['step_s']:.1f} s wall, {replay['step_cpu_s']:.1f} s CPU, peak RSS "
            f"{replay['peak_rss_mb']:.0f} MB (before the step {replay['rss_before_step_mb']:.0f} MB)")
        naive = _forked(_naive_one_sample_worker, quick, out_dir, "naive")
        log(f"naive, one sample of {naive['tokens']} tokens: {naive['cpu_s']:.1f} s CPU, peak RSS "
            f"{naive['peak_rss_mb']:.0f} MB")
    per_token = activation_bytes_per_token(bench_model())
    micro_batch = MICRO_BATCH_TOKENS
    naive_est_s = naive["cpu_s"] * len(samples)
    return {
        "logical_tokens": trie.num_logical_tokens,
        "unique_tokens": trie.num_unique_tokens,
        "token_ideal": round(trie.num_logical_tokens / trie.num_unique_tokens, 3),
        "step_s": round(replay["step_s"], 2),
        "step_cpu_s": round(replay["step_cpu_s"], 2),
        "peak_rss_mb": round(replay["peak_rss_mb"]),
        "rss_before_step_mb": round(replay["rss_before_step_mb"]),
        "recomputed_tokens": replay["recomputed_tokens"],
        "grad_norm": replay["grad_norm"],
        "naive_est_step_s": round(naive_est_s, 1),
        "ratio": round(naive_est_s / replay["step_cpu_s"], 2),
        "naive_one_sample_cpu_s": round(naive["cpu_s"], 2),
        "naive_one_sample_peak_rss_mb": round(naive["peak_rss_mb"]),
        "naive_est_memory_mb": round(trie.num_logical_tokens * per_token / 2**20),
        "naive_micro_batch_memory_mb": round(max(micro_batch, samples[0].num_tokens) * per_token / 2**20),
        "threads": THREADS,
    }


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--rank-worker":  # one rank of `--ranks N` (scale_ranks.py)
        from tools.benches import scale_ranks

        rest = sys.argv[3:]
        mode = rest[rest.index("--mode") + 1] if "--mode" in rest else ""
        # The residency steps run on the --quick groups (module doc of scale_ranks.py).
        scale_ranks.worker(sys.argv[2], scale_groups("--quick" in rest or bool(mode)), THREADS, mode)
    else:
        sys.exit("run through tools/bench.py: python tools/bench.py scale [--quick] [--json] [--ranks N]")
