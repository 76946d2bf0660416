"""What goes into a backend and what comes out: requests (one sample each), weights, finished samples,
and the backend's counters. Kept apart from torch_backend/backend.py so that code handling samples (the
generator service, the modelled backend of tools/benches/modelled.py) needs no decoding machinery.
Test: pytest tests/engine/generator/torch_backend/test_backend.py
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from tailrace.engine.generator.stop_strings import StopStrings
from tailrace.protocol.messages import SamplingParams, WorkItem

Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
"""New policy weights for Backend.update_weights: a state dict by Hugging Face name, or (name, tensor)
pairs; backends on fused layouts (vLLM, SGLang) need the full set."""


def weight_items(weights: Weights) -> list[tuple[str, torch.Tensor]]:
    return list(weights.items()) if isinstance(weights, Mapping) else list(weights)


@dataclass(frozen=True)
class Request:
    """One sample to generate. Samples of a group share group_id and prompt, differ in sample_id."""

    group_id: int
    sample_id: int
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # A multi-turn episode (engine/generator/episodes.py): a stop token ends the assistant turn and parks the
    # row with its cache (Finished "turn"); resume() feeds the observation and decoding goes on. max_new_tokens
    # is then the episode's budget, observation tokens included. Torch backend only.
    episode: bool = False
    # Fed after the prompt before the first token is sampled, as completion tokens without loss (an episode's
    # first observation): the prompt stays the one handed out, which the trainer checks.
    observation_ids: tuple[int, ...] = ()
    # An episode's cap per assistant turn (0 = none): a turn that reaches it ends as at a stop token.
    max_turn_tokens: int = 0
    # Strings that end an assistant turn (an episode's; a single-turn sample's completion) as a stop token does:
    # at the token whose text completes one, that token kept (stop_strings.py). Torch backend only.
    stop_strings: StopStrings | None = None

    @property
    def fed_prompt(self) -> list[int]:
        """What is prefilled before the first sampled token: the prompt, then observation_ids."""
        return list(self.prompt_ids) + list(self.observation_ids)


def requests_for(item: WorkItem) -> list[Request]:
    """The requests of one WorkItem: num_samples samples with consecutive sample ids."""
    prompt = list(item.prompt_token_ids)
    first = item.first_sample_id
    return [Request(item.group_id, first + i, prompt, item.sampling) for i in range(item.num_samples)]


@dataclass
class Finished:
    """A sample that left the backend. Tensors are 1-D, on the CPU, one entry per completion token.

    finish_reason: "stop" (a stop token or eos was sampled, or a token that completes one of
    Request.stop_strings; it is the last completion token),
    "length" (max_new_tokens or max_model_len reached) or "cancelled"; for an episode row also "turn" (an
    assistant turn ended: the row is parked with its cache until Backend.resume / finish; the episode loop
    consumes it, it never leaves the generator) and an environment's discard reason (EnvironmentError.reason). queue_s: seconds from add()
    to the first sampled token; decode_s: from the first token to the finish (time.monotonic)."""

    group_id: int
    sample_id: int
    prompt_ids: list[int]
    completion_ids: torch.Tensor      # int64 [T]
    behaviour_logprobs: torch.Tensor  # float32 [T], see sampling.py for the convention
    policy_versions: torch.Tensor     # int64 [T], the policy version that sampled each token
    finish_reason: str
    queue_s: float
    decode_s: float
    # Episodes (Request.episode): loss_mask bool [T], False for observation tokens (which carry log-prob 0.0 and
    # the version loaded when they were fed); None for a single-turn sample (every token is the policy's).
    # env_reward: the environment's rewards summed (None: it gave none); num_turns: assistant turns.
    loss_mask: torch.Tensor | None = None
    env_reward: float | None = None
    num_turns: int = 1


@dataclass
class BackendStats:
    """Counters since construction; times are time.monotonic() seconds spent inside the backend."""

    num_steps: int = 0
    num_prefill_tokens: int = 0
    num_generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of backend time (prefill included)."""
        busy_s = self.prefill_s + self.decode_s
        return self.num_generated_tokens / busy_s if busy_s > 0 else 0.0


def check_request(request: Request, *, max_model_len: int, vocab_size: int) -> None:
    """ValueError for a prompt that is empty, leaves no room for a completion token, or holds an id outside
    the vocabulary: every backend takes exactly the same requests."""
    prompt = request.fed_prompt
    if len(request.observation_ids) >= request.sampling.max_new_tokens:
        raise ValueError(f"group {request.group_id} sample {request.sample_id}: {len(request.observation_ids)} "
                         f"observation tokens leave no room in max_new_tokens = {request.sampling.max_new_tokens}")
    if len(prompt) == 0:
        raise ValueError(f"group {request.group_id} sample {request.sample_id}: empty prompt")
    if len(prompt) >= max_model_len:
        raise ValueError(f"group {request.group_id} sample {request.sample_id}: prompt has {len(prompt)} "
                         f"tokens, but max_model_len is {max_model_len} (prompt plus at least one "
                         "completion token must fit)")
    low, high = min(prompt), max(prompt)
    if low < 0 or high >= vocab_size:
        raise ValueError(f"group {request.group_id}: prompt token ids must lie in [0, {vocab_size}), "
                         f"got {low if low < 0 else high}")


def drain_by_stepping(backend: Any) -> list[Finished]:
    """A backend's drain(): step() with admission paused until nothing runs (waiting requests stay queued)."""
    paused, backend.pause_admission = backend.pause_admission, True
    try:
        out: list[Finished] = []
        while backend.num_running:
            out += backend.step()
        return out
    finally:
        backend.pause_admission = paused
