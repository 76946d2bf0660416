"""The trainer's side of multi-turn episodes, in process against a fake generator over tcp loopback: work
carries env.max_turns; an EnvReset is answered no_env_server while no environment server is attached and,
once one is, reaches it with the trainer's own prompt and metadata; an episode's Rollout is rewarded by its
env_reward (no reward function asked) and trains with its loss mask; a NaN env_reward, a bad loss mask and
an episode its environment failed are discarded with their reasons; accounting holds.
Run: pytest tests/engine/trainer/test_trainer_episodes.py
"""

import asyncio
import math

import pytest
import torch

from tailrace.engine.config import load_config
from tailrace.engine.trainer.intake import max_completion_tokens
from tailrace.engine.trainer.service import TrainerService
from tailrace.protocol import messages as m
from tailrace.protocol.env_sdk import serve
from tailrace.protocol.transport import Client

pytestmark = pytest.mark.timeout(120)


class Echo:
    """Answers a reset with the prompt and metadata it was given."""

    def reset(self, prompt, metadata):
        return {"text": prompt, "info": {"answer": metadata.get("answer"), "task": metadata.get("task")}}

    def step(self, action):
        return {"done": True, "reward": 1.0}


def make_service(tmp_path):
    cfg = load_config(None, ["--train.steps", "1", "--train.groups_per_step", "1", "--sampling.group_size", "6",
                             "--reward.mode", "builtin", "--trainer.bind", "tcp://127.0.0.1:0",
                             "--trainer.runs_dir", str(tmp_path), "--trainer.run_name", "episodes",
                             "--trainer.heartbeat_interval_s", "0.2", "--env.max_turns", "3",
                             "--env.max_episode_tokens", "40", "--env.wait_for_server_s", "0.3",
                             "--env.timeout_s", "5"])
    return TrainerService(cfg)


def episode(item, sample_id, ids, mask, *, env_reward=None, finish_reason="stop"):
    num = len(ids)
    mask_t = torch.tensor(mask, dtype=torch.uint8)
    return m.Rollout(group_id=item.group_id, sample_id=sample_id,
                     prompt_token_ids=torch.tensor(item.prompt_token_ids, dtype=torch.int32),
                     completion_token_ids=torch.tensor(ids, dtype=torch.int32),
                     behaviour_logprobs=torch.full((num,), -0.5) * mask_t, policy_versions=torch.zeros(num, dtype=torch.int32),
                     min_policy_version=0, max_policy_version=0, finish_reason=finish_reason, loss_mask=mask_t,
                     env_reward=env_reward, num_turns=2)


async def answer(gen, msg):
    await gen.send(msg)
    while True:
        reply = await asyncio.wait_for(gen.recv(), 20)
        if isinstance(reply, m.EnvObservation | m.EnvError):
            return reply


async def test_episodes_are_brokered_rewarded_by_their_environment_and_trained_with_their_mask(tmp_path):
    service = make_service(tmp_path)
    trained = []
    learner_step = service.learner.step
    service.learner.step = lambda groups: (trained.extend(groups), learner_step(groups))[1]
    vocab = service.vocab_size
    run = asyncio.create_task(service.run())
    while service.server is None or not service.server.address.rpartition(":")[2].isdigit():
        await asyncio.sleep(0.02)
    address = service.server.address
    env_task = None
    async with Client(address, role="generator", name="gen", max_inflight=8,
                      capabilities={"vocab_size": vocab}) as gen:
        await asyncio.wait_for(gen.connect(), 10)
        await gen.send(m.WorkRequest(capacity=6, policy_version=0))
        work = await asyncio.wait_for(gen.recv(), 10)
        item = work.items[0]
        assert item.max_turns == 3
        reset = m.EnvReset(request_id=1, episode_id=1, group_id=item.group_id, sample_id=0, task="x", prompt="y")
        none = await answer(gen, reset)
        assert (none.request_id, none.reason) == (1, "no_env_server")
        env_task = asyncio.create_task(serve(Echo, address, name="env-0", connect_timeout_s=10))
        while not service.envs.has_server("reverse"):
            await asyncio.sleep(0.02)
        first = await answer(gen, m.EnvReset(request_id=2, episode_id=2, group_id=item.group_id, sample_id=0,
                                             task="x", prompt="y"))
        prompt = service.controller.groups[item.group_id].prompt
        assert (first.episode_id, first.text) == (2, prompt.text)  # the trainer's prompt, not "y"
        assert first.info == {"answer": prompt.metadata["answer"], "task": "reverse"}
        done = await answer(gen, m.EnvStep(request_id=3, episode_id=2, action="z"))
        assert done.done and done.reward == 1.0
        ids = [5, 6, 7, 8, 9, 10]
        mask = [1, 1, 0, 0, 1, 1]
        await gen.send(episode(item, 0, ids, mask, env_reward=0.25))
        await gen.send(episode(item, 1, ids, mask, env_reward=0.75))
        await gen.send(episode(item, 2, ids, mask, env_reward=math.nan))
        await gen.send(episode(item, 3, ids, [1, 2, 0, 0, 1, 1], env_reward=1.0))
        await gen.send(episode(item, 4, ids, [0] * 6, env_reward=1.0))
        await gen.send(episode(item, 5, ids[:1], [1], finish_reason="env_dead"))
        summary = await asyncio.wait_for(run, 60)
    await asyncio.wait_for(env_task, 10)  # the trainer's Shutdown ends it
    assert summary["samples_trained"] == 2
    assert {k: n for k, n in summary["discarded"].items() if n} == {"reward_nan": 1, "bad_rollout": 2, "env_dead": 1}
    assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())
    samples = sorted((s for g in trained for s in g.samples), key=lambda s: s.sample_id)
    assert [s.reward for s in samples] == [0.25, 0.75]  # the environment's: the built-in function would give ~0
    assert all(s.loss_mask.dtype == torch.bool and s.loss_mask.tolist() == [bool(x) for x in mask] for s in samples)
    assert summary["scored_by"] == {"server": 0, "builtin": 0}


def test_an_episode_may_be_as_long_as_its_token_budget():
    single = load_config(None, ["--sampling.max_new_tokens", "12"])
    episodes = load_config(None, ["--sampling.max_new_tokens", "12", "--env.max_turns", "4",
                                  "--env.max_episode_tokens", "80"])
    unset = load_config(None, ["--sampling.max_new_tokens", "12", "--env.max_turns", "4"])
    assert [max_completion_tokens(c) for c in (single, episodes, unset)] == [12, 80, 12]
