"""End to end on CPU: trainer, generator and reward server as real processes over tcp loopback.

A few steps of the shipped tiny model: weights versions advance at the generator, rewards arrive from
the reward server, and summary.json is consistent (handed out == trained + discarded); samples.jsonl holds
each step's completions as the text the reward scored (`tailrace samples` prints them), metrics.jsonl
their lengths, the share of groups without signal and the elapsed time, and the checkpoint's tokenizer the
data.chat_template the run was given. Each test stops only the processes it started, by pid.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL_RUN = ["--train.steps", "3", "--train.groups_per_step", "2", "--sampling.group_size", "4",
             "--sampling.max_new_tokens", "24", "--trainer.bind", "tcp://127.0.0.1:0",
             "--trainer.stats_interval_s", "0.2", "--trainer.heartbeat_interval_s", "0.2",
             "--generator.max_batch_size", "8", "--reward.mode", "servers"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _start(args, log_path):
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "tailrace.engine.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                            env=_env(), cwd=ROOT)
    log.close()
    return proc


def _stop(procs):
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_for(path, proc, log_path, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        assert proc.poll() is None, f"trainer exited early:\n{Path(log_path).read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {path}"
        time.sleep(0.1)
    return json.loads(path.read_text())


@pytest.mark.timeout(280)
def test_trainer_generator_reward_processes(tmp_path):
    run_dir = tmp_path / "runs" / "e2e"
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)  # text prompts are never templated: saved all the same
    trainer = _start(["trainer", *SMALL_RUN, "--trainer.runs_dir", str(tmp_path / "runs"),
                      "--trainer.run_name", "e2e", "--data.chat_template", str(tmp_path / "chat.jinja")],
                     tmp_path / "trainer.log")
    procs = [trainer]
    try:
        endpoint = _wait_for(run_dir / "endpoint.json", trainer, tmp_path / "trainer.log")
        address = endpoint["address"]
        procs.append(_start(["generator", "--connect", address, "--name", "gen-0", *SMALL_RUN],
                            tmp_path / "gen.log"))
        procs.append(_start(["reward", "--connect", address, "--fn", "tailrace.engine.data.tasks:score", "--name", "r0"],
                            tmp_path / "reward.log"))
        top = subprocess.run([sys.executable, str(ROOT / "tools" / "top.py"), "--connect", address, "--once", "--json",
                              "--window-s", "1.5"], capture_output=True, text=True, timeout=60, env=_env())
        assert top.returncode == 0, top.stderr
        snapshot = json.loads(top.stdout.strip().splitlines()[-1])
        assert snapshot["processes"]["trainer"]["role"] == "trainer"
        assert "trainer/controller/samples_handed_out" in snapshot["processes"]["trainer"]["counters"]
        trainer.wait(timeout=240)
        assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        for proc in procs[1:]:
            proc.wait(timeout=30)  # the trainer's Shutdown ends its peers
            assert proc.returncode == 0
    finally:
        _stop(procs)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["policy_version"] == 3
    assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())
    assert summary["samples_trained"] >= 3 * 2 * 4
    assert summary["scored_by"]["server"] >= summary["samples_trained"]
    assert summary["scored_by"]["builtin"] == 0
    # New weights reached the generator: the last step's groups are admitted at version 1, so it must load
    # version 1 to sample them. Version 2 is published while step 3 trains, and the run may end before the
    # generator's next stats say it loaded it (seen once in CI), so >= 2 would be a race, not a check.
    assert summary["generator_policy_versions"]["gen-0"] >= 1
    assert summary["max_staleness_seen"] <= 1
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert (run_dir / "config.toml").is_file()
    checkpoint = sorted((run_dir / "checkpoint").iterdir())[-1]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert model.config.model_type in ("qwen2", "llama")
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(checkpoint).chat_template == CHAT_TEMPLATE
    _check_what_the_run_shows(run_dir, metrics)


CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }};{% endfor %}[assistant]"


def _check_what_the_run_shows(run_dir, metrics):
    from tailrace.engine.data.tasks import score
    from tailrace.engine.trainer import sample_log

    for m in metrics:
        assert 1 <= m["trainer/completion/mean_tokens"] <= m["trainer/completion/max_tokens"] <= 24
        assert m["trainer/completion/mean_tokens"] * m["trainer/batch/samples"] == \
            pytest.approx(m["trainer/batch/completion_tokens"])
        assert m["trainer/reward/frac_zero_std"] in (0.0, 0.5, 1.0)  # 2 groups a step
    assert 0 < metrics[0]["trainer/time/elapsed_s"] < metrics[1]["trainer/time/elapsed_s"] < metrics[2]["trainer/time/elapsed_s"]
    samples = sample_log.read(run_dir / "samples.jsonl")
    assert [r["step"] for r in samples] == [1] * 4 + [2] * 4 + [3] * 4  # metrics.samples_per_step = 4
    for r in samples:  # the text is what the reward server scored
        assert r["prompt"].startswith("rev:") and r["reward"] == score(r["prompt"], r["completion"], {"task": "reverse"})
        assert r["reward"] in r["group_rewards"] and 1 <= len(r["group_rewards"]) <= 4
        assert r["policy_versions"][0] <= r["policy_versions"][1] < r["step"]
    shown = subprocess.run([sys.executable, "-m", "tailrace.engine.cli", "samples", str(run_dir), "--last", "2"],
                           capture_output=True, text=True, timeout=60, env=_env())
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("\nstep 2  group ") + shown.stdout.startswith("step 2  group ") == 4
    assert shown.stdout.count("step 3  group ") == 4 and "step 1 " not in shown.stdout
    assert f"  prompt:     {samples[-1]['prompt']}\n" in shown.stdout
