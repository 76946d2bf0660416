"""Multi-turn benchmark (issue #33): real episodes of the example environment against single-turn groups of the
default workload, on the same model (the shipped tiny one), in one run.

    python tools/bench.py multiturn [--quick] [--json]

1. Episodes. A forked child generates one step's groups (groups_per_step of examples/multiturn/config.toml,
   G = 8; --quick: 2) as a generator does: the TorchBackend with the generator's episode loop
   (engine/generator/episodes.py, Episodes) against the example environment (examples/multiturn/reverse_chain.py:
   a chain of 3-6 words, one per turn, env.max_turns 6), run in-process: InProcessEnv below instantiates the class
   per episode and checks each return value with the SDK's own to_observation (protocol/env_sdk.py), as an
   environment server would, with the data row's metadata as the trainer sends it. Another child generates as
   many single-turn groups of the default workload (tools/benches/pipeline.py workload "default": the default
   task, G = 8, max_new_tokens 64) with the same backend and model.
   env_wait_share: of the episode child's generation wall time, the share the loop spent with no row to decode,
   waiting on the environment alone (the time an environment costs a generator); env_call_ms_mean: Episodes'
   env_wait_s over num_env_calls (calls overlap decoding, so their sum is not the generator's loss).
2. Replay. token_saving_{multiturn,singleturn}: logical over unique tokens of the groups' trie (build_trie), and
   replay_saving = their ratio (multi-turn over single-turn). Then one Learner step per (workload, mode) in its
   own forked process, as tools/benches/replay.py does (one torch thread, CPU seconds, the fastest of REPEATS from
   the same weights; naive one sample per forward, its fastest setting; auto = train.replay's default):
   replay_speedup_{multiturn,singleturn} = naive_s / auto_s, speedup_ratio = multi-turn's over single-turn's,
   target_met = speedup_ratio >= 1.5 (the issue's target), max_grad_rel_err (auto vs naive). A group's samples
   share a trie path only while their tokens agree: a multi-turn group shares the prompt and every early turn its
   samples answered alike (then the same observation follows); first_divergence_mean says where (completion
   tokens) a group's samples part, on average over pairs.
3. Pipeline. The example config run as separate processes (pipeline.run_pipeline: trainer, 2 generators, and the
   example's environment server, `tailrace env`), sync (controller.max_staleness 0, train.early_backward false)
   and stream (max_staleness 1), the same steps: pipeline_ratio = sync_s / stream_s, timed from the first
   generator joining to the last step's weights (--quick: 3 steps of 4 groups; the full run 12 steps of 8,
   each mode twice in mirrored order, means).
Test: pytest tests/tools/test_multiturn_bench.py
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.benches.pipeline import BARRIER, PLAIN, _preload, run_pipeline, workload
from tools.benches.pipeline_costs import _prompts, _sampling, load_1m, measure_completions

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "multiturn" / "config.toml"
ENV_CLASS = "examples.multiturn.reverse_chain:ReverseChain"
SPEEDUP_TARGET = 1.5
"""Replay's measured speedup on multi-turn groups over its single-turn figure on the same model (issue #33)."""
MODES = ("naive", "auto")
MICRO_BATCH_TOKENS = 8192  # as tools/benches/replay.py: fixed, so that the figures do not move with the default
REPEATS = {False: 3, True: 2}
GROUPS = {False: 0, True: 2}  # groups per workload; 0 = the example's train.groups_per_step
PIPELINE = {False: dict(steps=12, groups=8, runs=2, timeout_s=600), True: dict(steps=3, groups=4, runs=1, timeout_s=240)}
GEN_TIMEOUT_S = 600.0
_fork = mp.get_context("fork")


def example_config(overrides: list[str] | None = None):
    """examples/multiturn/config.toml, its data path made absolute (the bench may run from anywhere)."""
    from tailrace.engine.config import load_config

    return load_config(EXAMPLE, ["--data.source", str(ROOT / "examples/multiturn/prompts.jsonl"), *(overrides or [])])


# ------------------------------------------------------------------------------------------- generation


class InProcessEnv:
    """The Environment protocol (engine/generator/environment.py) over a Python environment class run in this
    process: one instance per episode, sync methods called directly, each value checked by the SDK's
    to_observation (what an environment server sends). metadata: group id -> the data row's metadata, which the
    trainer's broker would send (Episodes passes {} in-process: work items carry none)."""

    def __init__(self, make_env: Callable[[], Any], metadata: dict[int, dict]):
        self.make_env, self.metadata = make_env, metadata
        self.envs: dict[Any, Any] = {}

    @staticmethod
    def _observation(value: Any):
        from tailrace.engine.generator.environment import EnvironmentError, Observation
        from tailrace.protocol import messages as m
        from tailrace.protocol.env_sdk import to_observation

        msg = to_observation(0, 0, value)
        if isinstance(msg, m.EnvError):
            raise EnvironmentError(msg.reason, msg.text)
        return Observation(text=msg.text, token_ids=msg.token_ids, done=msg.done, reward=msg.reward,
                           info=dict(msg.info))

    async def reset(self, episode, task: str, prompt: str, metadata: dict):
        env = self.envs[episode] = self.make_env()
        return self._observation(env.reset(prompt, {**self.metadata[episode.group_id], **metadata}))

    async def step(self, episode, action: str):
        return self._observation(self.envs[episode].step(action))

    async def close(self, episode) -> None:
        env = self.envs.pop(episode, None)
        if env is not None and hasattr(env, "close"):
            env.close()


async def _drive(backend, episodes, items, timeout_s: float) -> tuple[list, float]:
    """The generator service's loop in small (engine/generator/service.py): apply() between backend steps,
    on_finished() per Finished, waiting on notify() when only environments are busy. Returns the finished
    samples and the seconds spent waiting with no row to decode (the environment's cost to the generator)."""
    wake = asyncio.Event()
    episodes.notify = wake.set
    total = sum(item.num_samples for item in items)
    for item in items:
        episodes.admit(item)
    out: list = []
    idle_s = 0.0
    deadline = time.monotonic() + timeout_s
    while len(out) < total:
        if time.monotonic() > deadline:
            raise RuntimeError(f"episodes not done within {timeout_s:g} s: {len(out)} of {total}")
        out += episodes.apply(backend)
        if backend.num_running or backend.num_waiting:
            for fin in await asyncio.to_thread(backend.step):
                done = episodes.on_finished(fin)
                if done is not None:
                    out.append(done)
        elif len(out) < total:
            wake.clear()
            if not episodes.ops:
                start = time.perf_counter()
                await asyncio.wait_for(wake.wait(), max(0.0, deadline - time.monotonic()))
                idle_s += time.perf_counter() - start
    await episodes.aclose()
    return out, idle_s


def _train_samples(cfg, prompts, finished, rewards: Callable[[Any, Any], float]) -> list:
    import torch

    from tailrace.engine.core.samples import Group, TrainSample

    by_id = {p.prompt_id: p for p in prompts}
    groups: dict[int, list] = {}
    for f in finished:
        if f.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"sample {f.group_id}/{f.sample_id} ended with {f.finish_reason!r}")
        prompt = by_id[f.group_id]
        groups.setdefault(f.group_id, []).append(TrainSample(
            group_id=f.group_id, sample_id=f.sample_id, prompt_ids=torch.tensor(prompt.token_ids),
            completion_ids=f.completion_ids, behaviour_logprobs=f.behaviour_logprobs,
            policy_versions=f.policy_versions, reward=rewards(prompt, f), temperature=cfg.sampling.temperature or 1.0,
            finish_reason=f.finish_reason, loss_mask=f.loss_mask))
    return [Group(group_id=g, samples=sorted(s, key=lambda x: x.sample_id)) for g, s in sorted(groups.items())]


def generate(kind: str, quick: bool, out_path: str) -> None:
    """A forked child: one step's groups of `kind` (multiturn: the example's episodes; singleturn: the default
    workload) from the shipped tiny model; writes them (torch.save) and the generation figures (JSON)."""
    import torch

    from tailrace.engine.core import models
    from tailrace.engine.data import tasks
    from tailrace.engine.generator.episodes import Episodes, EpisodeSettings
    from tailrace.engine.generator.torch_backend.backend import TorchBackend
    from tailrace.protocol.env_sdk import load_class
    from tailrace.protocol.messages import WorkItem

    torch.set_num_threads(1)
    cfg = example_config() if kind == "multiturn" else workload("default", quick).config()
    num_groups = GROUPS[quick] or example_config().train.groups_per_step
    tokenizer = models.load_tokenizer(cfg.model.path or "tiny")
    model = models.load_model(cfg.model.path or "tiny", dtype=cfg.model.dtype).requires_grad_(False)
    max_len = model.config.max_position_embeddings
    budget = (cfg.env.max_episode_tokens or cfg.sampling.max_new_tokens) if kind == "multiturn" \
        else cfg.sampling.max_new_tokens
    prompts = _prompts(cfg, tokenizer, num_groups, cfg.data.seed, max_len - budget)
    figures: dict[str, Any] = {}
    if kind == "multiturn":
        backend = TorchBackend(model, max_batch_size=cfg.generator.max_batch_size, max_model_len=max_len,
                               eos_token_ids=models.eos_token_ids(model, tokenizer), seed=0)
        sampling = _sampling(cfg, [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        start = time.perf_counter()
        env = InProcessEnv(load_class(ENV_CLASS), {p.prompt_id: dict(p.metadata) for p in prompts})
        settings = EpisodeSettings.from_config(cfg.env)
        items = [WorkItem(group_id=p.prompt_id, prompt_token_ids=p.token_ids, num_samples=cfg.sampling.group_size,
                          first_sample_id=0, sampling=sampling, task=p.task, max_turns=cfg.env.max_turns)
                 for p in prompts]

        async def episodes_run():
            episodes = Episodes(env, tokenizer, settings)
            finished, idle_s = await _drive(backend, episodes, items, GEN_TIMEOUT_S)
            return finished, idle_s, episodes

        finished, idle_s, episodes = asyncio.run(episodes_run())
        wall_s = time.perf_counter() - start
        figures |= {"env_wait_s": episodes.env_wait_s, "env_calls": episodes.num_env_calls, "env_idle_s": idle_s,
                    "ended_by": dict(episodes.ended_by), "turns": [f.num_turns for f in finished]}
        groups = _train_samples(cfg, prompts, finished, lambda p, f: float(f.env_reward or 0.0))
    else:
        start = time.perf_counter()
        finished = measure_completions(cfg, model, tokenizer, prompts)  # the pipeline bench's own sampling
        wall_s = time.perf_counter() - start

        def score(prompt, f) -> float:
            value = tasks.score(prompt.text, tokenizer.decode(f.completion_ids.tolist(), skip_special_tokens=True),
                                prompt.metadata)
            return float(value["reward"] if isinstance(value, dict) else value)

        groups = _train_samples(cfg, prompts, finished, score)
    figures["generation_s"] = wall_s
    torch.save(groups, out_path)
    Path(out_path).with_suffix(".json").write_text(json.dumps(figures))


# ---------------------------------------------------------------------------------------------- training


def train_worker(groups_path: str, mode: str, quick: bool, out_path: str) -> None:
    """A forked child: REPEATS Learner steps (train.replay = mode) on the saved groups from the same weights (a
    fresh copy each), the fastest reported in CPU seconds; the first step's gradient saved."""
    import copy

    import torch

    from tailrace.engine.config import TrainConfig
    from tailrace.engine.core import models
    from tailrace.engine.trainer.learner import STRATEGIES, Learner
    from tools.benches.replay import _Capture

    torch.set_num_threads(1)
    groups = torch.load(groups_path, weights_only=False)
    base = models.load_model("tiny")
    config = TrainConfig(lr=1e-6, replay=mode, max_grad_norm=0.0, log_entropy=False,
                         micro_batch_tokens=1 if mode == "naive" else MICRO_BATCH_TOKENS)
    capture = _Capture(STRATEGIES[mode](config))
    Learner(copy.deepcopy(base), config, forward_backward=capture).step(groups[:1])  # warm-up: first calls
    steps, grads = [], None
    for _ in range(REPEATS[quick]):
        learner = Learner(copy.deepcopy(base), config, forward_backward=capture)
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        learner.step(groups)
        steps.append((time.process_time() - start_cpu, time.perf_counter() - start_wall))
        grads = grads or capture.grads
    torch.save(grads, out_path + ".grad")
    step_s, wall_s = min(steps)
    Path(out_path).write_text(json.dumps({"step_s": step_s, "wall_s": wall_s,
                                          "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def _child(target: Callable, *args) -> None:
    process = _fork.Process(target=target, args=args)
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"{target.__name__}{args[:2]} failed with exit code {process.exitcode}")


# -------------------------------------------------------------------------------------------------- figures


def trie_figures(groups) -> dict:
    """Logical and unique tokens of the groups' trie, and where a group's samples part (completion tokens, the
    mean over its pairs of samples of their common prefix)."""
    from tailrace.engine.core.samples import flatten_samples
    from tailrace.engine.replay.trie import build_trie

    trie = build_trie(flatten_samples(groups))
    common = []
    for g in groups:
        ids = [s.completion_ids.tolist() for s in g.samples]
        for i in range(len(ids)):
            for j in range(i + 1, len(ids)):
                n = 0
                while n < min(len(ids[i]), len(ids[j])) and ids[i][n] == ids[j][n]:
                    n += 1
                common.append(n)
    samples = [s for g in groups for s in g.samples]
    return {"logical_tokens": trie.num_logical_tokens, "unique_tokens": trie.num_unique_tokens,
            "token_saving": trie.num_logical_tokens / trie.num_unique_tokens,
            "first_divergence_mean": statistics.fmean(common) if common else 0.0,
            "prompt_tokens_mean": statistics.fmean(s.prompt_ids.numel() for s in samples),
            "completion_tokens_mean": statistics.fmean(s.completion_ids.numel() for s in samples),
            "samples": len(samples), "groups": len(groups),
            "reward_mean": statistics.fmean(s.reward for s in samples)}


def target_note(multi: dict, single: dict) -> str:
    """Why replay gains less on the multi-turn groups than on the single-turn ones, from what was measured."""
    return (f"the multi-turn group's samples part after {multi['first_divergence_mean']:.1f} of their "
            f"{multi['completion_tokens_mean']:.1f} completion tokens on average (each samples its first answer; "
            f"they differ, and an observation is shared only after identical turns), so a group shares little more "
            f"than its {multi['prompt_tokens_mean']:.1f}-token prompt: x{multi['token_saving']:.2f} logical over unique "
            f"tokens, against x{single['token_saving']:.2f} for the single-turn default workload, whose "
            f"{single['prompt_tokens_mean']:.1f}-token prompt outweighs its {single['completion_tokens_mean']:.1f}-token "
            f"completions")


def grad_rel_err(grads, ref) -> float:
    import torch

    g, r = torch.cat([x.flatten().double() for x in grads]), torch.cat([x.flatten().double() for x in ref])
    return float((g - r).norm() / r.norm())


def pipeline_runs(work: Path, quick: bool, log: Callable[[str], None]) -> dict:
    """The example config, sync and stream, as separate processes with the example's environment server."""
    p = PIPELINE[quick]
    results: dict[str, list[dict]] = {"sync": [], "stream": []}
    order = ["sync", "stream"] * p["runs"]
    if p["runs"] > 1:
        order = ["sync", "stream", "stream", "sync"]  # mirrored: a drift in the machine's load weighs alike
    for i, mode in enumerate(order):
        args = ["--config", str(EXAMPLE), "--data.source", str(ROOT / "examples/multiturn/prompts.jsonl"),
                "--train.steps", str(p["steps"]), "--train.groups_per_step", str(p["groups"]),
                "--controller.max_staleness", "0" if mode == "sync" else "1", "--trainer.stats_interval_s", "0.2",
                *PLAIN, *(BARRIER if mode == "sync" else ())]
        load = load_1m()
        r = run_pipeline(work / "runs", f"{i}-{mode}", args, p["steps"], timeout_s=p["timeout_s"],
                         env_server=ENV_CLASS)
        r["load_1m"] = load
        results[mode].append(r)
        log(f"pipeline {mode:6s} {r['seconds']:7.2f} s   idle: trainer {r['idle_trainer']:.2f}, generators "
            f"{r['idle_generators']:.2f}   samples {r['samples_trained']}, discarded {r['discarded']}   load {load}")
    sync_s = statistics.fmean(r["seconds"] for r in results["sync"])
    stream_s = statistics.fmean(r["seconds"] for r in results["stream"])
    trained = {r["samples_trained"] for runs in results.values() for r in runs}
    return {"sync_s": round(sync_s, 3), "stream_s": round(stream_s, 3), "pipeline_ratio": round(sync_s / stream_s, 3),
            "pipeline_steps": p["steps"], "pipeline_groups_per_step": p["groups"], "pipeline_runs_per_mode": p["runs"],
            "samples_equal": len(trained) == 1, "samples_trained": sorted(trained),
            "discarded": {mode: [r["discarded"] for r in runs] for mode, runs in results.items()},
            "idle_trainer_sync": round(statistics.fmean(r["idle_trainer"] for r in results["sync"]), 3),
            "idle_trainer_stream": round(statistics.fmean(r["idle_trainer"] for r in results["stream"]), 3),
            # the generators' Stats (summary.json): environment calls and their mean duration in the real runs
            "env_calls_pipeline": {mode: [int(r["env_calls"]) for r in runs] for mode, runs in results.items()},
            "env_call_ms_mean_pipeline": round(1e3 * sum(r["env_wait_s"] for runs in results.values() for r in runs)
                                               / max(1.0, sum(r["env_calls"] for runs in results.values() for r in runs)), 3),
            "max_staleness_seen": {mode: max(r["max_staleness_seen"] for r in runs) for mode, runs in results.items()},
            "load_1m_pipeline": {mode: [r["load_1m"] for r in runs] for mode, runs in results.items()}}


def run(quick: bool, log: Callable[[str], None]) -> dict:
    import torch

    work = Path(tempfile.mkdtemp(prefix="tailrace-bench-multiturn-"))
    load_before = load_1m()
    log(f"load (1 min) {load_before}; files in {work} (removed unless the benchmark fails)")
    _preload("tiny")
    import tailrace.engine.generator.episodes  # noqa: F401  (imported once: the forked children share them)
    import tailrace.engine.replay.packed  # noqa: F401
    import tailrace.engine.trainer.learner  # noqa: F401

    out: dict[str, Any] = {"load_1m": load_before}
    trie = {}
    for kind in ("multiturn", "singleturn"):
        path = str(work / f"{kind}.pt")
        _child(generate, kind, quick, path)
        gen = json.loads(Path(path).with_suffix(".json").read_text())
        groups = torch.load(path, weights_only=False)
        trie[kind] = t = trie_figures(groups)
        log(f"{kind}: {t['samples']} samples in {t['groups']} groups, generated in {gen['generation_s']:.2f} s; "
            f"{t['logical_tokens']} logical / {t['unique_tokens']} unique tokens (x{t['token_saving']:.3f}); prompt "
            f"{t['prompt_tokens_mean']:.1f}, completion {t['completion_tokens_mean']:.1f} tokens (mean); samples "
            f"part after {t['first_divergence_mean']:.1f} completion tokens; reward {t['reward_mean']:.3f}")
        out |= {f"{k}_{kind}": round(v, 3) if isinstance(v, float) else v for k, v in t.items()}
        out[f"generation_s_{kind}"] = round(gen["generation_s"], 3)
        if kind == "multiturn":
            turns = gen["turns"]
            out |= {"env_wait_share": round(gen["env_idle_s"] / gen["generation_s"], 4),
                    "env_wait_s": round(gen["env_idle_s"], 4), "env_calls": gen["env_calls"],
                    "env_call_ms_mean": round(1e3 * gen["env_wait_s"] / max(1, gen["env_calls"]), 3),
                    "turns_mean": round(statistics.fmean(turns), 3), "turns_min": min(turns), "turns_max": max(turns),
                    "ended_by": gen["ended_by"]}
            log(f"  environment: {gen['env_calls']} calls, {out['env_call_ms_mean']:.3f} ms each (mean); the "
                f"generator waited on it alone {gen['env_idle_s']:.3f} s of {gen['generation_s']:.2f} s "
                f"(share {out['env_wait_share']:.4f}); turns {min(turns)}-{max(turns)}, mean {out['turns_mean']}")
        times = {}
        for mode in MODES:
            result = str(work / f"{kind}_{mode}.json")
            _child(train_worker, path, mode, quick, result)
            times[mode] = json.loads(Path(result).read_text())
            log(f"  {mode:5s} step {times[mode]['step_s']:.3f} s CPU ({times[mode]['wall_s']:.3f} s wall), "
                f"peak RSS {times[mode]['peak_rss_mb']:.0f} MB")
        grads = {m: torch.load(str(work / f"{kind}_{m}.json") + ".grad", weights_only=True) for m in MODES}
        speedup = times["naive"]["step_s"] / times["auto"]["step_s"]
        out |= {f"naive_s_{kind}": round(times["naive"]["step_s"], 4), f"auto_s_{kind}": round(times["auto"]["step_s"], 4),
                f"replay_speedup_{kind}": round(speedup, 3),
                f"max_grad_rel_err_{kind}": grad_rel_err(grads["auto"], grads["naive"])}
        log(f"  replay speedup x{speedup:.3f} (naive / auto), max grad rel err {out[f'max_grad_rel_err_{kind}']:.1e}")
    out["replay_saving"] = round(trie["multiturn"]["token_saving"] / trie["singleturn"]["token_saving"], 3)
    ratio = out["replay_speedup_multiturn"] / out["replay_speedup_singleturn"]
    out |= {"speedup_ratio": round(ratio, 3), "speedup_target": SPEEDUP_TARGET, "target_met": ratio >= SPEEDUP_TARGET}
    if not out["target_met"]:
        out["target_note"] = target_note(trie["multiturn"], trie["singleturn"])
        log(f"target not met: {out['target_note']}")
    out |= pipeline_runs(work, quick, log)
    out["load_1m_after"] = load_1m()
    shutil.rmtree(work, ignore_errors=True)
    return out


if __name__ == "__main__":
    sys.exit("run through tools/bench.py: python tools/bench.py multiturn [--quick] [--json]")
