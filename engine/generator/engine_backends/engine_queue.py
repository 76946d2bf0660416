"""What the engine backends (vLLM, SGLang) share: the fields every Backend has, samples waiting for room
in the engine, the running ones by engine request id, and the queries, add(), admission, the waiting
half of cancel(), drain() and Finished over them. The subclass submits to its engine and steps it.

    add() -> _waiting --_admit(): while fewer than max_batch_size run--> _submit(live) -> _running[rid]
Test: pytest tests/engine/generator/test_backend_conformance.py (vLLM; SGLang's suite is marked gpu)
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from tailrace.engine.generator.requests import (
    BackendStats,
    Finished,
    Request,
    check_request,
    drain_by_stepping,
)

IN_FLIGHT_KV = ("keep", "recompute")


@dataclass
class LiveSample:
    request: Request
    added_s: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    first_token_s: float = 0.0


class EngineQueue:
    """The Backend fields and queues of an engine backend; subclasses define _submit(live) (hand one
    sample to the engine under a request id in _running) and step()."""

    def __init__(self, *, max_batch_size: int, max_model_len: int, vocab_size: int,
                 eos_token_ids: Iterable[int] = (), in_flight_kv: str = "keep"):
        if in_flight_kv not in IN_FLIGHT_KV:
            raise ValueError(f"in_flight_kv must be keep or recompute, got {in_flight_kv!r}")
        self.max_batch_size = max_batch_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(int(t) for t in eos_token_ids))
        self.in_flight_kv = in_flight_kv
        self.policy_version = 0
        self.pause_admission = False
        self.stats = BackendStats()
        self._waiting: deque[LiveSample] = deque()
        self._running: dict[str, LiveSample] = {}

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def capacity(self) -> int:
        return max(0, self.max_batch_size - self.num_running - self.num_waiting)

    def add(self, request: Request) -> None:
        """Queue one sample; ValueError as TorchBackend.add (empty, too long, outside the vocabulary)."""
        check_request(request, max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        self._waiting.append(LiveSample(request, time.monotonic()))

    def drain(self) -> list[Finished]:
        return drain_by_stepping(self)

    def _submit(self, live: LiveSample) -> None:
        raise NotImplementedError

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_batch_size:
            live = self._waiting.popleft()
            self.stats.num_prefill_tokens += len(live.request.prompt_ids)
            self._submit(live)

    def _cancel_waiting(self, groups: set[int]) -> list[Finished]:
        """The waiting samples of these groups, removed and returned as cancelled."""
        out = [self._finished(live, "cancelled") for live in self._waiting if live.request.group_id in groups]
        self._waiting = deque(live for live in self._waiting if live.request.group_id not in groups)
        return out

    def _limit(self, live: LiveSample) -> int:
        """Tokens the sample may still generate: max_new_tokens and max_model_len, less what it has."""
        req = live.request
        return min(req.sampling.max_new_tokens, self.max_model_len - len(req.prompt_ids)) - len(live.tokens)

    def _finished(self, live: LiveSample, reason: str) -> Finished:
        now = time.monotonic()
        first = live.first_token_s or now
        req = live.request
        return Finished(req.group_id, req.sample_id, req.prompt_ids, torch.tensor(live.tokens, dtype=torch.long),
                        torch.tensor(live.logprobs, dtype=torch.float32),
                        torch.tensor(live.versions, dtype=torch.long), reason,
                        queue_s=first - live.added_s, decode_s=now - first)
