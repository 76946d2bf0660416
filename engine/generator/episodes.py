"""Multi-turn episodes on a generator (issue #33): each sample of a WorkItem with max_turns > 1 is an episode
between the policy and an Environment (environment.py), decoded in one backend row whose cache is kept across
turns (torch_backend/backend.py: Request.episode, resume, finish).

    admit(item)        one task per sample: env.reset -> op "add" (Request(episode=True), max_new_tokens = the
                       episode's token budget, observation_ids = the first observation's tokens, fed after the
                       prompt as the completion's first, masked, tokens: the prompt stays the one handed out)
    on_finished(fin)   "turn" (the row is parked: a stop token, a token completing one of env.stop_strings, or the
                       per-turn cap ended the turn): a task: env.step(assistant text) -> op "resume" with the
                       observation's tokens, or op "finish" (done, env.max_turns, budget, EnvironmentError)
                       an episode's last Finished: its env_reward set; env.close as a task; returned to send
    apply(backend)     the owner's loop, between backend steps: runs the ops queued by the tasks; returns
                       the samples that ended there (finish, a failed reset, a refused prompt)

Environment calls run as asyncio tasks, each with an env.timeout_s deadline, while the backend decodes
other rows in its worker thread; they never touch the backend themselves (one owner: the service's main
loop calls apply), and notify() wakes that loop when they queued something. EnvironmentError (or a deadline,
"env_timeout", or any other exception, "env_error") ends that sample with its reason as finish reason.
Observation tokens (ChatRenderer) are what the chat template adds for the observation's turn after what the
row holds: fed tokens equal tokenizer.apply_chat_template(whole conversation, add_generation_prompt=True).
Test: pytest tests/engine/generator/test_episodes.py
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from tailrace.engine.generator.environment import Environment, EnvironmentError, EpisodeKey, Observation
from tailrace.engine.generator.requests import Finished, Request
from tailrace.engine.generator.stop_strings import StopStrings

log = logging.getLogger("tailrace.generator.episodes")

PROXY_PROMPT = [{"role": "user", "content": "?"}]
"""The conversation turn observation tokens are rendered after: a work item carries the prompt's token ids,
not its turns, and a chat template renders a turn the same whatever turns precede it (checked: see
ChatRenderer), so the suffix rendered after this one is the suffix after the real prompt."""


BACKSTOP_S = 10.0
"""With the run's config, the loop's own deadline per call lies this far past the environment's budget: the
protocol client (env_client.py) answers env_timeout / no_env_server itself by then; this one only guarantees
that no episode waits forever on an environment that never answers (longer than the client's grace)."""


@dataclass(frozen=True)
class EpisodeSettings:
    max_turns: int  # assistant turns per episode
    max_episode_tokens: int  # completion tokens per episode, observations included; 0 = sampling.max_new_tokens
    timeout_s: float  # per environment call: past it, the call fails with env_timeout
    wait_for_server_s: float = 0.0  # a reset may also wait this long for a server to attach
    backstop_s: float = 0.0  # added to every deadline (BACKSTOP_S with the run's config)
    stop_strings: tuple[str, ...] = ()  # end an assistant turn at the token that completes one (stop_strings.py)

    @classmethod
    def from_config(cls, env: Any) -> EpisodeSettings:
        """From the run's EnvConfig (engine/config.py env.*)."""
        return cls(env.max_turns, env.max_episode_tokens, env.timeout_s, env.wait_for_server_s, BACKSTOP_S,
                   tuple(env.stop_strings))


class ChatRenderer:
    """Observation tokens through a tokenizer's chat template. Each is the text the template renders for the
    conversation with the observation (and the generation prompt) minus the text the row already holds,
    tokenized; ValueError where the template does not render that conversation as a continuation of it (a
    template that rewrites earlier turns, e.g. drops reasoning from past assistant turns). A tokenizer without a
    chat template (plain-text prompts, as the shipped tiny model's) gets observation text appended as it is."""

    def __init__(self, tokenizer: Any, observation_role: str = "user"):
        self.templated = bool(getattr(tokenizer, "chat_template", None))
        self.tokenizer = tokenizer
        self.role = observation_role
        self._special = set(tokenizer.all_special_ids)

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def _message(self, obs: Observation) -> dict:
        return {"role": obs.info.get("role", self.role) if isinstance(obs.info, dict) else self.role,
                "content": obs.text}

    def _suffix(self, full: str, head: str, what: str) -> list[int]:
        if not full.startswith(head):
            raise ValueError(f"the chat template does not render {what} as a continuation of the tokens before it; "
                             "multi-turn episodes need a template that renders each turn after the earlier ones")
        return self.encode(full[len(head):])

    def first_observation_ids(self, obs: Observation) -> list[int]:
        """The tokens to feed after the prompt for a first observation (reset's). The prompt is the one handed
        out, generation prompt included, so the observation follows an empty assistant turn: the tokens are
        what the template renders for [prompt, assistant "", observation] past the prompt."""
        if obs.token_ids:
            return list(obs.token_ids)
        if not obs.text:
            return []
        if not self.templated:
            return self.encode(obs.text)
        conversation = PROXY_PROMPT + [{"role": "assistant", "content": ""}, self._message(obs)]
        return self._suffix(self.render(conversation, True), self.render(PROXY_PROMPT, True), "the first observation")

    def observation_ids(self, turn_ids: list[int], obs: Observation) -> list[int]:
        """The tokens to feed after an assistant turn (its sampled ids, the one that ended it included)."""
        if obs.token_ids:
            return list(obs.token_ids)
        if not self.templated:
            return self.encode(obs.text)
        # The token that ended the turn is the template's own end of turn when it is a special token the
        # template renders after the content (then it is not content); else it is part of the content.
        head = self.render(PROXY_PROMPT, True) + self.decode(turn_ids)
        variants = [turn_ids[:-1]] if turn_ids and turn_ids[-1] in self._special else []
        for content_ids in [*variants, turn_ids]:
            conversation = PROXY_PROMPT + [{"role": "assistant", "content": self.decode(content_ids)},
                                           self._message(obs)]
            full = self.render(conversation, True)
            if full.startswith(head):
                break
        return self._suffix(full, head, "an observation")


@dataclass
class _Episode:
    key: EpisodeKey
    item: Any  # the WorkItem
    limit: int = 0  # completion tokens the row may hold (the episode budget within max_model_len)
    num_fed: int = 0  # completion tokens the backend holds for the row, before its current turn
    reward: float | None = None
    added: bool = False  # the backend holds the row
    task: asyncio.Task | None = None  # the environment call in flight

    def add_reward(self, reward: float | None) -> None:
        if reward is not None:
            self.reward = (self.reward or 0.0) + float(reward)


class Episodes:
    """The episodes of one generator (see the module docstring). One owner: the event loop thread."""

    def __init__(self, env: Environment, tokenizer: Any, settings: EpisodeSettings, *,
                 notify: Callable[[], None] = lambda: None):
        self.env = env
        self.chat = ChatRenderer(tokenizer)
        self.settings = settings
        # Matched against a turn's text as env.step receives it (special tokens skipped), decoded incrementally.
        decode = functools.partial(self.chat.decode, skip_special_tokens=True)
        self.stop_strings = (StopStrings(settings.stop_strings, decode, name="env.stop_strings")
                             if settings.stop_strings else None)
        self.notify = notify
        self.live: dict[tuple[int, int], _Episode] = {}
        self.ops: collections.deque[tuple] = collections.deque()
        self.tasks: set[asyncio.Task] = set()
        self.env_wait_s = 0.0  # summed over calls (they overlap: compare with wall time per call count)
        self.num_env_calls = 0
        self.ended_by: collections.Counter[str] = collections.Counter()

    @property
    def num_starting(self) -> int:
        """Episodes not in the backend yet (resetting): the owner keeps backend capacity for them."""
        return sum(1 for ep in self.live.values() if not ep.added)

    @property
    def num_waiting_env(self) -> int:
        return sum(1 for ep in self.live.values() if ep.task is not None and not ep.task.done())

    def admit(self, item: Any) -> None:
        for i in range(item.num_samples):
            key = EpisodeKey(item.group_id, item.first_sample_id + i)
            ep = self.live[key.group_id, key.sample_id] = _Episode(key, item)
            self._spawn(ep, self._start(ep))

    def on_finished(self, done: Finished) -> Finished | None:
        """A Finished from backend.step(): None for a turn (the episode goes on), else the sample to send."""
        ep = self.live.get((done.group_id, done.sample_id))
        if ep is None:
            return done  # a single-turn sample
        if done.finish_reason == "turn":
            self._spawn(ep, self._step(ep, done))
            return None
        return self._end(ep, done)

    def apply(self, backend: Any) -> list[Finished]:
        """Run the queued backend operations (between steps); returns the samples that ended here."""
        out = []
        while self.ops:
            kind, key, arg = self.ops.popleft()
            ep = self.live.get(key)
            if ep is None:  # cancelled meanwhile
                continue
            try:
                if kind == "add":
                    ep.limit = min(arg.sampling.max_new_tokens, backend.max_model_len - len(arg.prompt_ids))
                    backend.add(arg)
                    ep.added = True
                elif kind == "resume":
                    backend.resume(key, arg)
                else:
                    out.append(self._end(ep, backend.finish(key, arg) if ep.added else self._empty(ep, arg)))
            except ValueError as exc:
                log.error("episode %s: %s", key, exc)
                out.append(self._end(ep, backend.finish(key, "error") if kind == "resume" else self._empty(ep, "error")))
        return out

    def cancel(self, group_ids: Any) -> None:
        """Forget the episodes of these groups (the owner cancels their backend rows): calls in flight are
        cancelled and their environments closed."""
        groups = set(group_ids)
        for key in [k for k in self.live if k[0] in groups]:
            ep = self.live.pop(key)
            if ep.task is not None:
                ep.task.cancel()
            self._close(ep)

    async def aclose(self) -> None:
        """Cancel what runs and close every live episode's environment (bounded by env.timeout_s)."""
        self.cancel({k[0] for k in self.live})
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=self.settings.timeout_s + self.settings.backstop_s)

    # ------------------------------------------------------------------ environment calls (tasks)

    def _spawn(self, ep: _Episode, coro) -> None:
        ep.task = self._track(asyncio.get_running_loop().create_task(self._guarded(ep, coro)))

    async def _guarded(self, ep: _Episode, coro) -> None:
        """A bug in a reset / step task ends its sample with "error" instead of leaving it parked forever."""
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("episode %s: its task failed", ep.key)
            self._queue("finish", ep, "error")

    def _track(self, task: asyncio.Task) -> asyncio.Task:
        self.tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a bug here: surface it, never a hang
            log.error("episode task failed", exc_info=task.exception())

    async def _call(self, coro, reset: bool = False) -> Observation:
        """One environment call under its deadline; every failure becomes an EnvironmentError."""
        loop = asyncio.get_running_loop()
        start_s = loop.time()
        s = self.settings
        deadline_s = s.timeout_s + s.backstop_s + (s.wait_for_server_s if reset else 0.0)
        try:
            obs = await asyncio.wait_for(coro, deadline_s)
        except EnvironmentError:
            raise
        except TimeoutError as exc:
            raise EnvironmentError("env_timeout", f"no answer within {deadline_s:g} s (env.timeout_s = "
                                   f"{s.timeout_s:g})") from exc
        except Exception as exc:  # a broken environment ends its sample, never the generator
            raise EnvironmentError("env_error", repr(exc)) from exc
        finally:
            self.env_wait_s += loop.time() - start_s
            self.num_env_calls += 1
        if not isinstance(obs, Observation):
            raise EnvironmentError("env_error", f"expected an Observation, got {type(obs).__name__}")
        return obs

    def _queue(self, kind: str, ep: _Episode, arg: Any) -> None:
        self.ops.append((kind, (ep.key.group_id, ep.key.sample_id), arg))
        self.notify()

    async def _start(self, ep: _Episode) -> None:
        item = ep.item
        prompt = list(item.prompt_token_ids)
        try:
            # metadata: WorkItem carries none yet (the dataset row's extra fields would go here).
            text = self.chat.decode(prompt, skip_special_tokens=True)
            obs = await self._call(self.env.reset(ep.key, item.task, text, {}), reset=True)
            ep.add_reward(obs.reward)
            if obs.done:
                raise EnvironmentError("env_error", "the episode was done at reset, before any assistant turn")
            first_ids = self.chat.first_observation_ids(obs)
        except EnvironmentError as exc:
            log.warning("episode %s: reset failed: %s", ep.key, exc)
            return self._queue("finish", ep, exc.reason)
        except ValueError as exc:
            log.error("episode %s: %s", ep.key, exc)
            return self._queue("finish", ep, "error")
        # With env.max_episode_tokens the episode has that budget and max_new_tokens caps each assistant turn;
        # without, max_new_tokens is the episode's budget.
        budget = self.settings.max_episode_tokens or item.sampling.max_new_tokens
        per_turn = item.sampling.max_new_tokens if self.settings.max_episode_tokens else 0
        sampling = msgspec.structs.replace(item.sampling, max_new_tokens=budget)
        ep.num_fed = len(first_ids)
        self._queue("add", ep, Request(ep.key.group_id, ep.key.sample_id, prompt, sampling, episode=True,
                                       observation_ids=tuple(first_ids), max_turn_tokens=per_turn,
                                       stop_strings=self.stop_strings))

    async def _step(self, ep: _Episode, turn: Finished) -> None:
        completion = turn.completion_ids.tolist()
        turn_ids = completion[ep.num_fed:]
        try:
            obs = await self._call(self.env.step(ep.key, self.chat.decode(turn_ids, skip_special_tokens=True)))
        except EnvironmentError as exc:
            log.warning("episode %s: step failed: %s", ep.key, exc)
            return self._queue("finish", ep, exc.reason)
        ep.add_reward(obs.reward)
        if obs.done:
            return self._queue("finish", ep, "stop")
        if turn.num_turns >= self.settings.max_turns:
            return self._queue("finish", ep, "length")
        try:
            ids = self.chat.observation_ids(turn_ids, obs)
        except ValueError as exc:
            log.error("episode %s: %s", ep.key, exc)
            return self._queue("finish", ep, "error")
        if not ids or len(completion) + len(ids) >= ep.limit:  # no room left to decode after it
            return self._queue("finish", ep, "length" if ids else "error")
        ep.num_fed = len(completion) + len(ids)
        self._queue("resume", ep, ids)

    # ------------------------------------------------------------------ the end of an episode

    def _empty(self, ep: _Episode, reason: str) -> Finished:
        """The Finished of an episode that ended before the backend held it."""
        item = ep.item
        return Finished(ep.key.group_id, ep.key.sample_id, list(item.prompt_token_ids),
                        torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.float32),
                        torch.zeros(0, dtype=torch.long), reason, queue_s=0.0, decode_s=0.0,
                        loss_mask=torch.zeros(0, dtype=torch.bool), num_turns=0)

    def _end(self, ep: _Episode, done: Finished) -> Finished:
        self.live.pop((ep.key.group_id, ep.key.sample_id), None)
        self.ended_by[done.finish_reason] += 1
        done.env_reward = ep.reward
        if done.loss_mask is None:
            done.loss_mask = torch.ones(len(done.completion_ids), dtype=torch.bool)
        self._close(ep)
        return done

    def _close(self, ep: _Episode) -> None:
        async def close() -> None:
            try:
                await asyncio.wait_for(self.env.close(ep.key), self.settings.timeout_s + self.settings.backstop_s)
            except Exception as exc:  # the sample is settled; a close that fails only gets logged
                log.warning("episode %s: close failed: %r", ep.key, exc)

        self._track(asyncio.get_running_loop().create_task(close()))
