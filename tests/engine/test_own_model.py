"""docs/model-and-data.md's recipe as a user follows it: a model folder of their own, JSONL rows of task
"math", `reward.mode = "servers"`. `tailrace run` starts no built-in reward server (it could not score
"math"), prints the line that attaches one, says the stall while none is attached, and trains to the end
once the user's server attaches with that line. Real processes over loopback; stops only what it started.
"""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny"

USER_REWARD = '''
def score(prompt, completion, metadata):
    return float(completion.strip().startswith(str(metadata["answer"])))
'''


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _own_model(folder: Path) -> None:
    """A freshly initialised model built from a config, with the tiny model's tokenizer: not examples/tiny."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((TINY / name).read_bytes())


def _write_run(tmp_path: Path) -> Path:
    _own_model(tmp_path / "model")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(6) for b in range(6)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_reward.py").write_text(USER_REWARD)
    config = tmp_path / "own.toml"
    config.write_text(f"""
[model]
path = "{tmp_path / 'model'}"

[data]
source = "{tmp_path / 'rows.jsonl'}"
prompt_field = "prompt"
answer_field = "answer"
task = "math"

[reward]
mode = "servers"

[train]
steps = 3
groups_per_step = 2

[sampling]
group_size = 4
max_new_tokens = 12

[launch]
num_generators = 1

[trainer]
run_name = "own"
runs_dir = "{tmp_path / 'runs'}"
stats_interval_s = 0.3
""")
    return config


class Lines:
    """The launcher's stdout, line by line, with a deadline per wait."""

    def __init__(self, proc: subprocess.Popen):
        self.seen: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self._queue.put(line) for line in proc.stdout], daemon=True).start()

    def wait_for(self, text: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            self.seen.append(line)
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r} within {timeout_s} s:\n{''.join(self.seen)[-4000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(300)
def test_own_model_with_reward_servers_says_the_stall_then_trains_with_the_users_server(tmp_path):
    config = _write_run(tmp_path)
    run_dir = tmp_path / "runs" / "own"
    launcher = subprocess.Popen([sys.executable, "-m", "tailrace.engine.cli", "run", "--config", str(config)],
                                cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    reward = None
    try:
        lines = Lines(launcher)
        lines.wait_for("no reward server is started", 120)
        attach = lines.wait_for("tailrace reward --connect", 5).split()
        assert attach[attach.index("--tasks") + 1] == "math"
        assert not (run_dir / "logs" / "reward-0.log").exists()  # the built-in server stays out
        # Without a server the run does not hang silently: the watchdog names the task.
        lines.wait_for("no reward server attached for task 'math'", 90)
        argv = [sys.executable, "-m", "tailrace.engine.cli", *attach[1:]]
        argv[argv.index("module:function")] = "my_reward:score"
        reward = subprocess.Popen(argv, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        launcher.wait(timeout=180)
        reward.wait(timeout=30)  # the trainer's Shutdown ends the user's server too
    finally:
        for proc in (launcher, reward):
            if proc is not None:
                _stop(proc)
    assert launcher.returncode == 0, "".join(lines.seen)[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3, summary
    assert summary["scored_by"]["server"] > 0 and summary["scored_by"]["builtin"] == 0, summary
    assert "reward_error" not in summary["discarded"], summary["discarded"]
    assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())
