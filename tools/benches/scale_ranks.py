"""The scale step on 1 and on N trainer ranks (FSDP2, one torch thread each), same run: `bench.py scale --ranks N`.

    python tools/bench.py scale --ranks 2 [--quick] [--json]

Each size runs as its own launch (plain python for 1 rank, torchrun for N, gloo on the CPU, NCCL on
GPUs): one Learner step with replay = "replay" on the scale bench's groups, timed between barriers (depth-first
replay across ranks needs train.fsdp.step_residency = "full": the whole model gathered for the step).
Reported: step_s_1, step_s_N, scaling = step_s_1 / step_s_N, peak RSS per rank, parameter + optimizer
state bytes per rank (the local shards), and max_grad_rel_err, the largest per-tensor relative difference
between the reduced gradients of N ranks and of 1 rank.
Residency, per mode (RESIDENCY_MODES: naive, packed, layer_major and replay under step_residency = "layer"
- replay runs a trie too large for one pack layer-major there - and packed under "full"),
one N-rank step of an 8-layer model of the same shape on the --quick groups: peak_unsharded_frac[mode], the
most unsharded parameter + gradient bytes FSDP held on a rank at one moment over P (dist.ResidencyMeter), and
collectives_equal[mode], whether every rank ran the same all-gathers / reduce-scatters in the same order
(dist.CollectiveLog).
Worker: python -m tools.benches.scale --rank-worker FILE [--quick] [--mode MODE] (under torchrun for N ranks).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESIDENCY_MODES = {"naive": ("naive", "layer"), "packed": ("packed", "layer"), "layer_major": ("layer_major", "layer"),
                   "replay": ("replay", "layer"), "full": ("packed", "full")}
RESIDENCY_LAYERS = 8


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def worker(out: str, groups: list, threads: int, mode: str = "") -> None:
    """One rank: the step on `groups`; rank 0 writes the figures to `out` and the gradient to out.grads.
    mode "" is the scaling step; a key of RESIDENCY_MODES the residency step (module doc)."""
    import torch

    from tailrace.engine.config import FSDPConfig, TrainConfig
    from tailrace.engine.trainer import dist
    from tailrace.engine.trainer.learner import Learner
    from tools.benches.replay import MICRO_BATCH_TOKENS, bench_model

    torch.set_num_threads(threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    info = dist.init_from_env()
    if device == "cuda":
        torch.cuda.set_device(info.local_rank)
    replay, residency = RESIDENCY_MODES[mode] if mode else ("replay", "full")
    config = TrainConfig(lr=1e-6, replay=replay, log_entropy=False, micro_batch_tokens=MICRO_BATCH_TOKENS,
                         fsdp=FSDPConfig(step_residency=residency))
    model = bench_model(num_hidden_layers=RESIDENCY_LAYERS) if mode else bench_model()
    learner = Learner(model.to(device), config)
    if mode:
        _residency_step(learner, groups, out)
        return
    grads: dict[str, torch.Tensor] = {}
    update = learner._update

    def capture() -> tuple[float, bool]:  # the reduced gradient, full, before the optimizer uses it
        for name, p in learner.model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[name] = g.detach().double().cpu()
        return update()

    learner._update = capture
    dist.barrier()
    wall = time.perf_counter()
    learner.step(groups)
    dist.barrier()
    step_s = time.perf_counter() - wall
    state = sum(_local_bytes(p) for p in learner.model.parameters())
    state += sum(_local_bytes(v) for s in learner.optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    figures = torch.tensor([step_s, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, state / 2**20],
                           dtype=torch.float64)
    dist.all_reduce_max_(figures)  # the slowest rank, the largest footprint
    if dist.is_rank0():
        torch.save(grads, out + ".grads")
        Path(out).write_text(json.dumps({"step_s": float(figures[0]), "peak_rss_mb": float(figures[1]),
                                         "state_mb": float(figures[2])}))


def _residency_step(learner, groups: list, out: str) -> None:
    """One step with the collective log and the residency meter on; rank 0 writes both figures."""
    import torch

    from tailrace.engine.trainer import dist

    with dist.CollectiveLog() as log, dist.ResidencyMeter(learner.model) as meter:
        learner.step(groups)
    logs: list = [None] * dist.world_size()
    torch.distributed.all_gather_object(logs, (log.calls, meter.unsharded_frac))
    if dist.is_rank0():
        Path(out).write_text(json.dumps({"peak_unsharded_frac": max(frac for _, frac in logs),
                                         "collectives_equal": all(calls == logs[0][0] for calls, _ in logs),
                                         "collectives": log.counts()}))


def _launch(ranks: int, quick: bool, out: Path, mode: str = "") -> dict:
    argv = [sys.executable, "-m", "tools.benches.scale", "--rank-worker", str(out), *(["--quick"] if quick else []),
            *(["--mode", mode] if mode else [])]
    if ranks > 1:
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                "--max-restarts=0", *argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"scale on {ranks} ranks failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def run(quick: bool, ranks: int, log: Callable[[str], None]) -> dict:
    import torch

    with tempfile.TemporaryDirectory(prefix="tailrace-scale-ranks-") as tmp:
        one = _launch(1, quick, Path(tmp) / "one.json")
        log(f"1 rank: {one['step_s']:.1f} s, peak RSS {one['peak_rss_mb']:.0f} MB, state {one['state_mb']:.1f} MB")
        many = _launch(ranks, quick, Path(tmp) / "many.json")
        log(f"{ranks} ranks: {many['step_s']:.1f} s, peak RSS {many['peak_rss_mb']:.0f} MB per rank, state "
            f"{many['state_mb']:.1f} MB per rank")
        g1 = torch.load(Path(tmp) / "one.json.grads", weights_only=True)
        gn = torch.load(Path(tmp) / "many.json.grads", weights_only=True)
        residency = {}
        for mode in RESIDENCY_MODES:
            residency[mode] = _launch(ranks, True, Path(tmp) / f"{mode}.json", mode)
            log(f"{mode} ({' '.join(RESIDENCY_MODES[mode])}), {RESIDENCY_LAYERS} layers: peak unsharded "
                f"{residency[mode]['peak_unsharded_frac']:.3f} P, collectives equal on all ranks: "
                f"{residency[mode]['collectives_equal']} {residency[mode]['collectives']}")
    err = max(float((gn[k] - g1[k]).norm() / g1[k].norm().clamp_min(1e-300)) for k in g1)
    return {
        "ranks": ranks,
        "step_s_1": round(one["step_s"], 2),
        f"step_s_{ranks}": round(many["step_s"], 2),
        "scaling": round(one["step_s"] / many["step_s"], 3),
        "peak_rss_mb_per_rank": round(many["peak_rss_mb"]),
        "peak_rss_mb_1": round(one["peak_rss_mb"]),
        "state_mb_per_rank_1": round(one["state_mb"], 2),
        f"state_mb_per_rank_{ranks}": round(many["state_mb"], 2),
        "max_grad_rel_err": err,
        "peak_unsharded_frac": {m: round(r["peak_unsharded_frac"], 4) for m, r in residency.items()},
        "collectives_equal": {m: r["collectives_equal"] for m, r in residency.items()},
        "residency_layers": RESIDENCY_LAYERS,
        "threads_per_rank": 1,
    }
