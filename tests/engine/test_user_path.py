"""What a new user hits, checked: one-line errors naming the setting, a peer that waits for its trainer,
a tokenizer that does not round-trip, the CLI's --version / usage / `tailrace config`, reward dict
details in the metrics, the summary line (GRPO, without signal, DPO), the attach line only where a reward
server is needed, the generators `tailrace run` announces to its trainer, and the own-data recipe (docs/model-and-data.md) end
to end (a reward server started first, a fixed trainer.bind from the config file, file data with
data.epochs, checkpoint/latest, the summary line)."""

import asyncio
import json
import logging
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tailrace.engine import cli
from tailrace.engine.config import RunConfig, commented_toml, from_dict, load_config
from tailrace.engine.core import preflight, report
from tailrace.engine.trainer import scoring

ROOT = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tailrace(*args, cwd, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "tailrace.engine.cli", *args], cwd=cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


# ---------------------------------------------------------------------------------------- one-line errors


def test_model_path_that_does_not_exist_is_one_line_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match=r"^model.path: .*nope does not exist"):
        preflight.check_model_path(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"^model.path: .* has no config.json"):
        preflight.check_model_path(str(tmp_path))
    for fine in ("", "tiny", "Qwen/Qwen2.5-0.5B-Instruct", str(ROOT / "examples" / "tiny")):
        preflight.check_model_path(fine)


def test_port_in_use_is_one_line_naming_trainer_bind():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=rf"^trainer.bind: tcp://127.0.0.1:{port} is not available"):
            preflight.check_bind_free(f"tcp://127.0.0.1:{port}")
    preflight.check_bind_free(f"tcp://127.0.0.1:{port}")  # free again
    preflight.check_bind_free("tcp://127.0.0.1:0")
    preflight.check_bind_free("ipc:///tmp/whatever")


@pytest.mark.timeout(120)
def test_a_port_taken_after_the_preflight_check_is_one_line_and_leaves_no_run_folder(tmp_path, monkeypatch, capsys):
    """The race the preflight probe cannot close: another process binds the port before the trainer does."""
    monkeypatch.setattr(preflight, "check_bind_free", lambda *a, **k: None)  # as if the port went just after it
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = cli.main(["trainer", "--trainer.bind", f"tcp://127.0.0.1:{port}", "--trainer.runs_dir",
                         str(tmp_path / "runs"), "--trainer.run_name", "taken"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith(f"tailrace trainer: error: trainer.bind: cannot bind tcp://127.0.0.1:{port}"), err
    assert "pick another port" in err[-1]
    assert not (tmp_path / "runs" / "taken").exists()


@pytest.mark.timeout(60)
def test_run_with_a_missing_model_fails_at_once_and_leaves_no_run_folder(tmp_path):
    started = time.monotonic()
    proc = _tailrace("run", "--model.path", str(tmp_path / "models" / "mine"), "--trainer.runs_dir",
                     str(tmp_path / "runs"), cwd=tmp_path)
    out, _ = proc.communicate(timeout=50)
    assert proc.returncode == 2 and time.monotonic() - started < 20, out
    assert out.strip().splitlines() == [f"tailrace run: error: model.path: {tmp_path / 'models' / 'mine'} does not "
                                        "exist (a local Hugging Face checkpoint folder, or a Hub id such as "
                                        "Qwen/Qwen2.5-0.5B-Instruct)"]
    assert not (tmp_path / "runs").exists()


def test_a_failed_start_removes_the_folders_it_created(tmp_path):
    run_dir = tmp_path / "runs" / "r1"
    with pytest.raises(ValueError), preflight.removed_if_start_fails(run_dir):
        (run_dir / "logs").mkdir(parents=True)
        raise ValueError("model.path: ...")
    assert not (tmp_path / "runs").exists()
    (run_dir / "checkpoint").mkdir(parents=True)  # a run that exists (a resume) is never removed
    with pytest.raises(ValueError), preflight.removed_if_start_fails(run_dir):
        raise ValueError("boom")
    assert (run_dir / "checkpoint").is_dir()


def test_a_failed_start_keeps_the_log_it_names(tmp_path, monkeypatch):
    """The trainer exits during start-up: the error names its log, the log holds the child's output, and
    the run folder stays because a log was written (the message would point at nothing otherwise)."""
    from tailrace.engine import launch

    run_dir = tmp_path / "runs" / "r1"
    with pytest.raises(RuntimeError) as failed, preflight.removed_if_start_fails(run_dir):
        launcher = launch._set_up(RunConfig(), run_dir, resume=False, progress=False)
        monkeypatch.setattr(launcher, "cli", lambda *args: [sys.executable, "-c", "print('the cause'); exit(3)"])
        launcher.start_trainer()
    log = run_dir / "logs" / "trainer.log"
    assert f"code 3); the end of {log}:\nthe cause" in str(failed.value)
    assert log.read_text().strip() == "the cause"


# ---------------------------------------------------------------------------------------- tokenizer


class SpaceDroppingTokenizer:
    """What transformers 5 made of a char-level Qwen2 tokenizer: spaces vanish."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text if c != " "]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def test_a_tokenizer_that_does_not_round_trip_gets_a_warning_naming_model_and_example():
    warning = preflight.round_trip_warning(SpaceDroppingTokenizer(), "/models/char-qwen")
    assert "/models/char-qwen" in warning and repr(preflight.ROUND_TRIP_EXAMPLE) in warning
    assert "'helloworld,12+30=42'" in warning
    from tailrace.engine.core.models import load_tokenizer

    assert preflight.round_trip_warning(load_tokenizer("tiny"), "") is None


# ---------------------------------------------------------------------------------------- CLI


def test_version_and_bad_flags_print_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("tailrace ")
    for argv, usage, text in [(["run", "--bogus", "1"], "usage: tailrace run", "unrecognized argument --bogus"),
                              (["trainer", "--train.stepz", "3"], "usage: tailrace trainer", "unknown setting --train.stepz"),
                              (["generator", "--connect", "x", "--nope"], "usage: tailrace generator", "--nope"),
                              (["reward", "--connect", "x", "--fn", "a:b", "--nope"], "usage: tailrace reward", "--nope")]:
        with pytest.raises(SystemExit) as exit_:
            cli.parse_args(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith(usage) and text in err, err
    args, overrides = cli.parse_args(["run", "--train.steps", "3", "--trainer.bind=tcp://127.0.0.1:5"])
    assert overrides == ["--train.steps", "3", "--trainer.bind=tcp://127.0.0.1:5"]


def test_tailrace_config_prints_every_setting_resolved_with_defaults_and_reads_back(capsys, tmp_path):
    assert cli.main(["config", "--train.lr", "1e-3", "--data.epochs", "3"]) == 0
    out = capsys.readouterr().out
    assert "lr = 0.001  # AdamW learning rate (default: 0.0005)" in out
    assert "epochs = 3  # file data: passes" in out and "[trainer]" in out
    (tmp_path / "c.toml").write_text(out)
    assert load_config(tmp_path / "c.toml") == load_config(None, ["--train.lr", "1e-3", "--data.epochs", "3"])
    assert from_dict(RunConfig, {}) == load_config(None) and "default:" not in commented_toml(RunConfig())


# ---------------------------------------------------------------------------------------- summary, details


def test_summary_line_says_steps_reward_samples_time_and_checkpoint():
    line = report.summary_line({"steps": 150, "stop_reason": "reached train.steps = 150", "reward_first": 0.47,
                                "reward_last": 0.692, "samples_trained": 9600, "discarded": {"a": 2, "b": 1},
                                "wall_s": 63.4, "checkpoint": "runs/x/checkpoint/latest"})
    assert line == ("150 steps (reached train.steps = 150), reward 0.470 -> 0.692, 9600 samples trained, "
                    "3 discarded, 63 s; model in runs/x/checkpoint/latest (loads with from_pretrained)")


def test_summary_line_of_a_run_without_signal_says_so():
    line = report.summary_line({"steps": 20, "stop_reason": "reached train.steps = 20", "reward_first": 0.0,
                                "reward_last": 0.0, "samples_trained": 1280, "discarded": {}, "wall_s": 40.0,
                                "steps_without_signal": 20})
    assert "reward 0.000 -> 0.000, 1280 samples trained, 0 discarded (20 of 20 steps without signal: every " \
           "group's samples got one reward), 40 s" in line


def test_summary_line_of_a_dpo_run_counts_pairs_and_its_margin():
    summary = {"algorithm": "dpo", "steps": 20, "stop_reason": "reached train.steps = 20", "pairs_trained": 160,
               "pairs_skipped_too_long": 0, "reward_margin_first": 0.0, "reward_margin_last": 0.41,
               "accuracy_first": 0.5, "accuracy_last": 0.875, "wall_s": 12.0, "checkpoint": "runs/d/checkpoint/latest"}
    assert report.summary_line(summary) == (
        "20 steps (reached train.steps = 20), reward margin 0.000 -> 0.410, accuracy 0.50 -> 0.88, 160 pairs "
        "trained, 0 skipped as too long, 12 s; model in runs/d/checkpoint/latest (loads with from_pretrained)")
    empty = report.summary_line({**summary, "steps": 0, "reward_margin_first": None, "reward_margin_last": None})
    assert "no pair trained" in empty and "samples" not in empty and "no reward yet" not in empty


def _launcher(tmp_path, *overrides, reward=None):
    from tailrace.engine.launch import Launcher

    cfg = load_config(None, list(overrides))
    return Launcher(cfg, tmp_path / "launch.toml", tmp_path, resume=False, progress=False, reward=reward)


@pytest.mark.parametrize("overrides, needed, why", [
    ([], False, None),  # the built-in reward server scores the built-in task
    (["--data.task", "arith"], True, "task 'arith' has no built-in reward function"),
    (["--reward.mode", "servers"], True, "reward.mode = servers: no reward server is started"),
    (["--reward.mode", "builtin"], False, None),
    (["--reward.functions", "examples.gsm8k_reward:score"], False, None),  # the launcher serves them
    (["--reward.functions", "examples.gsm8k_reward:score", "--launch.reward_server", "false"], True,
     "launch.reward_server = false: nothing serves reward.functions"),
    (["--launch.reward_server", "false"], False, None),  # the trainer's built-in functions score it
])
def test_tailrace_run_asks_for_a_reward_server_only_where_one_is_needed(tmp_path, overrides, needed, why):
    launcher = _launcher(tmp_path, *overrides)
    assert launcher.needs_reward_server() is needed
    if needed:
        hint = launcher.attach_hint("tcp://127.0.0.1:9")
        assert hint.startswith(f"tailrace run: {why} (") and "attach a reward server with:\n  tailrace reward " \
            "--connect tcp://127.0.0.1:9" in hint


def test_a_reward_function_given_to_tailrace_run_needs_no_server(tmp_path):
    from tailrace.engine.launch import UserReward

    user = UserReward(fn=lambda prompt, completion, metadata: 0.0)
    for overrides in ([], ["--data.task", "arith"], ["--reward.mode", "servers"]):
        assert not _launcher(tmp_path, *overrides, reward=user).needs_reward_server()


def test_the_trainer_says_what_scores_its_completions():
    address = "tcp://127.0.0.1:9"
    line = scoring.reward_line(load_config(None, []), address)
    assert line == "rewards: the built-in function of task 'reverse', or a reward server attached for it"
    assert "attach" not in scoring.reward_line(load_config(None, ["--reward.mode", "builtin"]), address)
    functions = scoring.reward_line(load_config(None, ["--reward.functions", "m:f"]), address)
    assert "tailrace run starts it" in functions and "--config FILE" in functions
    own = scoring.reward_line(load_config(None, ["--data.task", "arith"]), address)
    assert own.endswith("attach a reward server with: tailrace reward --connect tcp://127.0.0.1:9 --fn "
                        "module:function --tasks arith")


def test_tailrace_run_tells_the_trainer_how_many_generators_come(tmp_path, capsys):
    from tailrace.engine.launch import _set_up

    for overrides, expected in (([], 2), (["--launch.num_generators", "3"], 3),
                                (["--trainer.expected_generators", "5"], 5)):
        cfg = load_config(None, overrides)
        launcher = _set_up(cfg, tmp_path / "r", resume=False, progress=False)
        assert load_config(launcher.config_path).trainer.expected_generators == expected


def test_reward_details_become_mean_and_count_per_key():
    from tailrace.engine.trainer.scoring import reward_detail_metrics

    samples = [SimpleNamespace(reward_details=d) for d in ({"exact": 1.0, "len": 4.0}, {"exact": 0.0}, {})]
    metrics = reward_detail_metrics([SimpleNamespace(samples=samples)])
    assert metrics == {"trainer/reward/details/exact": 0.5, "trainer/reward/details/exact_count": 2,
                       "trainer/reward/details/len": 4.0, "trainer/reward/details/len_count": 1}


async def test_builtin_and_server_rewards_carry_their_details():
    from tailrace.engine.config import RewardConfig
    from tailrace.engine.trainer.scoring import RewardDispatcher, ScoringFailed

    d = RewardDispatcher(RewardConfig(mode="builtin"), None, {"t": lambda p, c, md: {"reward": 0.5, "exact": True}})
    assert await d.score_with_details("t", "p", "c", {}) == (0.5, {"exact": 1.0})
    bad = RewardDispatcher(RewardConfig(mode="builtin"), None, {"t": lambda p, c, md: {"reward": 1.0, "x": "no"}})
    with pytest.raises(ScoringFailed, match="detail 'x'"):
        await bad.score_with_details("t", "p", "c", {})


# ---------------------------------------------------------------------------------------- waiting for a trainer


@pytest.mark.timeout(30)
async def test_a_reward_server_started_first_says_it_waits_then_attaches(caplog):
    from tailrace.protocol.reward_sdk import serve
    from tailrace.protocol.transport import Server

    address = f"tcp://127.0.0.1:{_free_port()}"
    welcomed = asyncio.Event()
    caplog.set_level(logging.WARNING, logger="tailrace.transport")
    task = asyncio.create_task(serve(lambda p, c, md: 1.0, address, name="early", connect_timeout_s=math.inf,
                                     waiting_every_s=0.5, on_welcome=lambda _: welcomed.set()))
    await asyncio.sleep(2.0)
    said = [r.getMessage() for r in caplog.records if "waiting for a trainer" in r.getMessage()]
    assert len(said) >= 2 and all(address in s and "until it answers" in s for s in said), said
    assert not task.done()
    server = await Server(address, run_id="late").start()
    try:
        await asyncio.wait_for(welcomed.wait(), 20)
    finally:
        await server.close("test over")
    assert await asyncio.wait_for(task, 10) == "test over"


@pytest.mark.timeout(60)
def test_reward_cli_with_a_deadline_and_no_trainer_says_so_in_one_line(tmp_path):
    address = f"tcp://127.0.0.1:{_free_port()}"
    proc = _tailrace("reward", "--connect", address, "--fn", "tailrace.engine.data.tasks:score", "--connect-timeout-s", "3",
                     cwd=tmp_path)
    out, _ = proc.communicate(timeout=50)
    assert proc.returncode == 1, out
    assert f"waiting for a trainer at {address}" in out and "Traceback" not in out
    assert out.strip().splitlines()[-1] == (f"tailrace reward: no trainer answered at {address} within "
                                            "--connect-timeout-s 3 (is it running, and is this its trainer.bind "
                                            "address?)")


# ------------------------------------------------------------------------------- the own-data recipe

REWARD_MODULE = '''
def score(prompt, completion, metadata):
    answer = prompt.split(":", 1)[1].rstrip("=")[::-1]
    exact = float(completion.strip() == answer)
    return {"reward": 0.5 * exact + 0.5 * float(completion[:1] == answer[:1]), "exact": exact}
'''


@pytest.mark.timeout(300)
def test_own_data_and_reward_server_with_a_fixed_bind_from_the_config_file(tmp_path):
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"rev:{w}="}) + "\n"
                                                    for w in ("abc", "hello", "xyz", "tail")))
    (tmp_path / "my_reward.py").write_text(REWARD_MODULE)
    (tmp_path / "run.toml").write_text(f'''
[data]
source = "{tmp_path / 'prompts.jsonl'}"
epochs = 2
shuffle = true
[reward]
mode = "servers"
[trainer]
bind = "{address}"
run_name = "mine"
runs_dir = "{tmp_path / 'runs'}"
[launch]
num_generators = 1
reward_server = false
[train]
steps = 100
groups_per_step = 2
[sampling]
group_size = 4
max_new_tokens = 16
''')
    reward = _tailrace("reward", "--connect", address, "--fn", "my_reward:score", "--tasks", "reverse",
                       cwd=tmp_path)  # before the trainer: it waits
    try:
        time.sleep(2.0)
        run = _tailrace("run", "--config", str(tmp_path / "run.toml"), "--no-progress", cwd=tmp_path)
        out, _ = run.communicate(timeout=240)
        reward_out, _ = reward.communicate(timeout=30)
    finally:
        for proc in (reward, locals().get("run")):
            if proc is not None and proc.poll() is None:
                proc.kill()
    assert run.returncode == 0, out
    assert f"trainer at {address}" in out
    assert "attach a reward server with:" in out
    assert f"tailrace reward --connect {address} --fn module:function" in out
    assert f"waiting for a trainer at {address}" in reward_out and reward.returncode == 0, reward_out
    run_dir = tmp_path / "runs" / "mine"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["stop_reason"] == "data exhausted after 2 epochs of 4 prompts (data.epochs = 2)"
    assert summary["scored_by"]["server"] == 32
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(line["trainer/reward/details/exact_count"] == 8 for line in lines)
    assert all(0.0 <= line["trainer/reward/details/exact"] <= 1.0 for line in lines)
    assert "tailrace run: 4 steps (data exhausted after 2 epochs" in out
    assert f"model in {run_dir / 'checkpoint' / 'latest'} (loads with from_pretrained)" in out
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoint" / "latest")
    assert model.config.model_type in ("qwen2", "qwen3", "llama")
