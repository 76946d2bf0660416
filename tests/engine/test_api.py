"""The Python API (engine/api.py, `tailrace.run`): a Config built in Python runs through the launcher of
`tailrace run`, with a reward function given as a callable (served in this process) or as
"module:function" (its own process). Run: pytest tests/engine/test_api.py
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import tailrace
from tailrace.engine import api
from tailrace.engine.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]

def _small(tmp_path, name: str) -> RunConfig:
    cfg = tailrace.Config()
    cfg.train.steps, cfg.train.groups_per_step = 3, 2
    cfg.sampling.group_size, cfg.sampling.max_new_tokens = 4, 16
    cfg.trainer.runs_dir, cfg.trainer.run_name = str(tmp_path / "runs"), name
    cfg.trainer.stats_interval_s = 0.2
    cfg.launch.num_generators = 1
    return cfg


def test_import_tailrace_is_light_and_exports_the_api():
    code = ("import sys, tailrace; assert 'torch' not in sys.modules, 'torch'; "
            "from tailrace.engine.config import RunConfig; assert tailrace.Config is RunConfig; "
            "assert callable(tailrace.run) and tailrace.RunResult and tailrace.RunFailed; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.stdout.strip() == "ok", out.stderr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        tailrace.nope  # noqa: B018


def test_a_config_object_becomes_the_table_a_user_would_write():
    cfg = tailrace.Config()
    cfg.train.steps = 7
    cfg.sampling.group_size = 2
    assert api.config_table(cfg) == {"train": {"steps": 7}, "sampling": {"group_size": 2}}
    assert api.config_table(None) == {}  # trainer.bind left unset: the launcher picks a free port
    table = {"train": {"steps": 2}}
    assert api.config_table(table) == table and api.config_table(table) is not table
    with pytest.raises(TypeError, match="config must be"):
        api.config_table(42)


def test_bad_settings_and_reward_names_are_one_clear_error(tmp_path):
    cfg = _small(tmp_path, "bad")
    cfg.train.steps = 0  # mutated after construction: checked again before anything starts
    with pytest.raises(ValueError, match="train.steps"):
        tailrace.run(cfg)
    with pytest.raises(ValueError, match="unknown setting|train.nope"):
        tailrace.run(_small(tmp_path, "bad"), overrides=["--train.nope", "1"])
    with pytest.raises(ValueError, match="cannot import no_such_module"):
        tailrace.run(_small(tmp_path, "bad"), reward_fn="no_such_module:score")
    assert not (tmp_path / "runs" / "bad").exists()


@pytest.mark.timeout(240)
def test_a_callable_reward_is_served_in_process_and_scores_every_sample(tmp_path):
    calls: list[str] = []

    def score(prompt, completion, metadata):  # a closure: only this process can call it
        calls.append(completion)
        return {"reward": 0.25, "length": float(len(completion))}

    result = tailrace.run(_small(tmp_path, "api"), reward_fn=score)
    summary = result.summary
    assert result.run_dir == tmp_path / "runs" / "api"
    assert summary["steps"] == 3
    assert summary["scored_by"]["server"] == len(calls) >= 3 * 2 * 4  # no built-in function scored any
    lines = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [line["trainer/reward/mean"] for line in lines] == [0.25] * 3
    assert all(line["trainer/reward/details/length_count"] == 8 for line in lines)
    assert (result.checkpoint / "config.json").is_file()
    assert not (result.run_dir / "logs" / "reward-0.log").exists()  # no child for it


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_reward_named_by_module_runs_as_its_own_process(tmp_path, monkeypatch):
    (tmp_path / "my_reward.py").write_text(
        "def score(prompt, completion, metadata):\n    return 1.0 if completion.startswith(' ') else 0.5\n")
    monkeypatch.chdir(tmp_path)  # where the child imports the module from, as `tailrace reward` does
    result = tailrace.run(_small(tmp_path, "named"), reward_fn="my_reward:score", reward_tasks=["reverse", "math"])
    assert result.summary["steps"] == 3 and result.summary["scored_by"]["server"] >= 24
    log = (result.run_dir / "logs" / "reward-0.log").read_text()
    assert "serving ['reverse', 'math']" in log


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_readmes_arithmetic_case_on_the_shipped_model_says_that_nothing_is_learned(tmp_path, capsys):
    """README's Python API case: the shipped tiny model, trained to reverse strings, on the addition prompts
    of examples/arithmetic with README's exact-match reward scores 0 on every sample. Every group then has
    zero reward variance and GRPO no signal: the run says so (progress, log, summary) instead of ending
    quietly at reward 0.000 -> 0.000, and samples.jsonl shows what the model wrote instead. (The same warning
    in-process, fast: tests/engine/trainer/test_trainer_service.py.)"""
    def score(prompt: str, completion: str, metadata: dict) -> float:  # README's
        return float(completion.strip() == metadata["answer"])

    cfg = _small(tmp_path, "arith")
    cfg.data.source, cfg.data.task = str(ROOT / "examples" / "arithmetic" / "prompts.jsonl"), "arith"
    cfg.metrics.no_signal_warn_steps = 2
    result = tailrace.run(cfg, reward_fn=score, progress=True)
    out = capsys.readouterr().out
    lines = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [line["trainer/reward/frac_zero_std"] for line in lines] == [1.0] * 3
    assert [line["trainer/reward/mean"] for line in lines] == [0.0] * 3
    said = "no learning signal: in each of the last 2 steps every group got one reward for all its samples"
    assert f"trainer: {said}" in out  # under the progress, from the notice socket
    assert said in (result.run_dir / "logs" / "trainer.log").read_text()
    assert "The shipped tiny model" in out and f"tailrace samples {result.run_dir}" in out
    assert result.summary["steps_without_signal"] == 3 and "(3 of 3 steps without signal" in out
    assert "attach a reward server" not in out  # the reward function given scores every task
    samples = [json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 * 4 and all(s["reward"] == 0.0 and "+" in s["prompt"] for s in samples)
