"""Branch-replay benchmark: one training step, same model and data, naive vs replay vs packed, in one run.

    python tools/bench.py replay [--quick] [--json]

Scenarios (the shipped tiny model's architecture, float32, seeded weights and data):
    prompt  G=16 samples of one 4096-token prompt, log-normal completion lengths of median 256
            (--quick: G=8, 1024, median 64)
    tree    a tree-sampled group: a 1024-token trunk, then forks into 2 every ~48 tokens, 6 levels deep:
            64 samples (--quick: 256-token trunk, 4 levels of ~24 tokens)
Every (scenario, mode) runs in its own forked process (imports shared, nothing else), so peak RSS is per
mode: build the model, warm the strategy up on a small slice, time one Learner step (forward/backward,
clip, AdamW) on one torch thread, the fastest of a few from the same weights; save the gradient. Times are
the process's CPU seconds (equal to wall time on an idle core, and unlike wall time not inflated when
other work shares the machine); *_wall_s as well. Naive runs one sample per forward, its fastest setting
here (padded micro-batches run masked attention over every pair).

Figures of the prompt scenario at top level, of the tree one prefixed "tree_": naive_s, replay_s,
packed_s, token_ideal (logical / unique tokens), ideal (naive FLOPs / trie FLOPs from the model's shapes:
linear layers per token, LM head per loss row, attention per query-key pair), ratio (naive / best of
replay and packed), efficiency = ratio / ideal (target 0.9), max_grad_rel_err (replay and packed vs
naive, over all parameters), peak_rss_{naive,replay,packed}_mb.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

MODES = ("naive", "replay", "packed")
SCENARIOS = {
    "prompt": {False: dict(group_size=16, prompt_len=4096, median=256),
               True: dict(group_size=8, prompt_len=1024, median=64)},
    "tree": {False: dict(prompt_len=1024, branching=2, depth=6, segment=48),
             True: dict(prompt_len=256, branching=2, depth=4, segment=24)},
}
EFFICIENCY_TARGET = 0.9
MICRO_BATCH_TOKENS = 8192
"""train.micro_batch_tokens of the replay and packed steps (replay's batch cap; also scale.py's): fixed here,
so that the figures do not move with the trainer's default."""
THREADS = 1
REPEATS = {False: 2, True: 2}
"""Steps timed per mode (each from the same weights); the fastest counts: noise only ever adds time."""
"""torch threads per worker: one, so that the figures hold on a machine whose cores other work shares
(two OpenMP threads competing with other processes run several times slower, and erratically)."""
VOCAB = 64
TINY_SHAPE = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=32768)
"""The shipped tiny model's architecture (Llama, GQA, tied head); built here with seeded random weights, so
the benchmark does not depend on examples/tiny being present (the weights do not change the timing)."""


def bench_model(seed: int = 0, **shape):
    """A Llama causal LM of TINY_SHAPE (overridden by `shape`), float32, SDPA attention."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_SHAPE, **shape}, attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(config).eval()


# ------------------------------------------------------------------------------------------------- data


def _sample(group_id: int, i: int, prompt, completion, gen):
    import torch

    from tailrace.engine.core.samples import TrainSample

    t = len(completion)
    return TrainSample(group_id=group_id, sample_id=i, prompt_ids=prompt, completion_ids=completion,
                       behaviour_logprobs=-4.2 + 0.1 * torch.randn(t, generator=gen),
                       policy_versions=torch.zeros(t, dtype=torch.int64), reward=float(torch.rand((), generator=gen)))


def prompt_group(group_id: int, group_size: int, prompt_len: int, median: int, seed: int = 0):
    """One prompt, group_size completions of log-normal length (sigma 0.6, at least 8 tokens)."""
    import torch

    from tailrace.engine.core.samples import Group

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    lengths = torch.exp(math.log(median) + 0.6 * torch.randn(group_size, generator=gen)).round().clamp(min=8)
    samples = [_sample(group_id, i, prompt, torch.randint(0, VOCAB, (int(n),), generator=gen), gen)
               for i, n in enumerate(lengths.tolist())]
    return Group(group_id=group_id, samples=samples)


def tree_group(group_id: int, prompt_len: int, branching: int, depth: int, segment: int, seed: int = 0):
    """Tree sampling: a trunk, then every path forks into `branching` at every level; segments of
    segment/2..3*segment/2 tokens; one sample per leaf (prompt = trunk)."""
    import torch

    from tailrace.engine.core.samples import Group

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    paths = [torch.zeros(0, dtype=torch.int64)]
    for _ in range(depth):
        paths = [torch.cat([p, torch.randint(0, VOCAB, (int(torch.randint(segment // 2, 3 * segment // 2 + 1, (),
                                                                            generator=gen)),), generator=gen)])
                 for p in paths for _ in range(branching)]
    return Group(group_id=group_id, samples=[_sample(group_id, i, prompt, p, gen) for i, p in enumerate(paths)])


def scenario_groups(name: str, quick: bool):
    params = SCENARIOS[name][quick]
    return [prompt_group(0, **params)] if name == "prompt" else [tree_group(0, **params)]


# ---------------------------------------------------------------------------------------------- FLOPs


def model_flops(config) -> tuple[float, float, float]:
    """Forward FLOPs: (linear layers per token, LM head per loss row, attention per query-key pair)."""
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    per_layer = config.hidden_size * (2 * q + 2 * kv) + 3 * config.hidden_size * config.intermediate_size
    return (2.0 * per_layer * config.num_hidden_layers, 2.0 * config.hidden_size * config.vocab_size,
            4.0 * q * config.num_hidden_layers)


def flop_ideal(config, samples, trie) -> dict:
    """Naive FLOPs (every sample's full causal forward) over trie FLOPs (every unique token once, every
    distinct LM row once, each token attending to its path); backward scales both alike."""
    f_tok, f_head, f_pair = model_flops(config)
    naive = sum((s.num_tokens - 1) * f_tok + s.num_loss_tokens * f_head
                + (s.num_tokens - 1) * s.num_tokens / 2 * f_pair for s in samples)
    trie_flops = trie.num_forward_tokens * f_tok + trie.lm_node_U.numel() * f_head + trie.attention_pairs() * f_pair
    return {"ideal": naive / trie_flops, "token_ideal": trie.num_logical_tokens / trie.num_unique_tokens,
            "logical_tokens": trie.num_logical_tokens, "unique_tokens": trie.num_unique_tokens,
            "naive_tflop": naive * 3 / 1e12}


# --------------------------------------------------------------------------------------------- worker


class _Capture:
    """A ForwardBackward wrapper that times the strategy and keeps a copy of the gradient it leaves."""

    def __init__(self, inner):
        self.inner, self.grads, self.seconds = inner, None, 0.0

    def __call__(self, model, samples, loss_fn, normaliser):
        start = time.process_time()
        stats = self.inner(model, samples, loss_fn, normaliser)
        self.seconds = time.process_time() - start
        self.grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        return stats


def _warm_up(model, strategy, groups) -> None:
    """One small call (first-call allocations, lazy kernels), gradients discarded."""
    import torch

    from tailrace.engine.core.losses import LossNormaliser
    from tailrace.engine.core.samples import TrainSample
    from tailrace.engine.trainer.loss import LossConfig, StepLoss

    small = [TrainSample(group_id=0, sample_id=i, prompt_ids=s.prompt_ids[:64], completion_ids=s.completion_ids[:8],
                         behaviour_logprobs=s.behaviour_logprobs[:8], policy_versions=s.policy_versions[:8],
                         reward=0.0, advantage=1.0) for i, s in enumerate(groups[0].samples[:2])]
    strategy(model, small, StepLoss(small, LossConfig()), LossNormaliser.from_samples(small))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)


def worker(scenario: str, mode: str, quick: bool, out_dir: str) -> None:
    """Runs in a forked child: REPEATS Learner steps from the same weights (a fresh copy each), the
    fastest one reported; the first one's gradient saved. Writes result JSON and the gradient."""
    import copy

    import torch

    from tailrace.engine.config import TrainConfig
    from tailrace.engine.trainer.learner import STRATEGIES, Learner

    torch.set_num_threads(THREADS)
    base = bench_model()
    groups = scenario_groups(scenario, quick)
    # Naive at its fastest: one sample per forward, so no padding and causal attention kernels (padded
    # micro-batches run masked attention over every pair and are slower on this CPU).
    config = TrainConfig(lr=1e-6, replay=mode, max_grad_norm=0.0, log_entropy=False,
                         micro_batch_tokens=1 if mode == "naive" else MICRO_BATCH_TOKENS)
    capture = _Capture(STRATEGIES[mode](config))
    _warm_up(base, capture.inner, groups)
    rss_before_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    steps, grads = [], None
    for _ in range(REPEATS[quick]):
        learner = Learner(copy.deepcopy(base), config, forward_backward=capture)
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        metrics = learner.step(groups)
        steps.append((time.process_time() - start_cpu, time.perf_counter() - start_wall, capture.seconds))
        grads = grads or capture.grads
    torch.save(grads, Path(out_dir) / f"{scenario}_{mode}.pt")
    step_s, wall_s, forward_backward_s = min(steps)
    result = {"step_s": step_s, "wall_s": wall_s, "forward_backward_s": forward_backward_s,
              "rss_before_mb": rss_before_mb, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "padded_tokens": metrics["trainer/tokens/padded"]}
    (Path(out_dir) / f"{scenario}_{mode}.json").write_text(json.dumps(result))


def _run_isolated(scenario: str, mode: str, quick: bool, out_dir: str) -> dict:
    process = mp.get_context("fork").Process(target=worker, args=(scenario, mode, quick, out_dir))
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"{scenario}/{mode} worker failed with exit code {process.exitcode}")
    return json.loads((Path(out_dir) / f"{scenario}_{mode}.json").read_text())


def grad_rel_err(grads, ref) -> float:
    import torch

    g, r = torch.cat([x.flatten().double() for x in grads]), torch.cat([x.flatten().double() for x in ref])
    return float((g - r).norm() / r.norm())


# ------------------------------------------------------------------------------------------------- run


def run_scenario(name: str, quick: bool, log: Callable[[str], None], out_dir: str) -> dict:
    import torch
    from transformers import LlamaConfig

    from tailrace.engine.core.samples import flatten_samples
    from tailrace.engine.replay.trie import build_trie

    samples = flatten_samples(scenario_groups(name, quick))
    figures = flop_ideal(LlamaConfig(**TINY_SHAPE), samples, build_trie(samples))
    log(f"{name}: {len(samples)} samples, {figures['logical_tokens']} logical / {figures['unique_tokens']} unique "
        f"tokens (x{figures['token_ideal']:.2f}), FLOP ideal x{figures['ideal']:.2f}")
    results = {}
    for mode in MODES:
        results[mode] = _run_isolated(name, mode, quick, out_dir)
        r = results[mode]
        log(f"  {mode:7s} step {r['step_s']:7.2f} s CPU ({r['wall_s']:.2f} s wall, forward/backward "
            f"{r['forward_backward_s']:.2f} s), peak RSS {r['peak_rss_mb']:.0f} MB (before the step "
            f"{r['rss_before_mb']:.0f} MB)")
    grads = {m: torch.load(Path(out_dir) / f"{name}_{m}.pt", weights_only=True) for m in MODES}
    best = min(results["replay"]["step_s"], results["packed"]["step_s"])
    ratio = results["naive"]["step_s"] / best
    figures.update({
        **{f"{m}_s": round(results[m]["step_s"], 3) for m in MODES},
        **{f"{m}_wall_s": round(results[m]["wall_s"], 3) for m in MODES},
        "ratio": round(ratio, 3),
        "efficiency": round(ratio / figures["ideal"], 3),
        "max_grad_rel_err": max(grad_rel_err(grads[m], grads["naive"]) for m in ("replay", "packed")),
        **{f"peak_rss_{m}_mb": round(results[m]["peak_rss_mb"]) for m in MODES},
    })
    figures["ideal"], figures["token_ideal"] = round(figures["ideal"], 3), round(figures["token_ideal"], 3)
    figures["naive_tflop"] = round(figures["naive_tflop"], 3)
    log(f"  ratio x{ratio:.2f} of ideal x{figures['ideal']:.2f}: efficiency {figures['efficiency']:.2f}, "
        f"max grad rel err {figures['max_grad_rel_err']:.1e}")
    return figures


def run(quick: bool, log: Callable[[str], None]) -> dict:
    import torch  # noqa: F401  (imported once here; the forked workers share it)
    import transformers  # noqa: F401

    import tailrace.engine.replay.packed  # noqa: F401
    import tailrace.engine.trainer.learner  # noqa: F401

    with tempfile.TemporaryDirectory(prefix="tailrace-replay-bench-") as out_dir:
        prompt = run_scenario("prompt", quick, log, out_dir)
        tree = run_scenario("tree", quick, log, out_dir)
    figures = {**prompt, **{f"tree_{k}": v for k, v in tree.items()}}
    figures["threads"] = THREADS
    figures["efficiency_target"] = EFFICIENCY_TARGET
    figures["efficiency_target_met"] = min(prompt["efficiency"], tree["efficiency"]) >= EFFICIENCY_TARGET
    return figures


if __name__ == "__main__":
    sys.exit("run through tools/bench.py: python tools/bench.py replay [--quick] [--json]")
