"""Several reward functions as one weighted sum (reward.functions): the config forms, the combination,
failures that become score errors, and a real `tailrace reward --config` process answering a trainer-side
RewardRouter over TCP; a real `tailrace run` logging each function in metrics.jsonl (slow).
Run: pytest tests/engine/core/test_reward_fns.py [-m slow]
"""

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tailrace.engine.config import RewardConfig, RewardFunctionConfig, commented_toml, load_config, to_toml
from tailrace.engine.core import reward_fns
from tailrace.engine.trainer.scoring import RewardDispatcher, ScoringFailed
from tailrace.protocol.reward_sdk import RewardRouter, ScoreFailed
from tailrace.protocol.transport import Server

ROOT = Path(__file__).resolve().parents[3]

# Values chosen so that a weighted sum is exact in binary: the test compares with ==.
FUNCTIONS = '''
import asyncio
import math


def exact(prompt, completion, metadata):
    return float(completion == metadata.get("answer"))


def length(prompt, completion, metadata):
    return {"reward": len(completion) / 8, "chars": len(completion)}


async def slow_bonus(prompt, completion, metadata):
    await asyncio.sleep(0.01)
    return 0.25


def broken(prompt, completion, metadata):
    if completion == "boom":
        raise ZeroDivisionError("no reward for boom")
    return math.nan if completion == "nan" else 1.0
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(FUNCTIONS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    return tmp_path


def _entries(*specs):
    return tuple(RewardFunctionConfig(fn=f"my_rewards:{name}", weight=w, tasks=tasks) for name, w, tasks in specs)


def test_config_forms_toml_tables_command_line_and_round_trip(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[[reward.functions]]\nfn = "m:exact"\n[[reward.functions]]\nfn = "m:length"\n'
                    'weight = 0.5\nname = "len"\ntasks = ["math"]\n')
    cfg = load_config(path)
    assert cfg.reward.functions == (RewardFunctionConfig(fn="m:exact"),
                                    RewardFunctionConfig(fn="m:length", weight=0.5, name="len", tasks=("math",)))
    assert [f.key for f in cfg.reward.functions] == ["exact", "len"]
    assert load_config(None, ["--reward.functions", "m:exact, m:length=0.5"]).reward.functions == (
        RewardFunctionConfig(fn="m:exact"), RewardFunctionConfig(fn="m:length", weight=0.5))
    (tmp_path / "resolved.toml").write_text(to_toml(cfg))
    assert load_config(tmp_path / "resolved.toml") == cfg
    (tmp_path / "commented.toml").write_text(commented_toml(cfg))
    assert load_config(tmp_path / "commented.toml") == cfg


@pytest.mark.parametrize("overrides, match", [
    (["--reward.functions", "m:f,m:f=2"], r"reward.functions: names \['f', 'f'\] repeat"),
    (["--reward.functions", "nocolon"], "reward.functions: .*expected module:function"),
    (["--reward.functions", "m:f=heavy"], r"reward.functions: 'm:f=heavy' is not module:function\[=WEIGHT\]"),
    (["--reward.functions", "m:f=inf"], "weight must be finite"),
    (["--reward.functions", "m:f", "--reward.mode", "builtin"], 'needs reward.mode "auto" or "servers"'),
])
def test_bad_reward_functions_name_the_setting(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)


def test_the_weighted_sum_and_each_functions_value(user_module):
    parts = reward_fns.components(_entries(("exact", 1.0, ()), ("length", 0.5, ("math",))))
    score = reward_fns.combine(parts)
    assert score.tasks == ("*",)
    assert score("p", "abcd", {"answer": "abcd", "task": "math"}) == {
        "reward": 1.0 * 1.0 + 0.5 * 0.5, "exact": 1.0, "length": 0.5, "length/chars": 4.0}
    assert score("p", "abcd", {"answer": "x", "task": "copy"}) == {"reward": 0.0, "exact": 0.0}  # length: math only
    only_math = reward_fns.combine(reward_fns.components(_entries(("length", 2.0, ("math",)))))
    assert only_math.tasks == ("math",)
    with pytest.raises(ValueError, match="no entry of reward.functions scores task 'copy'"):
        only_math("p", "c", {"task": "copy"})
    with pytest.raises(ValueError, match="reward.functions: 'my_rewards:nope': my_rewards has no function 'nope'"):
        reward_fns.components(_entries(("nope", 1.0, ())))


async def test_an_async_function_among_them_and_failures_name_the_function(user_module):
    score = reward_fns.combine(reward_fns.components(_entries(("exact", 2.0, ()), ("slow_bonus", -1.0, ()))))
    assert await score("p", "a", {"answer": "a"}) == {"reward": 2.0 - 0.25, "exact": 1.0, "slow_bonus": 0.25}
    broken = reward_fns.combine(reward_fns.components(_entries(("exact", 1.0, ()), ("broken", 1.0, ()))))
    with pytest.raises(reward_fns.RewardFunctionFailed, match=r"broken \(my_rewards:broken\): ZeroDivisionError"):
        broken("p", "boom", {})
    with pytest.raises(reward_fns.RewardFunctionFailed, match=r"broken \(my_rewards:broken\): .*non-finite"):
        broken("p", "nan", {})


async def test_with_reward_functions_the_trainer_waits_for_their_server_never_a_builtin():
    cfg = RewardConfig(functions=(RewardFunctionConfig(fn="m:f"),), wait_for_server_s=0.1)
    with pytest.raises(ScoringFailed) as info:
        await RewardDispatcher(cfg).score_with_details("reverse", "rev:ab=", "ba", {"task": "reverse"})
    assert info.value.reason == "no_reward_server"
    assert await RewardDispatcher(RewardConfig()).score("reverse", "rev:ab=", "ba", {}) == 1.0  # without: builtin


@pytest.mark.timeout(60)
async def test_tailrace_reward_serves_the_weighted_sum_over_tcp(user_module):
    (user_module / "run.toml").write_text(
        '[reward]\nmode = "servers"\n'
        '[[reward.functions]]\nfn = "my_rewards:exact"\nweight = 1.0\n'
        '[[reward.functions]]\nfn = "my_rewards:length"\nweight = 0.5\nname = "len"\n'
        '[[reward.functions]]\nfn = "my_rewards:broken"\nweight = 0.0\ntasks = ["fragile"]\n')
    server = await Server("tcp://127.0.0.1:0", run_id="r").start()
    router = RewardRouter(server, timeout_s=10.0, retries=0)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "tailrace.engine.cli", "reward", "--connect", server.address,
                             "--config", "run.toml", "--name", "sum"], cwd=user_module, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(400):
            if router.has_server("math"):
                break
            assert proc.poll() is None, proc.stdout.read()
            await asyncio.sleep(0.05)
        for completion, answer in (("abcd", "abcd"), ("abc", "x"), ("", "")):
            score = await router.score("math", "p", completion, {"answer": answer, "task": "math"})
            exact, length = float(completion == answer), len(completion) / 8
            assert score.reward == 1.0 * exact + 0.5 * length
            assert dict(score.details) == {"exact": exact, "len": length, "len/chars": float(len(completion))}
        for completion, text in (("boom", "ZeroDivisionError: no reward for boom"), ("nan", "non-finite")):
            with pytest.raises(ScoreFailed, match=rf"broken \(my_rewards:broken\): .*{text}") as info:
                await router.score("fragile", "p", completion, {"task": "fragile"})
            assert info.value.code == 500
        ok = await router.score("fragile", "p", "fine", {"task": "fragile", "answer": "fine"})
        assert ok.reward == 1.0 + 0.5 * 0.5 + 0.0 * 1.0 and dict(ok.details) == {"exact": 1.0, "len": 0.5, "len/chars": 4.0, "broken": 1.0}
    finally:
        await server.close("test over")
        try:
            out, _ = proc.communicate(timeout=20)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 0, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_logs_each_function_and_trains_on_their_weighted_sum(user_module):
    (user_module / "run.toml").write_text(f'''
[[reward.functions]]
fn = "tailrace.engine.data.tasks:score"
weight = 1.0
name = "match"
[[reward.functions]]
fn = "my_rewards:length"
weight = -0.25
[trainer]
run_name = "fns"
runs_dir = "{user_module / 'runs'}"
[launch]
num_generators = 1
[train]
steps = 3
groups_per_step = 2
[sampling]
group_size = 4
max_new_tokens = 12
''')
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    run = subprocess.run([sys.executable, "-m", "tailrace.engine.cli", "run", "--config", "run.toml", "--no-progress"],
                         cwd=user_module, env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout + run.stderr
    run_dir = user_module / "runs" / "fns"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    for line in lines:
        assert line["trainer/reward/details/match_count"] == line["trainer/reward/details/length_count"] == 8
        combined = 1.0 * line["trainer/reward/details/match"] - 0.25 * line["trainer/reward/details/length"]
        assert math.isclose(line["trainer/reward/mean"], combined, rel_tol=1e-9, abs_tol=1e-12)
    assert len({line["trainer/reward/details/length"] for line in lines}) > 1 or lines[0]["trainer/reward/std"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["scored_by"]["builtin"] == 0 and summary["scored_by"]["server"] >= 24
