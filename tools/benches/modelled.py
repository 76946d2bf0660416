"""Modelled compute, for benchmarks: the generator and the trainer sleep for measured costs instead of
running the model, so a run times the scheduler alone (queues, staleness gate, weights traffic, wire).

    ModelledBackend  the Backend interface (engine/generator/interface.py); step() sleeps one decode step drawn from the measured
                     step times of the running batch size (plus prefill of the admitted rows' distinct
                     prompts, as TorchBackend prefills a group's shared prompt once) and emits one
                     token per row; with Costs.speculate (a benchmark's spec variant of the costs file)
                     the step's sleep is divided by the speculative speedup measured at the nearest batch
                     size (Costs.spec_speedup: decode throughput of the bandit over every drafter, with a
                     trained drafter, over plain decoding), so the same tokens come that much sooner;
                     each sample's length is drawn from the measured completions of prompts of the
                     nearest length, seeded by (group, sample), so every run of one workload sees the
                     same lengths
    ModelledLearner  a Learner whose accumulate() sleeps a forward/backward call's measured cost over the
                     tokens it runs (Costs.call, interpolated between calls measured at several sizes: a
                     call's fixed part is paid by every call) and whose step sleeps the optimizer's
                     (Costs.optimizer_s) plus one call over the groups not accumulated (without Costs.call:
                     a + b * tokens fitted to measured steps, early calls per token only); advances
                     step_count and policy_version, and leaves the weights alone
    role_main        `tailrace trainer|generator ARGV` with these two injected through the services' seams
                     (GeneratorService make_backend, TrainerService make_learner)

Both sleep through a Sleeper, which takes what a sleep overslept (a loaded machine wakes a sleeper late) off
the next one, so hundreds of short decode steps cost what their measured sum costs.

The costs are measured on the same machine by the benchmark that uses them (tools/benches/pipeline.py),
which forks role_main for its modelled modes. Test: pytest tests/tools/test_modelled.py
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tailrace.engine.cli import parse_args
from tailrace.engine.config import TrainConfig
from tailrace.engine.core.samples import Group, TrainSample, flatten_samples
from tailrace.engine.generator.interface import torch_backend
from tailrace.engine.generator.main import main as generator_main
from tailrace.engine.generator.requests import (
    BackendStats,
    Finished,
    Request,
    Weights,
    check_request,
    drain_by_stepping,
)
from tailrace.engine.generator.torch_backend.backend import TorchBackend
from tailrace.engine.trainer.learner import Learner, plan_micro_batches
from tailrace.engine.trainer.main import main as trainer_main

COSTS_FORMAT = 1


@dataclass(frozen=True)
class LinearCost:
    """seconds = intercept_s + per_token_s * tokens, never negative."""

    intercept_s: float
    per_token_s: float

    def __call__(self, tokens: int) -> float:
        return max(0.0, self.intercept_s + self.per_token_s * tokens)

    @classmethod
    def fit(cls, points: Iterable[tuple[float, float]]) -> LinearCost:
        """Least squares over (tokens, seconds); a single point (or one token count) gives a pure rate."""
        xs, ys = zip(*points, strict=True)
        if len(set(xs)) < 2:
            return cls(0.0, statistics.fmean(ys) / max(statistics.fmean(xs), 1.0))
        slope, intercept = statistics.linear_regression(xs, ys)
        if intercept < 0:  # noise: keep the model through the origin rather than below it
            return cls(0.0, sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs))
        return cls(intercept, max(0.0, slope))


@dataclass(frozen=True)
class MeasuredCost:
    """Seconds at measured token counts, linear between them; below the smallest, its seconds (a call's
    fixed part dominates there); above the largest, on at the mean rate from the smallest to the largest.
    A forward/backward call is not linear in its tokens: a fixed part (28 ms on the 12-layer long-tail
    policy on a CPU) for small calls, attention growing with long samples for large ones, so a line
    fitted across both sizes puts its intercept near zero and undercharges every small call."""

    points: tuple[tuple[float, float], ...]  # (tokens, seconds), tokens strictly ascending

    @classmethod
    def of(cls, points: Iterable[tuple[float, float]]) -> MeasuredCost:
        """From measurements: the median of those at one token count, then seconds made non-decreasing
        in tokens (a later, larger call measured faster is noise)."""
        by_tokens: dict[float, list[float]] = {}
        for tokens, seconds in points:
            by_tokens.setdefault(float(tokens), []).append(float(seconds))
        if not by_tokens:
            raise ValueError("a measured cost needs at least one point")
        out, floor = [], 0.0
        for tokens in sorted(by_tokens):
            floor = max(floor, statistics.median(by_tokens[tokens]))
            out.append((tokens, floor))
        return cls(tuple(out))

    def __call__(self, tokens: int) -> float:
        pts = self.points
        if tokens <= pts[0][0]:
            return pts[0][1]
        i = bisect.bisect_left(pts, tokens, key=lambda p: p[0])
        if i < len(pts):
            (t0, s0), (t1, s1) = pts[i - 1], pts[i]
            return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
        rate = (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]) if len(pts) > 1 else 0.0
        return pts[-1][1] + rate * (tokens - pts[-1][0])


@dataclass(frozen=True)
class Completion:
    """One measured sample: prompt and completion length in tokens, and how it ended."""

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" | "length"


@dataclass
class Costs:
    """Measured costs of one model on one machine (see tools/benches/pipeline.py for how)."""

    decode_step_s: dict[int, list[float]]  # running batch size -> seconds of single decode steps
    prefill: LinearCost  # over padded prompt tokens of the rows admitted in one step
    train: LinearCost  # over train_tokens() of a training batch
    completions: list[Completion]
    seed: int = 0
    info: dict[str, Any] = field(default_factory=dict)  # how and where it was measured
    # running batch size -> decode throughput with speculation over without (measured with a trained
    # drafter, the bandit choosing over every drafter); empty: speculation is not modelled
    spec_speedup: dict[int, float] = field(default_factory=dict)
    speculate: bool = False  # ModelledBackend decodes at the spec_speedup rate (a bench's spec variant file)
    # One forward/backward call (Learner.accumulate) over train_tokens, and the step after every group was
    # accumulated (the optimizer's part). None: an early call is charged per token only (no fixed part).
    call: MeasuredCost | None = None
    optimizer_s: float = 0.0
    _by_prompt: dict[int, list[Completion]] = field(init=False, repr=False)

    def __post_init__(self):
        if not self.decode_step_s or any(not v for v in self.decode_step_s.values()):
            raise ValueError("costs: decode_step_s needs at least one batch size with measurements")
        if not self.completions:
            raise ValueError("costs: completions is empty")
        self._by_prompt = {}
        for c in self.completions:
            if c.completion_tokens < 1 or c.finish_reason not in ("stop", "length"):
                raise ValueError(f"costs: bad completion {c}")
            self._by_prompt.setdefault(c.prompt_tokens, []).append(c)
        if any(not (0.0 < x < math.inf) for x in self.spec_speedup.values()):
            raise ValueError(f"costs: spec_speedup must be positive and finite, got {self.spec_speedup}")
        if self.speculate and not self.spec_speedup:
            raise ValueError("costs: speculate needs spec_speedup (measured with a drafter)")

    def decode_s(self, batch_size: int, rng: random.Random) -> float:
        """One decode step of `batch_size` rows: a measured step of the nearest measured size."""
        return rng.choice(self.decode_step_s[_nearest(sorted(self.decode_step_s), batch_size)])

    def spec_decode_s(self, batch_size: int, rng: random.Random) -> float:
        """One decode step's worth of tokens with speculation: decode_s over the measured speedup at the
        nearest measured batch size."""
        return self.decode_s(batch_size, rng) / self.spec_speedup[_nearest(sorted(self.spec_speedup), batch_size)]

    def completion(self, prompt_tokens: int, rng: random.Random) -> Completion:
        """A measured completion of a prompt of the nearest measured length (ties: the shorter)."""
        return rng.choice(self._by_prompt[_nearest(sorted(self._by_prompt), prompt_tokens)])

    def to_json(self) -> dict[str, Any]:
        return {"format": COSTS_FORMAT, "seed": self.seed, "info": self.info,
                "decode_step_s": {str(k): v for k, v in sorted(self.decode_step_s.items())},
                "prefill": [self.prefill.intercept_s, self.prefill.per_token_s],
                "train": [self.train.intercept_s, self.train.per_token_s],
                "completions": [[c.prompt_tokens, c.completion_tokens, c.finish_reason] for c in self.completions],
                "spec_speedup": {str(k): v for k, v in sorted(self.spec_speedup.items())},
                "speculate": self.speculate,
                **({"call": [list(p) for p in self.call.points], "optimizer_s": self.optimizer_s}
                   if self.call is not None else {})}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))


def _nearest(values: list[int], x: int) -> int:
    """The element of sorted `values` closest to x; ties go to the smaller."""
    i = bisect.bisect_left(values, x)
    return min(values[max(0, i - 1): i + 1], key=lambda v: (abs(v - x), v))


def padded_tokens(row_lengths: list[int], micro_batch_tokens: int) -> int:
    """Tokens the naive trainer runs through the model for rows of these lengths (prompt + completion
    - 1): each row padded to the longest of its micro-batch, planned as engine/trainer/learner.py does.
    Heavy-tailed lengths pad a lot."""
    return sum(len(rows) * row_lengths[rows[0]] for rows in plan_micro_batches(row_lengths, micro_batch_tokens))


def train_tokens(samples: list[TrainSample], micro_batch_tokens: int, replay: str = "naive") -> int:
    """What costs.train is fitted against: padded_tokens under the naive strategy; the logical tokens
    (every row unpadded) under the shared-prefix strategies, a proxy of their work."""
    row_lengths = [s.num_tokens - 1 for s in samples]
    return padded_tokens(row_lengths, micro_batch_tokens) if replay == "naive" else sum(row_lengths)


def load_costs(path: str | Path) -> Costs:
    """Read a costs file written by Costs.save. Raises ValueError naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"costs file: cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != COSTS_FORMAT:
        raise ValueError(f"costs file: {path} is not a costs file of format {COSTS_FORMAT}")
    try:
        return Costs(decode_step_s={int(k): [float(s) for s in v] for k, v in data["decode_step_s"].items()},
                     prefill=LinearCost(*map(float, data["prefill"])), train=LinearCost(*map(float, data["train"])),
                     completions=[Completion(int(p), int(n), str(r)) for p, n, r in data["completions"]],
                     seed=int(data.get("seed", 0)), info=dict(data.get("info", {})),
                     spec_speedup={int(k): float(v) for k, v in data.get("spec_speedup", {}).items()},
                     speculate=bool(data.get("speculate", False)),
                     call=MeasuredCost.of(tuple(map(float, p)) for p in data["call"]) if "call" in data else None,
                     optimizer_s=float(data.get("optimizer_s", 0.0)))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"costs file: {path}: {exc}") from None


class Sleeper:
    """Sleeps modelled seconds, less what earlier sleeps overslept (a loaded machine wakes a sleeper late):
    many small sleeps then cost what their sum costs, as the measured compute would."""

    def __init__(self):
        self.overslept_s = 0.0

    def __call__(self, seconds: float) -> None:
        start = time.monotonic()
        time.sleep(max(0.0, seconds - self.overslept_s))
        self.overslept_s = max(0.0, self.overslept_s + (time.monotonic() - start) - seconds)


# ------------------------------------------------------------------------------------------ generator


@dataclass
class _Row:
    request: Request
    length: int  # tokens this sample will have
    reason: str  # its finish reason
    tokens: torch.Tensor  # int64 [length], decided at admission
    added_s: float
    versions: list[int] = field(default_factory=list)
    first_token_s: float = 0.0


def _sample_rng(costs: Costs, group_id: int, sample_id: int) -> random.Random:
    # Seeded by (group, sample) only: the same sample gets the same length in every run and mode.
    return random.Random(f"sample:{costs.seed}:{group_id}:{sample_id}")


def completion_length(costs: Costs, group_id: int, sample_id: int, prompt_tokens: int, limit: int) -> tuple[int, str]:
    """(length, finish_reason) of one modelled sample: a measured completion of a prompt of the nearest
    length, cut to `limit` (max_new_tokens or the context), which makes it a "length" finish."""
    measured = costs.completion(prompt_tokens, _sample_rng(costs, group_id, sample_id))
    if measured.completion_tokens >= limit:
        return limit, "length"
    return measured.completion_tokens, measured.finish_reason


def _not_in(stops: set[int], vocab_size: int) -> int:
    return next((t for t in range(vocab_size) if t not in stops), 0)


class ModelledBackend:
    """The Backend interface without the model: each step sleeps a measured decode cost.

    Not thread-safe, like TorchBackend. `real` provides the limits (batch size, context, eos ids,
    vocabulary); its model is never run and its weights are never touched."""

    name = "modelled"

    def __init__(self, real: TorchBackend, costs: Costs):
        self.costs = costs
        self.max_batch_size = real.max_batch_size
        self.max_model_len = real.max_model_len
        self.eos_token_ids = list(real.eos_token_ids)
        self.vocab_size = real.vocab_size
        self.policy_version = real.policy_version
        self.pause_admission = False
        self.stats = BackendStats()
        self._rng = random.Random(f"decode:{costs.seed}")
        self._sleep = Sleeper()  # a step sleeps its modelled cost, oversleeping carried to the next
        self._waiting: deque[_Row] = deque()
        self._rows: list[_Row] = []

    @property
    def num_running(self) -> int:
        return len(self._rows)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def capacity(self) -> int:
        return max(0, self.max_batch_size - self.num_running - self.num_waiting)

    def add(self, request: Request) -> None:
        """Queue one request; its length is drawn now. Raises ValueError like TorchBackend.add."""
        check_request(request, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        self._waiting.append(self._draw(request))

    def _draw(self, request: Request) -> _Row:
        rng = _sample_rng(self.costs, request.group_id, request.sample_id)
        limit = min(request.sampling.max_new_tokens, self.max_model_len - len(request.prompt_ids))
        length, reason = completion_length(self.costs, request.group_id, request.sample_id,
                                           len(request.prompt_ids), limit)
        stops = set(request.sampling.stop_token_ids) | set(self.eos_token_ids)
        tokens = [rng.randrange(self.vocab_size) for _ in range(length)]
        tokens = [t if t not in stops else _not_in(stops, self.vocab_size) for t in tokens]
        if reason == "stop":
            if stops:
                tokens[-1] = min(stops)
            else:
                reason = "length"  # nothing can stop it: it ran to its length
        return _Row(request, length, reason, torch.tensor(tokens, dtype=torch.long), time.monotonic())

    def cancel(self, group_ids: Iterable[int]) -> list[Finished]:
        groups = set(group_ids)
        out = [self._finished(r, "cancelled") for r in self._waiting if r.request.group_id in groups]
        self._waiting = deque(r for r in self._waiting if r.request.group_id not in groups)
        out += [self._finished(r, "cancelled") for r in self._rows if r.request.group_id in groups]
        self._rows = [r for r in self._rows if r.request.group_id not in groups]
        return out

    def step(self) -> list[Finished]:
        """Admit waiting rows (unless paused), sleep for their prefill and one decode step of the running
        batch, and emit one token per row; returns the samples that finished."""
        start_s = time.monotonic()
        prefill_s = 0.0
        if not self.pause_admission and self._waiting and len(self._rows) < self.max_batch_size:
            new = [self._waiting.popleft() for _ in range(min(len(self._waiting),
                                                              self.max_batch_size - len(self._rows)))]
            # As TorchBackend: a prompt that several admitted rows share (a group's) is prefilled once.
            prompts = {tuple(r.request.prompt_ids) for r in new}
            prefill_s = self.costs.prefill(max(len(p) - 1 for p in prompts) * len(prompts))
            self._rows.extend(new)
        if not self._rows:
            return []
        decode = self.costs.spec_decode_s if self.costs.speculate else self.costs.decode_s
        self._sleep(prefill_s + decode(len(self._rows), self._rng))
        now = time.monotonic()
        done, keep = [], []
        for row in self._rows:
            if not row.versions:
                row.first_token_s = now
            row.versions.append(self.policy_version)
            (done if len(row.versions) == row.length else keep).append(row)
        self._rows = keep
        elapsed = now - start_s
        self.stats.num_steps += 1
        self.stats.num_generated_tokens += len(keep) + len(done)
        self.stats.prefill_s += min(prefill_s, elapsed)
        self.stats.decode_s += elapsed - min(prefill_s, elapsed)
        return [self._finished(r, r.reason) for r in done]

    def drain(self) -> list[Finished]:
        return drain_by_stepping(self)

    def update_weights(self, weights: Weights, version: int) -> None:
        """Only the version changes: the modelled generator has no weights to load."""
        if version < self.policy_version:
            raise ValueError(f"policy version {version} is older than the loaded {self.policy_version}")
        self.policy_version = version

    def close(self) -> None:
        """Nothing to release."""

    def _finished(self, row: _Row, reason: str) -> Finished:
        now = time.monotonic()
        n = len(row.versions)
        first = row.first_token_s or now
        return Finished(row.request.group_id, row.request.sample_id, row.request.prompt_ids,
                        row.tokens[:n].clone(), torch.full((n,), -math.log(self.vocab_size), dtype=torch.float32),
                        torch.tensor(row.versions, dtype=torch.long), reason,
                        queue_s=first - row.added_s, decode_s=now - first)


# ------------------------------------------------------------------------------------------ trainer


class ModelledLearner(Learner):
    """A Learner whose step sleeps the modelled training time of the batch (the optimizer's share and a
    call over the groups accumulate() did not run; without Costs.call, costs.train), advances
    step_count and policy_version, and returns the metrics a real step reports about the batch. The model
    and the optimizer are built as a real learner's (checkpoints save them) but never touched."""

    def __init__(self, model: torch.nn.Module, config: TrainConfig, *, costs: Costs, **kwargs: Any):
        if (config.ppo_epochs, config.minibatches) != (1, 1):
            raise ValueError("train.ppo_epochs, train.minibatches: modelled compute models one update per step")
        super().__init__(model, config, **kwargs)
        self.costs = costs
        self._sleep = Sleeper()

    def accumulate(self, groups: Sequence[Group]) -> bool:
        """Learner.accumulate modelled: one forward/backward call over the groups (Costs.call, or without
        it the per-token share of Costs.train)."""
        padded = train_tokens(flatten_samples(groups), self.config.micro_batch_tokens, self.config.replay)
        self._sleep(self.costs.call(padded) if self.costs.call else self.costs.train.per_token_s * padded)
        self._accumulated.update(g.group_id for g in groups)
        return True

    def step(self, batch: Sequence[Group] | Sequence[TrainSample]) -> dict[str, float]:
        start_s = time.monotonic()
        samples = flatten_samples(batch)
        if not samples:
            raise ValueError("batch: no samples")
        tokens = sum(s.num_tokens for s in samples)
        padded = train_tokens(samples, self.config.micro_batch_tokens, self.config.replay)
        rest = [u for u in batch if getattr(u, "group_id", None) not in self._accumulated]
        self._accumulated = set()
        rest_padded = train_tokens(flatten_samples(rest), self.config.micro_batch_tokens, self.config.replay) \
            if rest else 0
        call = self.costs.call
        if call is None:  # the step's fixed part, and the per-token part of what was not accumulated
            modelled_s = self.costs.train.intercept_s + self.costs.train.per_token_s * rest_padded
        else:  # the optimizer, and one call over the groups not accumulated (all of them, without early calls)
            modelled_s = self.costs.optimizer_s + (call(rest_padded) if rest else 0.0)
        self._sleep(modelled_s)
        staleness = [self.policy_version - s.min_policy_version for s in samples]
        self.step_count += 1
        self.policy_version += 1
        rewards = [s.reward for s in samples]
        return {
            "trainer/tokens/logical": float(tokens),
            "trainer/tokens/loss": float(sum(s.num_loss_tokens for s in samples)),
            "trainer/tokens/padded": float(padded),
            "trainer/samples": float(len(samples)),
            "trainer/reward/mean": statistics.fmean(rewards),
            "trainer/staleness/max": float(max(staleness)),
            "trainer/staleness/mean": statistics.fmean(staleness),
            "trainer/step": float(self.step_count),
            "trainer/policy_version": float(self.policy_version),
            "trainer/modelled/step_s": modelled_s,
            "trainer/time/step_s": time.monotonic() - start_s,
        }


# ------------------------------------------------------------------------------------------ the roles


def backend_factory(costs: Costs) -> Callable[[Any], ModelledBackend]:
    """GeneratorService's make_backend: a ModelledBackend with the limits of the torch backend the run
    config builds (whose model never runs)."""

    def make(cfg: Any) -> ModelledBackend:
        if cfg.generator.speculation not in ("auto", "off"):  # auto: off on this backend
            raise ValueError("generator.speculation: modelled compute models speculative decoding only as a "
                             "costs file's speedup (Costs.speculate), not through the generator's drafters")
        return ModelledBackend(torch_backend(cfg), costs)

    return make


def role_main(argv: list[str], costs_path: str | Path) -> int:
    """`tailrace trainer ARGV` or `tailrace generator ARGV`, its compute modelled by the costs file."""
    args, overrides = parse_args(argv)
    costs = load_costs(costs_path)
    if args.role == "trainer":
        return trainer_main(args, overrides, make_learner=functools.partial(ModelledLearner, costs=costs))
    if args.role == "generator":
        return generator_main(args, overrides, make_backend=backend_factory(costs))
    raise ValueError(f"modelled compute: no modelled {args.role!r} role (trainer or generator)")
