"""Speculative decoding benchmark: decode throughput in the long-tail regime, speculation vs plain, on the
default tiny model after online drafter training, in one run.

    python tools/bench.py spec [--quick] [--json]

Phases, one process, one torch thread (a generator's setting):
    rollouts   plain decoding of task prompts at temperature 1 with a fresh drafter attached at depth 0:
               the policy's own rollouts, captured as traces (hidden states + tokens)
    train      the spot trainer trains the drafter on them for a fixed time budget
    decode     running batch 1, 2 and 4 of long prompts (a row that finishes is replaced at once, so the
               batch stays full): plain decoding (no drafter at all) and speculative decoding with the
               bandit choosing k take turns step by step over the same requests, so that both see the
               same machine; each is timed over its own steps
    tv         token distributions of many samples with and without speculation, and of two plain runs
               (the sampling noise floor of that distance)

Figures: tokens_per_s_plain / tokens_per_s_spec / speedup at batch 1 and speedup_by_batch (decode
throughput: tokens per second of decode steps, wall clock; admission and prefill excluded, as they are
the same work in both), the same end to end with prefill and in CPU time, mean_accept_len (accepted
drafts per row and speculative step), tv_distance and tv_noise_floor; target speedup >= 1.8. CPU-time
ratios are less disturbed by other processes on a shared machine. At batch 1, what the speedup is made
of: accept_rate_by_depth (the rate at which the j-th draft was accepted when all before it were; over
accept_tested_by_depth row-steps: the deepest are tried only when the bandit explores deep arms),
plain_step_ms, spec_draft_ms and spec_verify_ms (per speculative step) and emitted_per_spec_step.
TAILRACE_BENCH_MODEL=PATH benchmarks another checkpoint.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

SPEEDUP_TARGET = 1.8
BATCH_SIZES = (1, 2, 4)


def _sizes(quick: bool) -> dict:
    if quick:
        return dict(num_train_prompts=1024, train_s=26.0, num_warmup_prompts=8, num_decode_prompts=32,
                    num_tv_prompts=256)
    # ~110k tokens of rollouts: fewer make the drafter overfit them (its acceptance on other prompts drops)
    return dict(num_train_prompts=5000, train_s=150.0, num_warmup_prompts=24, num_decode_prompts=128,
                num_tv_prompts=1024)


def _prompts(tokenizer, num: int, seed: int, min_chars: int = 0) -> list[list[int]]:
    from tailrace.engine import tasks

    out = []
    for prompt in tasks.synthetic_prompts(seed=seed):
        if len(prompt.metadata["answer"]) >= min_chars:
            out.append(tokenizer(prompt.text)["input_ids"])
        if len(out) == num:
            return out
    raise AssertionError("unreachable: the prompt stream is endless")


def _decode_all(backend, requests, keep_running: int) -> tuple[list, float]:
    """Decode every request with at most keep_running rows, refilling as rows finish."""
    pending = list(requests)
    finished = []
    start_s = time.perf_counter()
    while pending or backend.num_running or backend.num_waiting:
        while pending and backend.num_running + backend.num_waiting < keep_running:
            backend.add(pending.pop(0))
        finished += backend.step()
    return finished, time.perf_counter() - start_s


def _race(backends: dict, requests, keep_running: int) -> dict[str, list]:
    """Decode the same requests on every backend, one step of each in turn, so that all of them see the
    same machine (other processes come and go on a shared CPU). Returns per backend [tokens, wall s,
    CPU s], times summed over its own steps (admission and prefill included)."""
    pending = {name: list(requests) for name in backends}
    totals = {name: [0, 0.0, 0.0] for name in backends}
    while True:
        busy = False
        for name, backend in backends.items():
            while pending[name] and backend.num_running + backend.num_waiting < keep_running:
                backend.add(pending[name].pop(0))
            if not (backend.num_running or backend.num_waiting):
                continue
            busy = True
            wall_s, cpu_s = time.perf_counter(), time.process_time()
            finished = backend.step()
            totals[name][1] += time.perf_counter() - wall_s
            totals[name][2] += time.process_time() - cpu_s
            totals[name][0] += sum(len(f.completion_ids) for f in finished)
        if not busy:
            return totals


def collect_traces(model, drafter, eos, prompts, log) -> list:
    from tailrace.engine.generator.backend import Request, TorchBackend
    from tailrace.engine.generator.speculative import FixedDepth
    from tailrace.protocol.messages import SamplingParams

    backend = TorchBackend(model, max_batch_size=32, max_model_len=256, eos_token_ids=eos, seed=0)
    backend.enable_speculation(drafter, FixedDepth(0), max_traces=len(prompts))
    requests = [Request(i, 0, p, SamplingParams(temperature=1.0, max_new_tokens=128)) for i, p in enumerate(prompts)]
    finished, wall_s = _decode_all(backend, requests, 32)
    traces = backend.take_traces()
    log(f"rollouts: {len(finished)} samples, {sum(t.tokens.numel() for t in traces)} tokens in {wall_s:.1f}s")
    return traces


def train_drafter(drafter, traces, train_s: float, log) -> dict:
    from tailrace.engine.generator.spot import SpotConfig, SpotTrainer

    spot = SpotTrainer(drafter, SpotConfig(), seed=0)
    spot.add_traces(traces)
    deadline = time.monotonic() + train_s
    first = spot.train_step()
    steps = 1 + spot.run(lambda: time.monotonic() >= deadline)
    last = spot.last_metrics
    log(f"train: {steps} steps in {spot.train_s:.1f}s, acceptance on the training batch (teacher forced) "
        f"{first['accept_tf']:.3f} -> {last['accept_tf']:.3f}")
    return {"drafter_train_steps": steps, "drafter_train_s": round(spot.train_s, 1),
            "drafter_accept_rate": round(last["accept_tf"], 4)}


def _throughput(model, drafter, eos, prompts, warmup_prompts, batch: int, log) -> dict:
    from tailrace.engine.generator.backend import Request, TorchBackend
    from tailrace.engine.generator.bandit import SpecBandit
    from tailrace.protocol.messages import SamplingParams

    plain = TorchBackend(model, max_batch_size=batch, max_model_len=256, eos_token_ids=eos, seed=1)
    spec = TorchBackend(model, max_batch_size=batch, max_model_len=256, eos_token_ids=eos, seed=2)
    bandit = SpecBandit(seed=0)
    spec.enable_speculation(drafter, bandit, max_traces=0)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=96)
    # The bandit first learns this batch size's depth (a generator's bandit runs all along).
    _decode_all(spec, [Request(i, 0, p, sampling) for i, p in enumerate(warmup_prompts)], batch)
    stats = spec.spec_stats
    decode_s_before, accepted_before, row_steps_before = (
        spec.stats.decode_s, stats.num_accepted, sum(stats.accept_len_hist))
    steps_before = (stats.num_plain_steps, stats.num_spec_steps)
    tested_before, accepted_by_depth_before = list(stats.tested_by_depth), list(stats.accepted_by_depth)
    emitted_before = stats.num_emitted
    draft_s_before, verify_s_before = stats.draft_s, stats.verify_s
    totals = _race({"plain": plain, "spec": spec}, [Request(i, 0, p, sampling) for i, p in enumerate(prompts)], batch)
    (plain_tokens, plain_s, plain_cpu_s), (spec_tokens, spec_s, spec_cpu_s) = totals["plain"], totals["spec"]
    # Decode throughput: time in decode steps (BackendStats.decode_s; admission and prefill, identical
    # work in both, excluded), and end to end with them for comparison.
    rate_plain, rate_spec = plain_tokens / plain.stats.decode_s, spec_tokens / (spec.stats.decode_s - decode_s_before)
    with_prefill = (spec_tokens / spec_s) / (plain_tokens / plain_s)
    cpu_ratio = (spec_tokens / spec_cpu_s) / (plain_tokens / plain_cpu_s)
    accepted, row_steps = stats.num_accepted - accepted_before, sum(stats.accept_len_hist) - row_steps_before
    num_plain, num_spec = stats.num_plain_steps - steps_before[0], stats.num_spec_steps - steps_before[1]
    # Where a speculative step's time goes, against a plain step (the speedup is tokens per speculative
    # step times plain step time over speculative step time).
    num_spec_steps = max(num_spec, 1)
    costs = {"plain_step_ms": 1e3 * plain.stats.decode_s / max(plain.stats.num_steps, 1),
             "spec_draft_ms": 1e3 * (stats.draft_s - draft_s_before) / num_spec_steps,
             "spec_verify_ms": 1e3 * (stats.verify_s - verify_s_before) / num_spec_steps,
             "emitted_per_spec_step": (stats.num_emitted - emitted_before) / num_spec_steps / batch}
    tested = [now - before for now, before in zip(stats.tested_by_depth, tested_before, strict=True)]
    by_depth = [round((now - before) / t, 3) for now, before, t in
                zip(stats.accepted_by_depth, accepted_by_depth_before, tested, strict=True) if t]
    log(f"batch {batch}: decode plain {rate_plain:.0f} tok/s, spec {rate_spec:.0f} tok/s, speedup "
        f"{rate_spec / rate_plain:.2f} (with prefill {with_prefill:.2f}, CPU time {cpu_ratio:.2f}); bandit's k "
        f"{bandit.best(batch)}, {accepted / max(row_steps, 1):.2f} accepted per row-step, {num_plain} of "
        f"{num_plain + num_spec} steps plain; plain step {costs['plain_step_ms']:.2f} ms, speculative step: "
        f"drafting {costs['spec_draft_ms']:.2f} ms + verifying {costs['spec_verify_ms']:.2f} ms + bookkeeping, "
        f"{costs['emitted_per_spec_step']:.2f} tokens per row")
    return {"plain": rate_plain, "spec": rate_spec, "speedup": rate_spec / rate_plain, "with_prefill": with_prefill,
            "speedup_cpu": cpu_ratio, "best_k": bandit.best(batch), "accepted": accepted, "row_steps": row_steps,
            "accept_rate_by_depth": by_depth, "accept_tested_by_depth": [t for t in tested if t], **costs}


def _token_histogram(model, eos, prompts, drafter, seed: int):
    import torch

    from tailrace.engine.generator.backend import Request, TorchBackend
    from tailrace.engine.generator.bandit import SpecBandit
    from tailrace.protocol.messages import SamplingParams

    backend = TorchBackend(model, max_batch_size=64, max_model_len=256, eos_token_ids=eos, seed=seed)
    if drafter is not None:
        backend.enable_speculation(drafter, SpecBandit(arms=(2, 4, 6), seed=seed), max_traces=0)
    requests = [Request(i, 0, p, SamplingParams(temperature=1.0, max_new_tokens=64)) for i, p in enumerate(prompts)]
    finished, _ = _decode_all(backend, requests, 64)
    tokens = torch.cat([f.completion_ids for f in finished])
    return torch.bincount(tokens, minlength=model.config.vocab_size).double()


def _tv(a, b) -> float:
    return 0.5 * float((a / a.sum() - b / b.sum()).abs().sum())


def run(quick: bool, log: Callable[[str], None]) -> dict:
    import torch

    from tailrace.engine.drafter import Drafter
    from tailrace.engine.models import eos_token_ids, load_model, load_tokenizer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    sizes = _sizes(quick)
    model_path = os.environ.get("TAILRACE_BENCH_MODEL", "tiny")
    model = load_model(model_path)
    model.requires_grad_(False)
    tokenizer = load_tokenizer(model_path)
    eos = eos_token_ids(model, tokenizer)
    drafter = Drafter.for_policy(model, seed=0)
    traces = collect_traces(model, drafter, eos, _prompts(tokenizer, sizes["num_train_prompts"], seed=1), log)
    figures = train_drafter(drafter, traces, sizes["train_s"], log)
    decode_prompts = _prompts(tokenizer, sizes["num_decode_prompts"], seed=2, min_chars=20)
    warmup_prompts = _prompts(tokenizer, sizes["num_warmup_prompts"], seed=4, min_chars=20)
    by_batch = {b: _throughput(model, drafter, eos, decode_prompts, warmup_prompts, b, log) for b in BATCH_SIZES}
    tv_prompts = _prompts(tokenizer, sizes["num_tv_prompts"], seed=3)
    plain_a = _token_histogram(model, eos, tv_prompts, None, seed=1)
    plain_b = _token_histogram(model, eos, tv_prompts, None, seed=2)
    spec = _token_histogram(model, eos, tv_prompts, drafter, seed=3)
    tv, floor = _tv(spec, plain_a), _tv(plain_b, plain_a)
    log(f"tv: spec vs plain {tv:.4f}, plain vs plain {floor:.4f} ({int(spec.sum())} / {int(plain_a.sum())} tokens)")
    one = by_batch[1]
    accepted = sum(r["accepted"] for r in by_batch.values())
    row_steps = sum(r["row_steps"] for r in by_batch.values())
    return {
        "tokens_per_s_plain": round(one["plain"], 1),
        "tokens_per_s_spec": round(one["spec"], 1),
        "speedup": round(one["speedup"], 3),
        "speedup_by_batch": {str(b): round(r["speedup"], 3) for b, r in by_batch.items()},
        "speedup_with_prefill_by_batch": {str(b): round(r["with_prefill"], 3) for b, r in by_batch.items()},
        "speedup_cpu_time_with_prefill_by_batch": {str(b): round(r["speedup_cpu"], 3) for b, r in by_batch.items()},
        "bandit_k_by_batch": {str(b): r["best_k"] for b, r in by_batch.items()},
        "mean_accept_len": round(accepted / max(row_steps, 1), 3),
        "accept_rate_by_depth": one["accept_rate_by_depth"],
        "accept_tested_by_depth": one["accept_tested_by_depth"],
        "plain_step_ms": round(one["plain_step_ms"], 3),
        "spec_draft_ms": round(one["spec_draft_ms"], 3),
        "spec_verify_ms": round(one["spec_verify_ms"], 3),
        "emitted_per_spec_step": round(one["emitted_per_spec_step"], 3),
        "tv_distance": round(tv, 4),
        "tv_noise_floor": round(floor, 4),
        "speedup_target": SPEEDUP_TARGET,
        **figures,
    }
