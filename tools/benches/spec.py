"""Speculative decoding benchmark: decode throughput in the long-tail regime, speculation vs plain, on the
default tiny model after online drafter training, in one run.

    python tools/bench.py spec [--quick] [--json]
    python tools/bench.py spec --workload longtail [--quick] [--json]   # the shipped 12-layer policy

--workload longtail measures the shipped 12-layer policy (examples/tiny_longtail, trained on the task
reverse_longtail by tools/make_tiny_model.py), so the one-layer drafter is 1/12 of a policy step, nearer a
real model's share: its figures at the top level, num_layers 12, and the 4-layer policy's figures of the
same run beside them (four_layer). Each policy's drafter is trained on that policy's own rollouts, as
below (four_layer_drafter says so). Both decode the same prompts (task reverse, answers of 20-64 characters
at the decode phase), which the 12-layer policy, trained on strings of 1-128 characters, also answers.

Phases, one process, one torch thread (a generator's setting):
    rollouts   plain decoding of task prompts at temperature 1 with a fresh drafter attached at depth 0:
               the policy's own rollouts, captured as traces (hidden states + tokens)
    train      the spot trainer trains the drafter on them for a fixed time budget
    decode     running batch 1, 2, 4, 8 and 16 of GRPO groups: every prompt sampled GROUP_SIZE times, its
               samples queued together (so a batch holds a group's concurrent samples, and at batch 1
               each sample follows its siblings: the repetition the suffix drafter draws from; the text is
               the policy's own samples, nothing constructed). A row that finishes is replaced at once.
               Four backends take turns step by step over the same requests, so all see the same
               machine, each timed over its own steps: plain (no drafter), the bandit over every arm
               (off, eagle@k, suffix@k: `speedup`), over off and eagle@k (`speedup_eagle`) and over off and
               suffix@k (`speedup_model_free`); each bandit first learns on warm-up groups
    tv         token distributions of many grouped samples with speculation forced on (eagle and suffix
               arms, no off) and without, and of two plain runs (the sampling noise floor of that distance)

Figures: tokens_per_s_plain / tokens_per_s_spec / speedup at batch 1 and speedup_by_batch (decode
throughput: tokens per second of decode steps, wall clock; admission and prefill excluded, as they are
the same work in both), speedup_eagle(_by_batch) and speedup_model_free(_by_batch), the same end to end
with prefill and in CPU time, bandit_arm_by_batch (the arm each bucket settled on), accept_rate_eagle and
accept_rate_suffix (accepted over drafted tokens of each drafter, its own bandit, all batch sizes),
mean_accept_len (accepted drafts per row and speculative step), tv_distance and tv_noise_floor; target
speedup >= 1.8. CPU-time ratios are less disturbed by other processes on a shared machine. At batch 1,
what the speedup is made of: accept_rate_by_depth (the rate at which the j-th draft was accepted when all
before it were; over accept_tested_by_depth row-steps), plain_step_ms, spec_draft_ms and spec_verify_ms
(per speculative step) and emitted_per_spec_step. TAILRACE_BENCH_MODEL=PATH benchmarks another checkpoint.
The phases above run on the CPU (a CPU generator's setting). On a machine with a CUDA device, one more:
    cuda graphs  the policy on the GPU, its forwards replayed as CUDA graphs (generator.cuda_graphs) against
               the same backend run eagerly, raced at each batch size, plain and suffix@3
               (cuda_graphs_speedup_by_batch, cuda_graphs_suffix_speedup_by_batch); without one the JSON
               says "cuda_graphs": "not measured: no CUDA device"
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

SPEEDUP_TARGET = 1.8
BATCH_SIZES = (1, 2, 4, 8, 16)
GROUP_SIZE = 8  # sampling.group_size's default: samples per prompt, queued together
# The bandits raced against plain decoding: drafters each may use (off is always an arm).
BANDITS = {"spec": ("eagle", "suffix"), "eagle": ("eagle",), "model_free": ("suffix",)}
# --workload longtail: the shipped 12-layer policy (examples/tiny_longtail; a real model's one-layer drafter
# is 1/24 to 1/64 of it, this one's 1/12).
LONGTAIL_MODEL = "tiny_longtail"
# The 4-layer figures printed beside the deep policy's.
FOUR_LAYER_KEYS = ("speedup", "speedup_eagle", "speedup_model_free", "speedup_by_batch", "speedup_eagle_by_batch",
                   "speedup_model_free_by_batch", "bandit_arm_by_batch", "accept_rate_eagle", "accept_rate_suffix",
                   "plain_step_ms", "spec_draft_ms", "spec_verify_ms", "tv_distance", "tv_noise_floor")


def _sizes(quick: bool) -> dict:
    if quick:
        return dict(num_train_prompts=1024, train_s=26.0, num_warmup_prompts=2, num_decode_prompts=4,
                    num_tv_prompts=32)
    # ~110k tokens of rollouts: fewer make the drafter overfit them (its acceptance on other prompts drops)
    return dict(num_train_prompts=5000, train_s=150.0, num_warmup_prompts=4, num_decode_prompts=16,
                num_tv_prompts=128)


def _groups(prompts, sampling) -> list:
    """GROUP_SIZE requests per prompt, a group's samples one after another (group id = prompt index)."""
    from tailrace.engine.generator.torch_backend.backend import Request

    return [Request(g, i, p, sampling) for g, p in enumerate(prompts) for i in range(GROUP_SIZE)]


def _prompts(tokenizer, num: int, seed: int, min_chars: int = 0) -> list[list[int]]:
    from tailrace.engine.data import tasks

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
    from tailrace.engine.generator.speculation.speculative import FixedDepth
    from tailrace.engine.generator.torch_backend.backend import Request, TorchBackend
    from tailrace.protocol.messages import SamplingParams

    backend = TorchBackend(model, max_batch_size=32, max_model_len=256, eos_token_ids=eos, seed=0)
    backend.enable_speculation(drafter, FixedDepth(0), max_traces=len(prompts))
    requests = [Request(i, 0, p, SamplingParams(temperature=1.0, max_new_tokens=128)) for i, p in enumerate(prompts)]
    finished, wall_s = _decode_all(backend, requests, 32)
    traces = backend.take_traces()
    log(f"rollouts: {len(finished)} samples, {sum(t.tokens.numel() for t in traces)} tokens in {wall_s:.1f}s")
    return traces


def train_drafter(drafter, traces, train_s: float, log) -> dict:
    from tailrace.engine.generator.speculation.drafter_training import SpotConfig, SpotTrainer

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


def _snapshot(backend) -> dict:
    stats = backend.spec_stats
    return {"decode_s": backend.stats.decode_s, "accepted": stats.num_accepted, "row_steps": sum(stats.accept_len_hist),
            "plain_steps": stats.num_plain_steps, "spec_steps": stats.num_spec_steps,
            "tested": list(stats.tested_by_depth), "accepted_by_depth": list(stats.accepted_by_depth),
            "emitted": stats.num_emitted, "draft_s": stats.draft_s, "verify_s": stats.verify_s,
            "drafted_by": dict(stats.drafted_by), "accepted_by": dict(stats.accepted_by)}


def _since(backend, before: dict) -> dict:
    now = _snapshot(backend)
    out = {key: now[key] - before[key] for key in ("decode_s", "accepted", "row_steps", "plain_steps",
                                                   "spec_steps", "emitted", "draft_s", "verify_s")}
    for key in ("tested", "accepted_by_depth"):
        out[key] = [a - b for a, b in zip(now[key], before[key], strict=True)]
    for key in ("drafted_by", "accepted_by"):
        out[key] = {name: now[key][name] - before[key][name] for name in now[key]}
    return out


def _throughput(model, drafter, eos, prompts, warmup_prompts, batch: int, log) -> dict:
    from tailrace.engine.generator.speculation.bandit import SpecBandit, arms_for
    from tailrace.engine.generator.torch_backend.backend import TorchBackend
    from tailrace.protocol.messages import SamplingParams

    sampling = SamplingParams(temperature=1.0, max_new_tokens=96)
    plain = TorchBackend(model, max_batch_size=batch, max_model_len=256, eos_token_ids=eos, seed=1)
    specs, bandits, before = {}, {}, {}
    for i, (name, drafters) in enumerate(BANDITS.items()):
        specs[name] = TorchBackend(model, max_batch_size=batch, max_model_len=256, eos_token_ids=eos, seed=2 + i)
        bandits[name] = SpecBandit(arms_for(drafters), seed=0)
        specs[name].enable_speculation(drafter, bandits[name], max_traces=0)
        # The bandit first learns this batch size's arm (a generator's bandit runs all along).
        _decode_all(specs[name], _groups(warmup_prompts, sampling), batch)
        before[name] = _snapshot(specs[name])
    totals = _race({"plain": plain, **specs}, _groups(prompts, sampling), batch)
    plain_tokens, plain_s, plain_cpu_s = totals["plain"]
    rate_plain = plain_tokens / plain.stats.decode_s
    out = {"plain": rate_plain, "plain_step_ms": 1e3 * plain.stats.decode_s / max(plain.stats.num_steps, 1)}
    for name, backend in specs.items():
        tokens, wall_s, cpu_s = totals[name]
        d = _since(backend, before[name])
        # Decode throughput: time in decode steps (BackendStats.decode_s; admission and prefill, identical
        # work in both, excluded), and end to end with them for comparison.
        out[name] = {"rate": tokens / d["decode_s"], "speedup": tokens / d["decode_s"] / rate_plain,
                     "with_prefill": (tokens / wall_s) / (plain_tokens / plain_s),
                     "speedup_cpu": (tokens / cpu_s) / (plain_tokens / plain_cpu_s),
                     "arm": str(bandits[name].best(batch)), **d}
    spec = out["spec"]
    # Where a speculative step's time goes, against a plain step (the speedup is tokens per speculative
    # step times plain step time over speculative step time).
    num_spec_steps = max(spec["spec_steps"], 1)
    out.update(spec_draft_ms=1e3 * spec["draft_s"] / num_spec_steps, spec_verify_ms=1e3 * spec["verify_s"] / num_spec_steps,
               emitted_per_spec_step=spec["emitted"] / num_spec_steps / batch,
               accept_rate_by_depth=[round(a / t, 3) for a, t in zip(spec["accepted_by_depth"], spec["tested"],
                                                                     strict=True) if t],
               accept_tested_by_depth=[t for t in spec["tested"] if t])
    log(f"batch {batch}: decode plain {rate_plain:.0f} tok/s; " + "; ".join(
        f"{name} {out[name]['rate']:.0f} tok/s x{out[name]['speedup']:.2f} (arm {out[name]['arm']}, "
        f"{out[name]['plain_steps']} of {out[name]['plain_steps'] + out[name]['spec_steps']} steps plain)"
        for name in specs) + f"; plain step {out['plain_step_ms']:.2f} ms, speculative step: drafting "
        f"{out['spec_draft_ms']:.2f} ms + verifying {out['spec_verify_ms']:.2f} ms + bookkeeping, "
        f"{out['emitted_per_spec_step']:.2f} tokens per row")
    return out


def measure_cuda_graphs(model_path: str, prompts, log, device: str = "cuda", mode: str = "auto",
                        batch_sizes=BATCH_SIZES) -> dict:
    """On a CUDA device: the torch backend with its forwards replayed as CUDA graphs (generator.cuda_graphs,
    engine/generator/torch_backend/graphs.py) against the same backend run eagerly, raced over the same requests at each
    running batch size, plain decoding and model-free speculation (suffix@3: the verify forward of 4 tokens
    per row). Figures: decode throughput with graphs over without, per batch size; graph captures and
    replays. Without a CUDA device: says so, measures nothing (device "cpu" with mode "static": the same race
    of the uncaptured fixed-shape forwards, which is how its test runs it)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        return {"cuda_graphs": "not measured: no CUDA device"}
    from tailrace.engine.core.models import eos_token_ids, load_model, load_tokenizer
    from tailrace.engine.generator.speculation.speculative import FixedDepth
    from tailrace.engine.generator.torch_backend.backend import TorchBackend
    from tailrace.protocol.messages import SamplingParams

    model = load_model(model_path, device=device)
    model.requires_grad_(False)
    eos = eos_token_ids(model, load_tokenizer(model_path))
    requests = _groups(prompts, SamplingParams(temperature=1.0, max_new_tokens=96))
    out: dict = {"cuda_device": torch.cuda.get_device_name() if device == "cuda" else device,
                 "cuda_graphs_speedup_by_batch": {},
                 "cuda_graphs_suffix_speedup_by_batch": {}, "cuda_graphs_captured": 0, "cuda_graphs_replayed": 0}
    for batch in batch_sizes:
        for key, spec in (("cuda_graphs_speedup_by_batch", False), ("cuda_graphs_suffix_speedup_by_batch", True)):
            backends = {}
            for name in ("off", mode):
                backend = TorchBackend(model, max_batch_size=batch, max_model_len=256, eos_token_ids=eos,
                                       device=device, seed=1, static_forwards=name)
                if spec:
                    backend.enable_speculation(None, FixedDepth(3, "suffix"), max_traces=0)
                _decode_all(backend, requests[:batch], batch)  # warm-up: kernels chosen, graphs captured
                backends[name] = backend
            decode_before = {name: b.stats.decode_s for name, b in backends.items()}
            totals = _race(backends, requests, batch)
            rate = {name: totals[name][0] / (b.stats.decode_s - decode_before[name]) for name, b in backends.items()}
            out[key][str(batch)] = round(rate[mode] / rate["off"], 3)
            counters = backends[mode].static_forwards.counters()
            out["cuda_graphs_captured"] += counters["static_forwards_captured"]
            out["cuda_graphs_replayed"] += counters["static_forwards_replayed"]
            log(f"{mode} forwards, batch {batch}{' suffix@3' if spec else ''}: {rate['off']:.0f} -> {rate[mode]:.0f} "
                f"tok/s (x{rate[mode] / rate['off']:.2f})")
    return out


def _token_histogram(model, eos, prompts, drafter, seed: int):
    import torch

    from tailrace.engine.generator.speculation.bandit import SpecBandit
    from tailrace.engine.generator.torch_backend.backend import TorchBackend
    from tailrace.protocol.messages import SamplingParams

    backend = TorchBackend(model, max_batch_size=64, max_model_len=256, eos_token_ids=eos, seed=seed)
    if drafter is not None:  # speculation forced on: both drafters, never off
        arms = ("eagle@2", "eagle@4", "eagle@6", "suffix@2", "suffix@4", "suffix@6")
        backend.enable_speculation(drafter, SpecBandit(arms=arms, seed=seed), max_traces=0)
    requests = _groups(prompts, SamplingParams(temperature=1.0, max_new_tokens=64))
    finished, _ = _decode_all(backend, requests, 64)
    tokens = torch.cat([f.completion_ids for f in finished])
    steps = backend.spec_stats.steps_by if drafter is not None else {}
    return torch.bincount(tokens, minlength=model.config.vocab_size).double(), steps


def _tv(a, b) -> float:
    return 0.5 * float((a / a.sum() - b / b.sum()).abs().sum())


def _measure(model_path: str, sizes: dict, log, cuda_graphs: bool = True) -> dict:
    """Every figure of one policy, its drafter trained on the policy's own rollouts; cuda_graphs: with
    measure_cuda_graphs on the decode prompts."""
    import torch

    from tailrace.engine.core.drafter import Drafter
    from tailrace.engine.core.models import eos_token_ids, load_model, load_tokenizer

    torch.manual_seed(0)
    model = load_model(model_path)
    model.requires_grad_(False)
    tokenizer = load_tokenizer(model_path)
    eos = eos_token_ids(model, tokenizer)
    figures = {"num_layers": model.config.num_hidden_layers}
    drafter = Drafter.for_policy(model, seed=0)
    traces = collect_traces(model, drafter, eos, _prompts(tokenizer, sizes["num_train_prompts"], seed=1), log)
    figures |= train_drafter(drafter, traces, sizes["train_s"], log)
    decode_prompts = _prompts(tokenizer, sizes["num_decode_prompts"], seed=2, min_chars=20)
    warmup_prompts = _prompts(tokenizer, sizes["num_warmup_prompts"], seed=4, min_chars=20)
    by_batch = {b: _throughput(model, drafter, eos, decode_prompts, warmup_prompts, b, log) for b in BATCH_SIZES}
    tv_prompts = _prompts(tokenizer, sizes["num_tv_prompts"], seed=3)
    plain_a, _ = _token_histogram(model, eos, tv_prompts, None, seed=1)
    plain_b, _ = _token_histogram(model, eos, tv_prompts, None, seed=2)
    spec, tv_steps = _token_histogram(model, eos, tv_prompts, drafter, seed=3)
    tv, floor = _tv(spec, plain_a), _tv(plain_b, plain_a)
    log(f"tv: spec vs plain {tv:.4f}, plain vs plain {floor:.4f} ({int(spec.sum())} / {int(plain_a.sum())} tokens; "
        f"speculative steps by drafter {tv_steps})")
    graphs = measure_cuda_graphs(model_path, decode_prompts, log) if cuda_graphs else {}
    return _figures(by_batch, tv, floor, tv_steps) | figures | graphs


def run(quick: bool, log: Callable[[str], None], workload_name: str = "default") -> dict:
    """default: the shipped 4-layer policy. longtail: the shipped 12-layer policy (LONGTAIL_MODEL), its
    drafter trained on its own rollouts as above, with the 4-layer policy's figures beside it (four_layer),
    that policy's drafter trained on its own rollouts too."""
    import torch

    torch.set_num_threads(1)
    sizes = _sizes(quick)
    load_before = round(os.getloadavg()[0], 2)
    if workload_name not in ("default", "longtail"):
        raise ValueError(f"--workload: {workload_name!r} is not one of default, longtail")
    if workload_name == "default":
        model_path = os.environ.get("TAILRACE_BENCH_MODEL", "tiny")
        return _measure(model_path, sizes, log) | {"load_1m_before": load_before,
                                                       "load_1m_after": round(os.getloadavg()[0], 2)}
    deep = _measure(os.environ.get("TAILRACE_BENCH_MODEL", LONGTAIL_MODEL), sizes, log)
    shallow = _measure("tiny", sizes, log, cuda_graphs=False)
    four_layer = {key: shallow[key] for key in FOUR_LAYER_KEYS}
    return {**deep, "four_layer": four_layer, "four_layer_drafter": "its own, trained on its own rollouts",
            "load_1m_before": load_before, "load_1m_after": round(os.getloadavg()[0], 2)}


def _figures(by_batch: dict, tv: float, floor: float, tv_steps: dict) -> dict:
    one = by_batch[1]
    spec_runs = [r["spec"] for r in by_batch.values()]
    accepted, row_steps = sum(r["accepted"] for r in spec_runs), sum(r["row_steps"] for r in spec_runs)

    def rate(name: str, drafter: str) -> float:
        drafted = sum(r[name]["drafted_by"][drafter] for r in by_batch.values())
        return round(sum(r[name]["accepted_by"][drafter] for r in by_batch.values()) / max(drafted, 1), 4)

    def by(name: str, key: str) -> dict:
        return {str(b): round(r[name][key], 3) for b, r in by_batch.items()}

    return {
        "tokens_per_s_plain": round(one["plain"], 1),
        "tokens_per_s_spec": round(one["spec"]["rate"], 1),
        "speedup": round(one["spec"]["speedup"], 3),
        "speedup_eagle": round(one["eagle"]["speedup"], 3),
        "speedup_model_free": round(one["model_free"]["speedup"], 3),
        "speedup_by_batch": by("spec", "speedup"),
        "speedup_eagle_by_batch": by("eagle", "speedup"),
        "speedup_model_free_by_batch": by("model_free", "speedup"),
        "speedup_with_prefill_by_batch": by("spec", "with_prefill"),
        "speedup_cpu_time_with_prefill_by_batch": by("spec", "speedup_cpu"),
        "bandit_arm_by_batch": {str(b): r["spec"]["arm"] for b, r in by_batch.items()},
        "bandit_arm_eagle_by_batch": {str(b): r["eagle"]["arm"] for b, r in by_batch.items()},
        "bandit_arm_model_free_by_batch": {str(b): r["model_free"]["arm"] for b, r in by_batch.items()},
        "accept_rate_eagle": rate("eagle", "eagle"),
        "accept_rate_suffix": rate("model_free", "suffix"),
        "mean_accept_len": round(accepted / max(row_steps, 1), 3),
        "accept_rate_by_depth": one["accept_rate_by_depth"],
        "accept_tested_by_depth": one["accept_tested_by_depth"],
        "plain_step_ms": round(one["plain_step_ms"], 3),
        "spec_draft_ms": round(one["spec_draft_ms"], 3),
        "spec_verify_ms": round(one["spec_verify_ms"], 3),
        "emitted_per_spec_step": round(one["emitted_per_spec_step"], 3),
        "group_size": GROUP_SIZE,
        "tv_distance": round(tv, 4),
        "tv_noise_floor": round(floor, 4),
        "tv_spec_steps_by_drafter": tv_steps,
        "speedup_target": SPEEDUP_TARGET,
    }
