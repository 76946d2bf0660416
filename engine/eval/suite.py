"""What an evaluation is, shared by the trainer's in-run evaluation (engine/trainer/in_run_eval.py) and
`tailrace eval --checkpoint DIR` (engine/eval/main.py): its prompts, its work, the pass@k estimator and
the figures it reports (docs/algorithms.md, "Evaluation").

    eval_prompts(cfg, tokenizer, max_prompt_tokens)  eval.num_prompts prompts of eval.source
    eval_requests(cfg, prompts, eos)                 per prompt: one greedy sample, eval.n sampled ones
    pass_at_k(n, c, k)                               1 - C(n-c, k) / C(n, k), Chen et al. 2021, exact
    EvalResults.metrics() / .line(step)              the eval/... keys of metrics.jsonl; the terminal line
Test: pytest tests/engine/eval/test_eval.py
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from tailrace.engine.config import RunConfig
from tailrace.engine.core.samples import PromptRecord
from tailrace.engine.data.prompt_sources import PromptSource
from tailrace.protocol.messages import SamplingParams

GREEDY, SAMPLED = "greedy", "sampled"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n, c of them correct, is
    correct: the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021), in exact arithmetic."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def eval_prompts(cfg: RunConfig, tokenizer: Any, max_prompt_tokens: int) -> list[PromptRecord]:
    """The evaluation's prompts. eval.source "synthetic": the first eval.num_prompts distinct prompts of
    data.task's held-out stream (engine/data/tasks.py, split "eval"; the trainer keeps their texts out of
    training); a file or hf: source: its first eval.num_prompts rows (0 = all), read as data.source is."""
    e = cfg.eval
    if e.source == "synthetic":
        from tailrace.engine.data.tasks import TASK_NAMES

        if cfg.data.task not in TASK_NAMES:
            raise ValueError(f"eval.source: synthetic is a split of the built-in tasks ({', '.join(TASK_NAMES)}); "
                             f"data.task is {cfg.data.task!r}: give eval.source a file")
        data = dataclasses.replace(cfg.data, source="synthetic")
        source = PromptSource(data, tokenizer, max_prompt_tokens=max_prompt_tokens, split="eval")
    else:
        data = dataclasses.replace(cfg.data, source=e.source, epochs=1, shuffle=False)
        try:
            source = PromptSource(data, tokenizer, max_prompt_tokens=max_prompt_tokens)
        except ValueError as exc:
            raise ValueError(str(exc).replace("data.source", "eval.source", 1)) from None
    prompts: list[PromptRecord] = []
    texts: set[str] = set()
    for prompt in source:
        if e.source == "synthetic" and prompt.text in texts:
            continue  # short strings repeat in a random stream: each held-out prompt once
        texts.add(prompt.text)
        prompts.append(dataclasses.replace(prompt, prompt_id=len(prompts)))
        if len(prompts) == e.num_prompts:
            break
    if not prompts:
        raise ValueError(f"eval.source: {e.source!r} gives no prompt that fits the model's context")
    return prompts


def sampling_params(cfg: RunConfig, kind: str, prompt_id: int, stop_token_ids: list[int]) -> SamplingParams:
    """Greedy: temperature 0. Sampled: eval.temperature with sampling's top_p / top_k, seeded per prompt
    (from data.seed) so that the same model gives the same samples wherever it is evaluated."""
    s = cfg.sampling
    if kind == GREEDY:
        return SamplingParams(temperature=0.0, max_new_tokens=s.max_new_tokens, stop_token_ids=stop_token_ids)
    return SamplingParams(temperature=cfg.eval.temperature, top_p=s.top_p, top_k=s.top_k,
                          max_new_tokens=s.max_new_tokens, stop_token_ids=stop_token_ids,
                          seed=(cfg.data.seed << 24) + prompt_id)


def eval_requests(cfg: RunConfig, prompts: list[PromptRecord],
                  stop_token_ids: list[int]) -> list[tuple[PromptRecord, str, int, SamplingParams]]:
    """(prompt, kind, number of samples, sampling) of every group of one evaluation, in order."""
    out = []
    for prompt in prompts:
        out.append((prompt, GREEDY, 1, sampling_params(cfg, GREEDY, prompt.prompt_id, stop_token_ids)))
        out.append((prompt, SAMPLED, cfg.eval.n, sampling_params(cfg, SAMPLED, prompt.prompt_id, stop_token_ids)))
    return out


@dataclass
class PromptOutcome:
    """The rewards of one prompt's samples; failed: samples that came back without a reward."""

    greedy: list[float] = field(default_factory=list)
    sampled: list[float] = field(default_factory=list)
    failed: int = 0


@dataclass
class EvalResults:
    """One evaluation's rewards per prompt, and what it reports."""

    cfg: RunConfig
    outcomes: list[PromptOutcome]
    seconds: float = 0.0
    policy_version: int = 0

    def add(self, prompt_id: int, kind: str, reward: float | None) -> None:
        outcome = self.outcomes[prompt_id]
        if reward is None:
            outcome.failed += 1
        else:
            (outcome.greedy if kind == GREEDY else outcome.sampled).append(reward)

    def metrics(self) -> dict[str, float]:
        e = self.cfg.eval
        greedy = [o.greedy[0] for o in self.outcomes if o.greedy]
        sampled = [r for o in self.outcomes for r in o.sampled]
        out = {"eval/num_prompts": float(len(self.outcomes)),
               "eval/greedy/accuracy": _mean([float(r >= e.correct_reward) for r in greedy]),
               "eval/greedy/reward_mean": _mean(greedy),
               "eval/sampled/reward_mean": _mean(sampled),
               "eval/samples_failed": float(sum(o.failed for o in self.outcomes)),
               "eval/seconds": self.seconds, "eval/policy_version": float(self.policy_version)}
        for k in e.pass_k:  # prompts with fewer than k rewarded samples (failures) do not count for k
            values = [pass_at_k(len(o.sampled), sum(r >= e.correct_reward for r in o.sampled), k)
                      for o in self.outcomes if len(o.sampled) >= k]
            out[f"eval/pass@{k}"] = _mean(values)
        return out

    def line(self, step: int) -> str:
        figures = self.metrics()
        passes = " ".join(f"pass@{k} {figures[f'eval/pass@{k}']:.3f}" for k in self.cfg.eval.pass_k)
        return (f"eval at step {step} (policy v{self.policy_version}): greedy accuracy "
                f"{figures['eval/greedy/accuracy']:.3f} reward {figures['eval/greedy/reward_mean']:.3f} | {passes} "
                f"| {len(self.outcomes)} prompts x {self.cfg.eval.n} samples at T={self.cfg.eval.temperature:g}, "
                f"{int(figures['eval/samples_failed'])} failed, {self.seconds:.1f} s")


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")
