"""Multi-turn episodes: what a generator needs from an environment (issue #33), shared by the generator's
episode loop (engine/generator/episodes.py), the protocol-backed client that reaches environment servers
through the trainer (engine/generator/env_client.py) and in-process environments used by tests.

    reset(episode, task, prompt, metadata) -> Observation   the first observation (may be empty text)
    step(episode, action)                  -> Observation   after each assistant turn (its decoded text)
    close(episode)                                          the episode is over (done, budget, cancel, error)

An Observation's text is appended to the conversation as the environment's turn (the chat template's
tool / user message, engine/generator/episodes.py); token_ids, when given, are appended verbatim instead.
Observation tokens carry no loss (TrainSample.loss_mask 0) and no behaviour log-probs. reward, when an
environment gives one, adds to the sample's return (final and per-turn rewards sum).
EnvironmentError raised by reset/step ends that sample with its `reason` as the discard reason
("env_dead", "env_timeout", "env_error"); never a hang: every call has a deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class EpisodeKey:
    """One episode: one sample of one group."""

    group_id: int
    sample_id: int


@dataclass
class Observation:
    text: str = ""
    token_ids: list[int] | None = None   # appended verbatim when given (no chat template)
    done: bool = False                   # the episode ends after this observation (not appended when done)
    reward: float | None = None          # optional per-turn or final reward
    info: dict[str, Any] = field(default_factory=dict)


class EnvironmentError(Exception):  # noqa: A001  (the episode's error, not the OS one)
    def __init__(self, reason: str, text: str) -> None:
        super().__init__(f"{reason}: {text}")
        self.reason = reason
        self.text = text


@runtime_checkable
class Environment(Protocol):
    async def reset(self, episode: EpisodeKey, task: str, prompt: str, metadata: dict[str, Any]) -> Observation: ...

    async def step(self, episode: EpisodeKey, action: str) -> Observation: ...

    async def close(self, episode: EpisodeKey) -> None: ...
