"""The multi-turn benchmark (tools/benches/multiturn.py): its in-process environment adapter checks what the
example class returns as an environment server would and hands it the data row's metadata; its trie figures
count shared tokens and where a group's samples part; and (slow) `python tools/bench.py multiturn --quick
--json` runs end to end: real episodes, both replay modes, sync and stream with the example's environment server.
Run: pytest -m slow tests/tools/test_multiturn_bench.py
"""

import asyncio
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tailrace.engine.core.samples import Group, TrainSample
from tailrace.engine.generator.environment import EnvironmentError, EpisodeKey
from tools.benches.multiturn import InProcessEnv, trie_figures

ROOT = Path(__file__).resolve().parents[2]


class Chain:
    """Records what it was given; step returns whatever the test put in `next`."""

    def __init__(self):
        self.next = {"text": "rev:b=", "reward": 0.5}

    def reset(self, prompt, metadata):
        self.seen = (prompt, metadata)
        return {"text": "", "reward": 0.0}

    def step(self, action):
        return self.next


def test_in_process_environment_sends_the_rows_metadata_and_checks_observations_like_a_server():
    made = []
    env = InProcessEnv(lambda: made.append(Chain()) or made[-1], {7: {"words": "b,c"}})
    key = EpisodeKey(7, 3)

    async def episode():
        first = await env.reset(key, "reverse_chain", "rev:a=", {"task": "reverse_chain"})
        obs = await env.step(key, "a")
        made[0].next = {"done": True, "reward": math.nan}  # what a server refuses: env_error
        with pytest.raises(EnvironmentError) as bad:
            await env.step(key, "b")
        made[0].next = {"text": "x", "colour": "red"}
        with pytest.raises(EnvironmentError, match="unknown observation keys"):
            await env.step(key, "b")
        await env.close(key)
        return first, obs, bad.value

    first, obs, bad = asyncio.run(episode())
    assert made[0].seen == ("rev:a=", {"words": "b,c", "task": "reverse_chain"})
    assert (first.text, first.reward, first.done) == ("", 0.0, False)
    assert (obs.text, obs.reward, obs.done) == ("rev:b=", 0.5, False)
    assert bad.reason == "env_error" and "finite" in bad.text
    assert key not in env.envs


def _sample(group, i, prompt, completion):
    t = len(completion)
    return TrainSample(group_id=group, sample_id=i, prompt_ids=torch.tensor(prompt),
                       completion_ids=torch.tensor(completion), behaviour_logprobs=torch.zeros(t),
                       policy_versions=torch.zeros(t, dtype=torch.int64), reward=float(i))


def test_trie_figures_count_shared_tokens_and_where_samples_part():
    # one group: 3 samples of a 4-token prompt; two share 3 completion tokens, the third parts at once
    g = Group(group_id=0, samples=[_sample(0, 0, [1, 2, 3, 4], [5, 6, 7, 8]), _sample(0, 1, [1, 2, 3, 4], [5, 6, 7, 9]),
                                   _sample(0, 2, [1, 2, 3, 4], [6, 6])])
    t = trie_figures([g])
    assert t["logical_tokens"] == 8 + 8 + 6 and t["unique_tokens"] == 4 + 3 + 1 + 1 + 2
    assert t["token_saving"] == pytest.approx(22 / 11)
    assert t["first_divergence_mean"] == pytest.approx((3 + 0 + 0) / 3)
    assert (t["samples"], t["groups"], t["prompt_tokens_mean"]) == (3, 1, 4.0)
    assert t["completion_tokens_mean"] == pytest.approx(10 / 3) and t["reward_mean"] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_benchmark_runs_end_to_end():
    proc = subprocess.run([sys.executable, "tools/bench.py", "multiturn", "--quick", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["bench"] == "multiturn" and r["quick"] is True
    for kind in ("multiturn", "singleturn"):
        assert r[f"samples_{kind}"] == 8 * r[f"groups_{kind}"] > 0
        assert r[f"logical_tokens_{kind}"] > r[f"unique_tokens_{kind}"] > 0 and r[f"token_saving_{kind}"] > 1
        assert r[f"naive_s_{kind}"] > 0 and r[f"auto_s_{kind}"] > 0 and r[f"max_grad_rel_err_{kind}"] < 1e-3
        assert r[f"replay_speedup_{kind}"] == pytest.approx(r[f"naive_s_{kind}"] / r[f"auto_s_{kind}"], rel=1e-2)
    # real episodes: 3-6 turns (env.max_turns 6), a reset and a step per turn each, none failed
    assert 1 <= r["turns_min"] <= r["turns_mean"] <= r["turns_max"] <= 6
    assert set(r["ended_by"]) <= {"stop", "length"} and sum(r["ended_by"].values()) == r["samples_multiturn"]
    most = r["samples_multiturn"] * (1 + r["turns_mean"])  # every turn stepped (an episode cut mid-turn: one less)
    assert r["samples_multiturn"] * r["turns_mean"] <= r["env_calls"] <= most + 0.01
    assert r["env_calls"] == pytest.approx(most, abs=0.01) or r["ended_by"].get("length")
    assert 0 <= r["env_wait_share"] < 1
    assert r["replay_saving"] == pytest.approx(r["token_saving_multiturn"] / r["token_saving_singleturn"], rel=1e-2)
    assert r["target_met"] == (r["speedup_ratio"] >= r["speedup_target"] == 1.5)
    assert r["target_met"] or "part after" in r["target_note"]
    # sync and stream trained the same samples, through the example's environment server
    assert r["samples_equal"] and r["samples_trained"][0] == 8 * r["pipeline_steps"] * r["pipeline_groups_per_step"]
    assert r["pipeline_ratio"] == pytest.approx(r["sync_s"] / r["stream_s"], rel=1e-2)
    assert r["max_staleness_seen"] == {"sync": 0, "stream": 1} or r["max_staleness_seen"]["stream"] <= 1
    assert all(n > 0 for calls in r["env_calls_pipeline"].values() for n in calls)
    # none failed: only what was handed out past the last step (run_ended) goes untrained
    assert all(n == 0 for runs in r["discarded"].values() for d in runs for k, n in d.items() if k != "run_ended")
