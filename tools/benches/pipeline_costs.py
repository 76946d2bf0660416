"""The pipeline benchmark's measurements, each run in a child process before the runs
(tools/benches/pipeline.py): this machine's costs of the workload (decode steps at every batch size,
prefill, training steps against their tokens, the policy's own completion lengths) for the modelled modes,
the drafter pretrained for stream+spec, and its decode speedup per running batch size for
modelled_stream+spec. CPU time on one torch thread, as each role runs.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

Workload = Any  # tools.benches.pipeline.Workload (not imported: pipeline imports this module)

MEASURE_DATA_SEED = 7919  # the length distribution is sampled on other prompts than the runs train on
DRAFTER_TRAIN_S = {True: 20.0, False: 60.0}  # spot training before the runs (stream+spec), by --quick
SPEC_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def load_1m() -> float:
    return round(os.getloadavg()[0], 2)


def _sampling(cfg, stop_token_ids: list[int], **changes):
    """The trainer's sampling parameters (engine/trainer/service.py answer_work)."""
    from tailrace.protocol.messages import SamplingParams

    s = cfg.sampling
    params = dict(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                  stop_token_ids=stop_token_ids)
    return SamplingParams(**(params | changes))


def _prompts(cfg, tokenizer, count: int, seed: int, max_prompt_tokens: int) -> list:
    """The first `count` prompts of the run's data stream with another seed, as the trainer makes them."""
    from dataclasses import replace

    from tailrace.engine.data.prompt_sources import PromptSource

    source = PromptSource(replace(cfg.data, seed=seed), tokenizer, max_prompt_tokens=max_prompt_tokens)
    return [next(source) for _ in range(count)]


def measure_decode(cfg, model, prompts, steps: int) -> tuple[dict[int, list[float]], list, float]:
    """CPU seconds of decode steps at every batch size (eos off, so the batch stays full), prefill
    points (padded tokens, seconds), and the wall / CPU time ratio seen (contention)."""
    from tailrace.engine.generator.torch_backend.backend import Request, TorchBackend

    size_max, max_len = cfg.generator.max_batch_size, model.config.max_position_embeddings
    sampling = _sampling(cfg, [], max_new_tokens=steps + 1)
    decode: dict[int, list[float]] = {}
    prefill, wall, cpu = [], 0.0, 0.0
    warm_up = _sampling(cfg, [], max_new_tokens=1)
    for size in range(1, size_max + 1):
        backend = TorchBackend(model, max_batch_size=size_max, max_model_len=max_len, eos_token_ids=(), seed=size)
        rows = [prompts[i % len(prompts)].token_ids for i in range(size)]
        # A long-lived generator's admissions find the backend warm: the first of a new one (~25 ms more
        # on the tiny model, about 8x a steady prefill of one row) is left out, or the fitted prefill
        # intercept carries it into every modelled admission.
        for i, ids in enumerate(rows):
            backend.add(Request(i, 1, ids, warm_up))
        while backend.num_waiting or backend.num_running:
            backend.step()
        for i, ids in enumerate(rows):
            backend.add(Request(i, 0, ids, sampling))
        start = time.process_time()
        backend.step()  # admission: prefill and the first decode step
        admission_s = time.process_time() - start
        decode[size] = []
        while backend.num_running:
            start, start_wall = time.process_time(), time.perf_counter()
            backend.step()
            decode[size].append(time.process_time() - start)
            cpu, wall = cpu + decode[size][-1], wall + time.perf_counter() - start_wall
        # ModelledBackend charges an admitting step prefill + one decode step: the prefill point is the
        # admitting step less this size's decode step, or every modelled admission pays that step twice.
        prefill.append((size * max(len(ids) - 1 for ids in rows),
                        max(0.0, admission_s - statistics.median(decode[size]))))
    return decode, prefill, wall / max(cpu, 1e-9)


def measure_completions(cfg, model, tokenizer, prompts) -> list:
    """The real model's completions of the prompts, group_size samples each, sampled as the generator does."""
    from tailrace.engine.core import models
    from tailrace.engine.generator.torch_backend.backend import Request, TorchBackend

    backend = TorchBackend(model, max_batch_size=cfg.generator.max_batch_size,
                           max_model_len=model.config.max_position_embeddings,
                           eos_token_ids=models.eos_token_ids(model, tokenizer), seed=0)
    sampling = _sampling(cfg, [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    for prompt in prompts:
        for sid in range(cfg.sampling.group_size):
            backend.add(Request(prompt.prompt_id, sid, prompt.token_ids, sampling))
    finished = []
    while backend.num_running or backend.num_waiting:
        finished += backend.step()
    return finished


def measure_train(cfg, tokenizer, prompts, finished, sizes: list[int]) -> tuple[list, list, list]:
    """(train tokens, CPU seconds) of real learner steps, the trainer's config, on batches of `sizes`
    groups of the real completions; then of forward/backward calls (Learner.accumulate) of those sizes,
    and (third) the CPU seconds of the step that follows each, when every group was accumulated: the
    optimizer's share."""
    from tailrace.engine.core import models
    from tailrace.engine.core.samples import Group, TrainSample, flatten_samples
    from tailrace.engine.data import tasks
    from tailrace.engine.trainer.learner import Learner
    from tools.benches.modelled import train_tokens

    by_id = {p.prompt_id: p for p in prompts}
    groups: dict[int, list] = {}
    for f in finished:
        prompt = by_id[f.group_id]
        reward = tasks.score(prompt.text, tokenizer.decode(f.completion_ids.tolist(), skip_special_tokens=True),
                             prompt.metadata)
        groups.setdefault(f.group_id, []).append(TrainSample(
            group_id=f.group_id, sample_id=f.sample_id, prompt_ids=prompt.token_ids, completion_ids=f.completion_ids,
            behaviour_logprobs=f.behaviour_logprobs, policy_versions=f.policy_versions, reward=reward,
            temperature=cfg.sampling.temperature or 1.0, finish_reason=f.finish_reason))
    all_groups = [Group(group_id=g, samples=s) for g, s in sorted(groups.items())]
    model = models.load_model(cfg.model.path or "tiny", dtype=cfg.model.dtype)
    model.train()
    learner = Learner(model, cfg.train, lora_config=cfg.model.lora)
    learner.step(all_groups[:1])  # warm-up: optimizer state, allocator
    points, calls, optimizer = [], [], []
    for accumulate in (False, True):
        for i, size in enumerate(sizes):
            first = (3 * i) % max(1, len(all_groups) - size + 1)  # other groups each time: a spread of lengths
            batch = all_groups[first: first + size]
            tokens = train_tokens(flatten_samples(batch), cfg.train.micro_batch_tokens, cfg.train.replay)
            start = time.process_time()
            if accumulate:
                learner.accumulate(batch)
                calls.append((tokens, time.process_time() - start))
                start = time.process_time()
                learner.step(batch)  # every group accumulated: the optimizer step alone
                optimizer.append(time.process_time() - start)
            else:
                learner.step(batch)
                points.append((tokens, time.process_time() - start))
    return points, calls, optimizer


def measure_costs(w: Workload, path: Path, quick: bool, log: Callable[[str], None]) -> None:
    """Measure this machine's costs for workload `w` and write them to `path` (run in a child process)."""
    import torch

    from tailrace.engine.core import models
    from tools.benches.modelled import Completion, Costs, LinearCost, MeasuredCost

    torch.set_num_threads(1)  # as each role runs (launch.torch_threads)
    cfg = w.config()
    tokenizer = models.load_tokenizer(cfg.model.path or "tiny")
    model = models.load_model(cfg.model.path or "tiny", dtype=cfg.model.dtype)
    max_prompt = model.config.max_position_embeddings - w.max_new_tokens
    prompts = _prompts(cfg, tokenizer, 16 if quick else 48, MEASURE_DATA_SEED, max_prompt)
    load_before = load_1m()
    decode, prefill, contention = measure_decode(cfg, model, prompts, 6 if quick else 24)
    log(f"decode step: {1e3 * statistics.median(decode[1]):.2f} ms CPU at batch 1, "
        f"{1e3 * statistics.median(decode[w.max_batch_size]):.2f} ms at batch {w.max_batch_size} "
        f"(wall / CPU time while measuring: {contention:.2f})")
    finished = measure_completions(cfg, model, tokenizer, prompts)
    completions = [Completion(len(f.prompt_ids), len(f.completion_ids), f.finish_reason) for f in finished]
    lengths = sorted(c.completion_tokens for c in completions)
    log(f"completions: {len(lengths)} samples, median {statistics.median(lengths)} tokens, "
        f"p99 {_quantile(lengths, 0.99)}, max {lengths[-1]}, "
        f"{sum(c.finish_reason == 'length' for c in completions)} cut at max_new_tokens")
    train_points, call_points, optimizer = measure_train(cfg, tokenizer, prompts, finished,
                                                         [2, 8, 4] if quick else [1, 2, 4, 8, 12, 8, 4, 16])
    train, call = LinearCost.fit(train_points), MeasuredCost.of(call_points)
    optimizer_s = statistics.median(optimizer)
    log(f"train step: {train.intercept_s * 1e3:.1f} ms + {train.per_token_s * 1e6:.1f} us per padded token "
        f"({', '.join(f'{t} tokens {s:.3f} s' for t, s in train_points)}); a forward/backward call: "
        f"{', '.join(f'{t:.0f} tokens {s:.3f} s' for t, s in call.points)}; the optimizer step after it "
        f"{optimizer_s * 1e3:.1f} ms")
    Costs(decode_step_s=decode, prefill=LinearCost.fit(prefill), train=train, call=call, optimizer_s=optimizer_s,
          completions=completions,
          info={"clock": "process CPU time, 1 torch thread", "wall_over_cpu": contention,
                "load_1m_before": load_before, "load_1m_after": load_1m(), "train_points": train_points,
                "call_points": call_points,
                "data_seed": MEASURE_DATA_SEED, "num_layers": model.config.num_hidden_layers}).save(path)


def measure_spec_speedup(w: Workload, drafter_dir: Path, costs_path: Path, spec_costs_path: Path, quick: bool,
                         log: Callable[[str], None]) -> None:
    """Decode throughput with speculation over without, per running batch size (SPEC_BATCH_SIZES up to
    generator.max_batch_size), on GRPO groups of the workload's prompts (another data seed), with the
    pretrained drafter and the bandit over every drafter (generator.speculation on), plain and speculative
    backends stepping in turn (tools/benches/spec.py); decode time only, prefill is charged apart. Writes
    the costs file again with spec_speedup, and its spec variant (speculate true) to spec_costs_path (run in
    a child process)."""
    import dataclasses

    import torch

    from tailrace.engine.core import models
    from tailrace.engine.core.drafter import Drafter
    from tailrace.engine.generator.speculation.bandit import SpecBandit, arms_for
    from tailrace.engine.generator.torch_backend.backend import Request, TorchBackend
    from tools.benches.modelled import load_costs
    from tools.benches.spec import _decode_all, _race, _since, _snapshot

    torch.set_num_threads(1)
    cfg = w.config()
    tokenizer = models.load_tokenizer(cfg.model.path or "tiny")
    model = models.load_model(cfg.model.path or "tiny", dtype=cfg.model.dtype).requires_grad_(False)
    eos = models.eos_token_ids(model, tokenizer)
    drafter = Drafter.load(drafter_dir, model)
    max_prompt = model.config.max_position_embeddings - w.max_new_tokens
    # The bandit first learns each batch size's arm on warm-up groups enough to fill that batch three
    # times over (a generator's bandit runs all along), then both backends decode the measured groups.
    num_measured = 6 if quick else 16
    num_warmup = _groups_to_fill(3 * max(SPEC_BATCH_SIZES), w.group_size)
    prompts = _prompts(cfg, tokenizer, num_measured + num_warmup, MEASURE_DATA_SEED + 2, max_prompt)
    warmup, measured = prompts[:num_warmup], prompts[num_warmup:]
    sampling = _sampling(cfg, eos)

    def groups(chunk):
        return [Request(p.prompt_id, i, p.token_ids, sampling) for p in chunk for i in range(w.group_size)]

    speedup = {}
    for batch in (b for b in SPEC_BATCH_SIZES if b <= w.max_batch_size):
        plain = TorchBackend(model, max_batch_size=batch, max_model_len=model.config.max_position_embeddings,
                             eos_token_ids=eos, seed=1)
        spec = TorchBackend(model, max_batch_size=batch, max_model_len=model.config.max_position_embeddings,
                            eos_token_ids=eos, seed=2)
        spec.enable_speculation(drafter, SpecBandit(arms_for(("eagle", "suffix")), seed=0), max_traces=0)
        _decode_all(spec, groups(warmup[:_groups_to_fill(3 * batch, w.group_size)]), batch)
        before, plain_before = _snapshot(spec), plain.stats.decode_s
        totals = _race({"plain": plain, "spec": spec}, groups(measured), batch)
        spec_rate = totals["spec"][0] / _since(spec, before)["decode_s"]
        speedup[batch] = spec_rate / (totals["plain"][0] / (plain.stats.decode_s - plain_before))
    log("speculative decode speedup by running batch (pretrained drafter, bandit over every drafter): "
        + ", ".join(f"{b}: {x:.2f}x" for b, x in speedup.items()))
    costs = dataclasses.replace(load_costs(costs_path), spec_speedup=speedup)
    costs.save(costs_path)
    dataclasses.replace(costs, speculate=True).save(spec_costs_path)


def pretrain_drafter(w: Workload, folder: Path, quick: bool, log: Callable[[str], None]) -> None:
    """Train a drafter on the policy's own rollouts of other prompts than the runs train on, as the spot
    trainer does, and save it to `folder` (run in a child process)."""
    import torch

    from tailrace.engine.core import models
    from tailrace.engine.core.drafter import Drafter
    from tools.benches.spec import collect_traces, train_drafter

    torch.set_num_threads(1)
    cfg = w.config()
    tokenizer = models.load_tokenizer(cfg.model.path or "tiny")
    model = models.load_model(cfg.model.path or "tiny", dtype=cfg.model.dtype).requires_grad_(False)
    max_prompt = model.config.max_position_embeddings - w.max_new_tokens
    prompts = _prompts(cfg, tokenizer, 1024 if quick else 4096, MEASURE_DATA_SEED + 1, max_prompt)
    drafter = Drafter.for_policy(model, seed=0)
    traces = collect_traces(model, drafter, models.eos_token_ids(model, tokenizer), [p.token_ids for p in prompts],
                            log)
    train_drafter(drafter, traces, DRAFTER_TRAIN_S[quick], log)
    drafter.save(folder)


def _groups_to_fill(rows: int, group_size: int) -> int:
    return math.ceil(rows / group_size)


def _quantile(sorted_values: list, q: float):
    return sorted_values[round(q * (len(sorted_values) - 1))]
