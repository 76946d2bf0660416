"""train.gradient_checkpointing: memory and time of one forward/backward with and without it, per mode.

    python tools/bench.py checkpointing [--quick] [--json]

A 4-layer Llama-shaped model (hidden 64) in float32 on the CPU, one group of 2 samples sharing a long
prompt; for each strategy (naive, replay, packed) the same forward/backward runs plain (the baseline) and
checkpointed. Figures per mode: saved_mb (bytes of the tensors autograd saved for backward outside the
checkpointed layers, counted by saved_tensors_hooks), peak_mb (the process heap's peak above its level
before the call: glibc mallinfo2, sampled every 0.5 ms, so it includes gradients, the layers' inputs kept
for the recompute and the one layer recomputed at a time), s (seconds), and the ratios plain/checkpointed.
Times depend on the machine's load; say it with them.
"""

from __future__ import annotations

import ctypes
import gc
import threading
import time
from collections.abc import Callable

import torch


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_reader() -> Callable[[], int]:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2

    def heap() -> int:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd  # in use: small-block arenas plus mmapped blocks

    return heap


def _measure(fn: Callable[[], None], heap: Callable[[], int]) -> tuple[int, int, float]:
    """(saved bytes, heap peak above the start, seconds) of fn()."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    gc.collect()
    base = heap()
    peak = [base]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], heap())
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.perf_counter()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
    finally:
        stop.set()
        watcher.join()
    return sum(saved.values()), peak[0] - base, time.perf_counter() - start


def run(quick: bool, log: Callable[[str], None]) -> dict:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tailrace.engine.config import FSDPConfig
    from tailrace.engine.core.losses import LossNormaliser
    from tailrace.engine.core.samples import TrainSample
    from tailrace.engine.replay.packed import PackedForwardBackward
    from tailrace.engine.replay.replay import ReplayForwardBackward
    from tailrace.engine.trainer import dist
    from tailrace.engine.trainer.learner import NaiveForwardBackward
    from tailrace.engine.trainer.loss import LossConfig, StepLoss

    torch.set_num_threads(1)
    prompt_len, completion_len = (512, 256) if quick else (2048, 512)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 128, (prompt_len,), generator=gen)
    samples = [TrainSample(group_id=0, sample_id=i, prompt_ids=prompt,
                           completion_ids=torch.randint(0, 128, (completion_len,), generator=gen),
                           behaviour_logprobs=torch.full((completion_len,), -4.0),
                           policy_versions=torch.zeros(completion_len, dtype=torch.int64), reward=0.0,
                           advantage=1.0 - 2 * i) for i in range(2)]

    def model(checkpointing: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(LlamaConfig(
            hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=4096))
        return dist.shard_model(m.train(), FSDPConfig(), checkpointing=checkpointing)

    strategies = {"naive": NaiveForwardBackward(1 << 20, 1024),
                  "replay": ReplayForwardBackward(1024, activation_budget_bytes=1 << 40),  # keep every forward
                  "packed": PackedForwardBackward(1 << 20, 1024)}
    heap = _heap_reader()
    figures: dict = {"prompt_tokens": prompt_len, "completion_tokens": completion_len, "samples": len(samples)}
    for name, strategy in strategies.items():
        for checkpointing in (False, True):
            m = model(checkpointing)
            loss_fn = StepLoss(samples, LossConfig())
            saved, peak, seconds = _measure(
                lambda m=m, f=loss_fn, s=strategy: s(m, samples, f, LossNormaliser.from_samples(samples)), heap)
            tag = f"{name}_{'checkpointed' if checkpointing else 'plain'}"
            figures |= {f"{tag}_saved_mb": round(saved / 2**20, 2), f"{tag}_peak_mb": round(peak / 2**20, 1),
                        f"{tag}_s": round(seconds, 2)}
            log(f"{tag}: saved {saved / 2**20:.2f} MiB, heap peak {peak / 2**20:.1f} MiB, {seconds:.2f} s")
            del m
        for figure in ("saved_mb", "peak_mb", "s"):
            plain, checkpointed = figures[f"{name}_plain_{figure}"], figures[f"{name}_checkpointed_{figure}"]
            figures[f"{name}_{figure}_ratio"] = round(plain / checkpointed, 2) if checkpointed else None
    return figures
