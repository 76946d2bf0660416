"""`tailrace eval --checkpoint DIR`: evaluate a saved model the way a run's evaluation does (docs/algorithms.md).

Loads a checkpoint folder (runs/<name>/checkpoint/latest or step_NNNNNN: what transformers' from_pretrained
loads) on the backend generator.backend names, samples the eval prompts (engine/eval/suite.py: one greedy sample
and eval.n seeded samples at eval.temperature per prompt), scores them through the trainer's reward
dispatcher with the built-in task functions or --fn module:function (the function `tailrace reward --fn`
would serve), and prints one line, then, with --json, one JSON object as the last line.
Settings: the run's config.toml next to the checkpoint folder, then --config FILE, then --section.name
overrides; model.path is the checkpoint. Before any model loads (check_setup), eval.source's rows are read
and a setup that cannot score them (a task with no built-in reward and no --fn) is refused.
An entry point like cli.py and launch.py (tests/test_layering.py): it drives the generator's backend and
the trainer's reward dispatcher in one process.
Test: pytest tests/engine/eval/test_eval.py
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import math
import time
from pathlib import Path
from typing import Any

from tailrace.engine.config import RunConfig, config_data, from_dict, merge_data
from tailrace.engine.data import checks
from tailrace.engine.eval.suite import EvalResults, PromptOutcome, eval_prompts, eval_requests


def resolve_config(checkpoint: Path, config_file: str | None, overrides: list[str]) -> RunConfig:
    """The run's own settings (runs/<name>/config.toml, two folders up from checkpoint/step_N), under the
    user's --config and overrides, with model.path the checkpoint."""
    if not (checkpoint / "config.json").is_file():
        raise ValueError(f"--checkpoint: {checkpoint} has no config.json (expected a checkpoint folder such as "
                         "runs/<name>/checkpoint/latest or .../step_000100)")
    run_config = checkpoint.resolve().parent.parent / "config.toml"
    data = merge_data(config_data(run_config) if run_config.is_file() else {}, config_data(config_file, overrides))
    data = merge_data(data, {"model": {"path": str(checkpoint)}, "eval": {"every_steps": 0}})
    return from_dict(RunConfig, data)


def check_setup(cfg: RunConfig, fn: str) -> Any:
    """Before any model loads: eval.source's rows can be read, and each of their tasks has a scorer (--fn,
    else a built-in task function); returns --fn's function, imported (None: the built-in ones)."""
    from tailrace.engine.data.tasks import REWARD_FNS

    data = dataclasses.replace(cfg.data, source=cfg.eval.source)
    tasks = checks.prompt_tasks(data, "eval.source", num_rows=cfg.eval.num_prompts or math.inf)
    if fn:
        from tailrace.engine.reward_server import load_function

        return load_function(fn)
    unknown = sorted(tasks - set(REWARD_FNS))
    if unknown:
        raise ValueError(f"--fn: eval.source {cfg.eval.source} has prompts of task {', '.join(map(repr, unknown))}, "
                         f"which no built-in reward function scores ({', '.join(REWARD_FNS)}): give --fn "
                         "module:function that scores them")
    return None


def _reward_fns(fn: Any, tasks: set[str]) -> dict[str, Any] | None:
    """--fn's function as the dispatcher's function for every task of the prompts; None: the built-in ones."""
    if fn is None:
        return None
    if inspect.iscoroutinefunction(fn):
        pool = concurrent.futures.ThreadPoolExecutor(1)  # its own event loop, off the caller's

        def call(*args: Any) -> Any:
            return pool.submit(asyncio.run, fn(*args)).result()

        return dict.fromkeys(tasks, call)
    return dict.fromkeys(tasks, fn)


def generate(backend: Any, requests: list[tuple[Any, str, int, Any]]) -> list[list[Any]]:
    """Every sample of every request group, in request order (the backend batches them as it likes)."""
    from tailrace.engine.generator.requests import Request

    done: dict[tuple[int, int], Any] = {}
    for group_id, (prompt, _, num, sampling) in enumerate(requests):
        for sample_id in range(num):
            backend.add(Request(group_id, sample_id, list(prompt.token_ids), sampling))
    total = sum(num for _, _, num, _ in requests)
    while len(done) < total:
        for finished in backend.step():
            done[(finished.group_id, finished.sample_id)] = finished
    return [[done[(g, s)] for s in range(num)] for g, (_, _, num, _) in enumerate(requests)]


async def score_all(cfg: RunConfig, tokenizer: Any, requests: list, samples: list[list[Any]],
                    builtin: dict[str, Any] | None) -> EvalResults:
    from tailrace.engine.trainer.scoring import RewardDispatcher, ScoringFailed

    rewards = RewardDispatcher(dataclasses.replace(cfg.reward, mode="builtin"), None, builtin)
    prompts = {prompt.prompt_id for prompt, *_ in requests}
    results = EvalResults(cfg, [PromptOutcome() for _ in prompts])
    for (prompt, kind, _, _), group in zip(requests, samples, strict=True):
        for finished in group:
            completion = tokenizer.decode(finished.completion_ids.tolist(), skip_special_tokens=True)
            reward = None
            if finished.finish_reason != "error":
                try:
                    reward, _ = await rewards.score_with_details(prompt.task, prompt.text, completion,
                                                                 prompt.metadata)
                except ScoringFailed:
                    pass  # counted as failed, as in a run
            results.add(prompt.prompt_id, kind, reward)
    return results


def evaluate(checkpoint: Path, cfg: RunConfig, *, fn: str = "") -> tuple[EvalResults, int]:
    """(results, the checkpoint's step) of one evaluation of `checkpoint` under `cfg`."""
    from tailrace.engine.core import models
    from tailrace.engine.generator.interface import load_backend

    scorer = check_setup(cfg, fn)
    tokenizer = models.load_tokenizer(str(checkpoint))
    backend = load_backend(cfg)
    try:
        max_prompt = cfg.data.max_prompt_tokens or backend.max_model_len - cfg.sampling.max_new_tokens
        prompts = eval_prompts(cfg, tokenizer, max_prompt)
        stop = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        requests = eval_requests(cfg, prompts, stop)
        started = time.monotonic()
        samples = generate(backend, requests)
    finally:
        backend.close()
    results = asyncio.run(score_all(cfg, tokenizer, requests, samples,
                                    _reward_fns(scorer, {p.task for p in prompts})))
    results.seconds = time.monotonic() - started
    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    results.policy_version = int(state.get("policy_version", state.get("step", 0)))
    return results, int(state.get("step", 0))


def main(args: Any, overrides: list[str]) -> int:
    checkpoint = Path(args.checkpoint)
    cfg = resolve_config(checkpoint, args.config, overrides)
    results, step = evaluate(checkpoint, cfg, fn=args.fn)
    print(results.line(step), flush=True)
    if args.json:
        figures = {k: (v if math.isfinite(v) else None) for k, v in results.metrics().items()}
        print(json.dumps({"checkpoint": str(checkpoint), "step": step, "source": cfg.eval.source,
                          "n": cfg.eval.n, "temperature": cfg.eval.temperature} | figures), flush=True)
    return 0
