"""The multi-turn example (examples/multiturn/): its environment's episodes and reward, served by `tailrace env`
(a real process, imported from the working directory) through the trainer's EnvBroker with a prompt of its
data, and `tailrace run` starting it as the child env-0 when env.server is set.
Run: pytest tests/engine/test_multiturn_example.py
"""

import asyncio
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tailrace.engine import launch
from tailrace.engine.config import load_config
from tailrace.protocol.env_broker import EnvBroker
from tailrace.protocol.messages import EnvError, EnvObservation, EnvReset, EnvStep
from tailrace.protocol.transport import Client, Server

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "examples" / "multiturn" / "config.toml"
SPEC = "examples.multiturn.reverse_chain:ReverseChain"

pytestmark = pytest.mark.timeout(60)


def reverse_chain():
    sys.path.insert(0, str(ROOT))
    try:
        from examples.multiturn.reverse_chain import ReverseChain
    finally:
        sys.path.remove(str(ROOT))
    return ReverseChain


def test_an_episode_takes_one_turn_per_word_and_rewards_the_mean_similarity():
    env = reverse_chain()()
    assert env.reset("rev:abc=", {"words": "defg,hi"}) == {"text": "", "reward": 0.0}
    first = env.step("cba")
    assert first["text"] == "rev:defg=" and not first.get("done") and first["reward"] == pytest.approx(1 / 3)
    second = env.step("gfxd")  # 3 of 4 right
    assert second["text"] == "rev:hi=" and second["reward"] == pytest.approx(0.75 / 3)
    last = env.step("xx")  # 0 of 2 right
    assert last["done"] and last["reward"] == 0.0 and last["info"]["mean_score"] == pytest.approx(1.75 / 3)
    # the rewards sum to the mean similarity over the chain; one cut short keeps those of its answered turns
    assert sum(r["reward"] for r in (first, second, last)) == pytest.approx((1 + 0.75 + 0) / 3)
    perfect = reverse_chain()()
    perfect.reset("rev:ab=", {"words": "c"})
    assert perfect.step("ba")["reward"] == 0.5
    assert perfect.step("c") == {"done": True, "reward": 0.5, "info": {"turns": 2, "mean_score": 1.0}}


def test_the_example_data_asks_for_three_to_six_turns():
    rows = [json.loads(line) for line in (ROOT / "examples/multiturn/prompts.jsonl").read_text().splitlines()]
    turns = {1 + len(r["words"].split(",")) for r in rows}
    assert len(rows) == 64 and turns <= set(range(3, 7)) and load_config(CONFIG).env.max_turns >= max(turns)


async def test_tailrace_env_serves_the_example_through_the_broker(tmp_path):
    server = await Server("tcp://127.0.0.1:0", run_id="mt", heartbeat_interval_s=0.2).start()
    row = json.loads((ROOT / "examples/multiturn/prompts.jsonl").read_text().splitlines()[0])
    words = [row["prompt"][4:-1], *row["words"].split(",")]
    broker = EnvBroker(server, timeout_s=10.0, wait_for_server_s=30.0,
                       prompt_of={5: ("reverse_chain", row["prompt"], {"words": row["words"]})}.get)
    log = (tmp_path / "env.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "tailrace.engine.cli", "env", SPEC, "--connect", server.address,
                             "--name", "env-0"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    client = Client(server.address, role="generator", name="gen-0", max_inflight=2)
    ids = itertools.count(1)
    try:
        await client.connect(10.0)

        async def ask(msg):
            await client.send(msg)
            while True:
                reply = await asyncio.wait_for(client.recv(), 30.0)
                if isinstance(reply, EnvObservation | EnvError):
                    return reply

        # the generator's prompt and metadata are ignored: the trainer's row is what the environment sees
        first = await ask(EnvReset(request_id=next(ids), episode_id=1, group_id=5, sample_id=0, task="?", prompt=""))
        assert isinstance(first, EnvObservation) and first.text == "", (first, (tmp_path / "env.log").read_text())
        rewards = [first.reward]
        for i, word in enumerate(words):
            obs = await ask(EnvStep(request_id=next(ids), episode_id=1, action=word[::-1]))
            assert isinstance(obs, EnvObservation), obs
            rewards.append(obs.reward)
            if i + 1 < len(words):
                assert (obs.text, obs.done) == (f"rev:{words[i + 1]}=", False)
        assert obs.done and sum(rewards) == pytest.approx(1.0) and obs.info["turns"] == len(words)
        assert [p.name for p in server.peers.values() if p.role == "env"] == ["env-0"] and broker.num_episodes == 0
    finally:
        await client.close()
        await server.close("test over")
        try:
            proc.wait(10)  # it exits on the trainer's Shutdown
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()
    assert proc.returncode == 0


def test_tailrace_run_starts_the_environment_server_of_env_server(tmp_path, monkeypatch):
    cfg = load_config(CONFIG)
    started = []
    monkeypatch.setattr(launch.Child, "start", lambda self, env, pass_fds=(): started.append(self))
    launcher = launch.Launcher(cfg, tmp_path / "launch.toml", tmp_path, resume=False, progress=False)
    (tmp_path / "logs").mkdir()
    launcher.start_peers("tcp://127.0.0.1:5555")
    env = [c for c in started if c.name == "env-0"]
    assert len(env) == 1 and env[0].argv[-8:] == ["env", SPEC, "--connect", "tcp://127.0.0.1:5555", "--name",
                                                   "env-0", "--timeout-s", str(cfg.env.timeout_s)]
    assert not launcher.needs_reward_server()  # the environment rewards the episodes
    cfg.env.server = ""
    assert launcher.needs_reward_server()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tailrace_run_trains_the_example_without_discards(tmp_path):
    """Every episode has a reward from its environment, also one cut short by env.max_episode_tokens (with one
    final reward only, it had none: it waited reward.wait_for_server_s for a reward server the run does not
    start, then was discarded as no_reward_server), and the generators count their environment calls."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run = subprocess.run([sys.executable, "-m", "tailrace.engine.cli", "run", "--config", str(CONFIG),
                          "--train.steps", "4", "--trainer.runs_dir", str(tmp_path / "runs"), "--trainer.run_name", "mt",
                          "--trainer.stats_interval_s", "0.2", "--reward.wait_for_server_s", "5", "--no-progress"],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:]
    summary = json.loads((tmp_path / "runs" / "mt" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["samples_trained"] == 4 * 8 * 8, summary
    assert {k: n for k, n in summary["discarded"].items() if n and k != "run_ended"} == {}, summary["discarded"]
    assert summary["scored_by"] == {"server": 0, "builtin": 0}  # the environment's rewards alone
    gens = summary["generator_time_s"].values()
    assert len(gens) == 2 and all(g["env_calls"] > 0 and g["env_wait_s"] > 0 for g in gens), gens
