"""One rank of tests/engine/replay/test_layer_major.py's 2-rank check: run it under torchrun (or plain python
for the 1-rank reference).

    python -m torch.distributed.run --nproc-per-node 2 tests/engine/replay/layer_major_worker.py --out OUT

Builds the float64 tiny model of the replay tests (float64 norms), shards it per decoder layer with
fully_shard (reshard_after_forward=True, gradients summed), and runs one layer-major forward/backward of
this rank's samples (in --micro-batches calls, gradient sync on the last): rank 0 a deep two-level trie,
rank 1 a flat group of another prompt (none with --empty-rank), then its log-probs without autograd. It logs every all-gather and reduce-scatter FSDP2
issues in each (kind, input elements). Rank 0 writes the full gradient, both ranks' logs and unit counts to
OUT (torch.save). Without torchrun one
process runs both sample sets one after the other: the reference gradient.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from pathlib import Path

import torch

VOCAB = 8


def exact_model(arch: str) -> torch.nn.Module:
    """tests/engine/conftest.py's exact_model, from tests/tiny_lms.py loaded by its path (outside pytest)."""
    spec = importlib.util.spec_from_file_location("tiny_lms", Path(__file__).resolve().parents[2] / "tiny_lms.py")
    tiny_lms = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tiny_lms)
    model = tiny_lms.build(arch, dtype=torch.float64, intermediate_size=48, vocab_size=VOCAB,
                           max_position_embeddings=256, tie_word_embeddings=arch == "qwen2")

    def forward(self, x):  # float64 RMSNorm (Hugging Face's computes in float32)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(forward, module)
    return model.train()


def sample_sets():
    """(deep two-level trie with skewed tails, flat group of another prompt)."""
    from tailrace.engine.core.samples import TrainSample

    gen = torch.Generator().manual_seed(3)
    draw = lambda n: torch.randint(0, VOCAB, (n,), generator=gen).tolist()  # noqa: E731

    def samples(seqs, prompt_len, first_id):
        out = []
        for i, seq in enumerate(seqs):
            t = len(seq) - prompt_len
            out.append(TrainSample(group_id=first_id, sample_id=first_id + i, prompt_ids=torch.tensor(seq[:prompt_len]),
                                   completion_ids=torch.tensor(seq[prompt_len:]),
                                   behaviour_logprobs=-1.5 - 2 * torch.rand(t, generator=gen, dtype=torch.float64),
                                   policy_versions=torch.zeros(t, dtype=torch.int64), reward=0.0,
                                   advantage=float(torch.randn((), generator=gen)), temperature=[1.0, 0.8][i % 2]))
        return out

    prompt, deep = draw(9), []
    for middle_len in (3, 1):
        middle = draw(middle_len)
        deep += [prompt + middle + [b] + draw(n) for b, n in zip(range(3), (0, 2, 14), strict=True)]
    other = draw(5)
    flat = [other + [b] + draw(n) for b, n in zip(range(4), (6, 1, 3, 9), strict=True)]
    return samples(deep, 9, 0), samples(flat, 5, 100)


class CollectiveLog:
    """Wraps the torch.distributed functions FSDP2's default collectives call (looked up at call time)."""

    def __init__(self) -> None:
        import torch.distributed as tdist

        self.entries: list[tuple[str, int]] = []
        self._originals = {name: getattr(tdist, name) for name in ("all_gather_single", "reduce_scatter_single")}
        for name, fn in self._originals.items():
            setattr(tdist, name, self._logged(name, fn))

    def _logged(self, name, fn):
        kind = "all_gather" if name.startswith("all_gather") else "reduce_scatter"

        def logged(*args, **kwargs):
            tensor = kwargs.get("input", args[1] if len(args) > 1 else None)
            self.entries.append((kind, int(tensor.numel())))
            return fn(*args, **kwargs)

        return logged

    def stop(self) -> list[tuple[str, int]]:
        import torch.distributed as tdist

        for name, fn in self._originals.items():
            setattr(tdist, name, fn)
        return self.entries


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--empty-rank", action="store_true", help="rank 1 gets no samples (its padding unit runs)")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="split each rank's samples into this many calls, gradient sync on the last only")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    import torch.distributed as tdist

    from tailrace.engine.config import FSDPConfig
    from tailrace.engine.core.losses import LossNormaliser
    from tailrace.engine.replay.layer_major import LayerMajorForwardBackward, plan_units, sample_logprobs
    from tailrace.engine.replay.trie import build_trie
    from tailrace.engine.trainer import dist
    from tailrace.engine.trainer.loss import LossConfig, StepLoss

    info = dist.init_from_env(timeout_s=60.0)
    model = exact_model(args.arch)
    deep, flat = sample_sets()
    normaliser = LossNormaliser.from_samples(deep + flat)
    strategy = LayerMajorForwardBackward(5, max_unit_tokens=4, reshard_after_forward=True)
    config = LossConfig(clip_eps_low=0.2, clip_eps_high=0.28, aggregation="token_mean")
    if info.world_size == 1:
        for part in (deep, flat):
            strategy(model, part, StepLoss(part, config), normaliser)
        grads = {n: p.grad for n, p in model.named_parameters()}
        torch.save({"grads": grads}, args.out)
        return 0
    dist.shard_model(model, FSDPConfig(reshard_after_forward=True, collective_timeout_s=60.0))
    mine = [deep, [] if args.empty_rank else flat][info.rank]
    log = CollectiveLog()
    for k in range(args.micro_batches):  # contiguous parts (every part of an empty rank is empty)
        part = mine[k * len(mine) // args.micro_batches:(k + 1) * len(mine) // args.micro_batches]
        strategy.sync_gradients = k == args.micro_batches - 1
        strategy(model, part, StepLoss(part, config) if part else None, normaliser)
    entries = log.stop()
    log = CollectiveLog()
    sample_logprobs(model, mine, 5, max_unit_tokens=4)
    logprob_entries = log.stop()
    logs: list = [None] * info.world_size
    tdist.all_gather_object(logs, entries)
    logprob_logs: list = [None] * info.world_size
    tdist.all_gather_object(logprob_logs, logprob_entries)
    units: list = [None] * info.world_size
    tdist.all_gather_object(units, len(plan_units(build_trie(mine), 4)) if mine else 0)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    if info.rank == 0:
        torch.save({"grads": grads, "collectives": logs, "logprob_collectives": logprob_logs,
                    "num_layers": model.config.num_hidden_layers, "units": units}, args.out)
    dist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
