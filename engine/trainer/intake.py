"""What the trainer takes in from generators: the checks a rollout passes before it is scored, and the
scored samples of a complete group as the learner's Group. Pure functions over messages and controller
state. Test: pytest tests/engine/trainer/test_trainer_service.py (rollouts refused with a reason).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tailrace.engine.core.samples import Group
from tailrace.engine.trainer.controller import GroupState
from tailrace.protocol import messages as m


def max_completion_tokens(cfg: Any) -> int:
    """The most completion tokens a rollout may have (cfg: a RunConfig): an episode's budget (assistant and
    observation tokens) with env.max_turns > 1 and env.max_episode_tokens set, else sampling.max_new_tokens."""
    if cfg.env.max_turns > 1 and cfg.env.max_episode_tokens:
        return cfg.env.max_episode_tokens
    return cfg.sampling.max_new_tokens


def rollout_problem(group: GroupState, msg: m.Rollout, vocab_size: int,
                    max_new_tokens: int | None = None) -> tuple[str, str] | None:
    """(discard reason, text) if a rollout for a sample we wait for is not one we can train, else None.
    Lengths are checked first: a completion longer than the work asked for is refused before any
    per-token work (decoding it for the reward server would hold the event loop)."""
    num = msg.completion_token_ids.shape[0]
    if msg.finish_reason == "cancelled":
        return "generator_cancelled", "finish_reason cancelled"
    if msg.finish_reason == "error":
        return "generator_error", "finish_reason error"
    if msg.finish_reason == "env_error":
        return "env_error", "the environment failed the episode (it raised, or answered wrongly)"
    if msg.finish_reason == "env_timeout":
        return "env_timeout", "the environment did not answer within env.timeout_s"
    if msg.finish_reason == "env_dead":
        return "env_dead", "the environment server died or left mid-episode"
    if msg.finish_reason == "no_env_server":
        return "no_env_server", "no environment server for the task attached within env.wait_for_server_s"
    if num == 0:
        return "empty_completion", "the completion has no tokens"
    if max_new_tokens is not None and num > max_new_tokens:
        return "bad_rollout", f"{num} completion tokens, more than the {max_new_tokens} handed out"
    if msg.prompt_token_ids.shape[0] != len(group.prompt.token_ids) or \
            msg.prompt_token_ids.tolist() != group.prompt.token_ids:
        return "bad_rollout", "prompt_token_ids differ from the prompt handed out"
    ids = msg.completion_token_ids
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        return "bad_rollout", f"completion token ids outside [0, {vocab_size})"
    if msg.min_policy_version < group.admitted_version:
        return "bad_rollout", (f"sampled with policy version {msg.min_policy_version}, older than the "
                               f"required {group.admitted_version}")
    if int(msg.policy_versions.min()) != msg.min_policy_version or \
            int(msg.policy_versions.max()) != msg.max_policy_version:
        return "bad_rollout", "min/max_policy_version disagree with policy_versions"
    if not bool(torch.isfinite(msg.behaviour_logprobs).all()) or bool((msg.behaviour_logprobs > 0).any()):
        return "bad_rollout", "behaviour_logprobs must be finite and <= 0"
    return episode_problem(msg)


def episode_problem(msg: m.Rollout) -> tuple[str, str] | None:
    """The multi-turn fields: a loss mask of 0s and 1s that trains at least one token, a finite env_reward."""
    if msg.loss_mask is not None:
        mask = msg.loss_mask
        if bool((mask > 1).any()):
            return "bad_rollout", "loss_mask holds values other than 0 and 1"
        if not bool(mask.any()):
            return "bad_rollout", "loss_mask is 0 everywhere: no assistant token to train"
    if msg.env_reward is not None and not math.isfinite(msg.env_reward):
        return "reward_nan", f"env_reward is {msg.env_reward}"
    return None


def to_group(state: GroupState) -> Group:
    samples = [state.results[sid] for sid in sorted(state.results)]
    return Group(group_id=state.group_id, samples=samples, task=state.prompt.task, metadata=state.prompt.metadata)
