"""What an operator meets around `tailrace run` (issue 31): setups that cannot work refused before any model
loads (one line naming the setting, exit 2), `--resume` from the run's own config.toml, then with real
processes (`slow`): SIGTERM / SIGHUP to the launcher and kill -9 of it stop the whole tree with a
checkpoint, a second run on the same folder (or a fixed port of a running run) is refused naming the
owner, and a resumed run comes back on its fixed address with its settings.

Run: pytest tests/engine/test_launch_faults.py   (the real-process ones: -m slow)
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tailrace.engine import cli, launch
from tailrace.engine.config import load_config, to_toml
from tailrace.engine.data import checks

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny")
SMALL = ["--train.groups_per_step", "2", "--sampling.group_size", "4", "--sampling.max_new_tokens", "24",
         "--launch.num_generators", "1", "--trainer.stats_interval_s", "0.3", "--no-progress"]


def _rows(path: Path, *rows: dict) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _refused(capsys, argv: list[str], setting: str) -> str:
    """`tailrace ARGV` exits 2 with one line naming `setting`, in seconds, and loads no model."""
    started = time.monotonic()
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert time.monotonic() - started < 20 and "Loading weights" not in out + err, out + err
    line = err.strip()
    assert "\n" not in line and line.startswith(f"tailrace {argv[0]}: error: {setting}"), err
    return line


# ------------------------------------------------------------------------ refused before any model loads


def test_eval_of_prompts_no_builtin_reward_scores_without_fn_is_refused(tmp_path, capsys):
    rows = _rows(tmp_path / "math.jsonl", {"prompt": "what is 2+2?", "answer": "4", "task": "math"},
                 {"prompt": "rev:abc=", "answer": "cba"})
    line = _refused(capsys, ["eval", "--checkpoint", TINY, "--eval.source", str(rows)], "--fn")
    assert f"eval.source {rows} has prompts of task 'math'" in line


def test_eval_source_errors_come_before_the_model_loads(tmp_path, capsys):
    line = _refused(capsys, ["eval", "--checkpoint", TINY, "--eval.source", str(tmp_path / "missing.jsonl")],
                    "eval.source")
    assert "missing.jsonl" in line
    no_prompt = _rows(tmp_path / "no_prompt.jsonl", {"question": "rev:abc="})
    assert "row 0 has no string field 'prompt'" in _refused(
        capsys, ["eval", "--checkpoint", TINY, "--eval.source", str(no_prompt)], "eval.source")
    (tmp_path / "torn.jsonl").write_text('{"prompt": "rev:abc="}\n{"prompt": \n')
    assert "torn.jsonl:2: not JSON" in _refused(
        capsys, ["eval", "--checkpoint", TINY, "--eval.source", str(tmp_path / "torn.jsonl")], "eval.source")
    _refused(capsys, ["eval", "--checkpoint", TINY, "--fn", "no_such_module:score"], "--fn")
    _refused(capsys, ["eval", "--checkpoint", TINY, "--data.task", "math"], "data.task")


def test_run_with_builtin_rewards_for_a_task_they_do_not_know_is_refused(tmp_path, capsys):
    rows = _rows(tmp_path / "math.jsonl", {"prompt": "what is 2+2?", "answer": "4", "task": "math"})
    runs = tmp_path / "runs"
    line = _refused(capsys, ["run", "--trainer.runs_dir", str(runs), "--reward.mode", "builtin",
                             "--data.source", str(rows)], "reward.mode")
    assert "the prompts have task 'math'" in line
    rows = _rows(tmp_path / "untagged.jsonl", {"prompt": "what is 2+2?"})  # data.task names the task
    assert "task 'math'" in _refused(capsys, ["run", "--trainer.runs_dir", str(runs), "--reward.mode", "builtin",
                                             "--data.source", str(rows), "--data.task", "math"], "reward.mode")
    _refused(capsys, ["run", "--trainer.runs_dir", str(runs), "--data.task", "math"], "data.task")
    _refused(capsys, ["run", "--trainer.runs_dir", str(runs), "--data.source", str(tmp_path / "nope.jsonl")],
             "data.source")
    _refused(capsys, ["run", "--trainer.runs_dir", str(runs), "--eval.every_steps", "2", "--eval.source",
                      str(tmp_path / "nope.jsonl")], "eval.source")
    assert not runs.exists()
    # the same rows with reward.mode auto wait for the user's reward server: not refused

    checks.check_prompts(load_config(None, ["--data.source", str(rows), "--data.task", "math"]))


# ------------------------------------------------------------------------ --resume from config.toml


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _args(resume: bool) -> argparse.Namespace:
    return argparse.Namespace(role="run", config=None, resume=resume, no_progress=True)


def test_resume_reuses_the_runs_config_toml_under_the_command_line(tmp_path):
    runs = tmp_path / "runs"
    bind = f"tcp://127.0.0.1:{_free_port()}"
    original = load_config(None, ["--trainer.run_name", "r", "--trainer.runs_dir", str(runs), "--trainer.bind", bind,
                                  "--checkpoint.every_steps", "3", "--train.lr", "0.001", "--train.steps", "100"])
    (runs / "r" / "checkpoint" / "step_000089").mkdir(parents=True)
    (runs / "r" / "config.toml").write_text(to_toml(original))
    with pytest.raises(ValueError, match=r"^--resume: .* holds no complete checkpoint"):
        launch._prepare(_args(True), ["--trainer.run_name", "r", "--trainer.runs_dir", str(runs)])
    (runs / "r" / "checkpoint" / "step_000089" / "trainer_state.json").write_text("{}")
    (runs / "r" / "checkpoint" / "step_000092").mkdir()  # unfinished: not the one resumed from
    prepared = launch._prepare(_args(True), ["--trainer.run_name", "r", "--trainer.runs_dir", str(runs),
                                             "--train.steps", "120"])
    cfg = prepared.cfg
    assert prepared.resumed == f"resumed from step 89 of {runs / 'r'} (config.toml + overrides: train.steps 120)"
    assert cfg.trainer.bind == bind and cfg.checkpoint.every_steps == 3 and cfg.train.lr == 0.001
    assert cfg.train.steps == 120
    plain = launch._prepare(_args(True), ["--trainer.run_name", "r", "--trainer.runs_dir", str(runs)])
    assert plain.resumed.endswith("(config.toml, no overrides)") and plain.cfg.train.steps == 100
    fresh = launch._prepare(_args(False), ["--trainer.run_name", "r", "--trainer.runs_dir", str(runs)])
    assert fresh.cfg.trainer.bind == "tcp://127.0.0.1:0" and fresh.cfg.checkpoint.every_steps == 0
    with pytest.raises(ValueError, match=r"^--resume: set trainer.run_name"):
        launch._prepare(_args(True), ["--trainer.runs_dir", str(runs)])


# ------------------------------------------------------------------------ real processes


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    for name in ("TAILRACE_LAUNCHER_PID", "TAILRACE_RUN_LOCK"):
        env.pop(name, None)
    return env


def _start(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tailrace.engine.cli", "run", "--trainer.runs_dir",
                             str(tmp_path / "runs"), *SMALL, *args], cwd=tmp_path, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _tree(root: int) -> set[int]:
    """Every process descended from `root`, by parent pid."""
    out = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines()[1:]:
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.add(pid)
            todo.append(pid)
    return found


def _alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            left.add(pid)
    return left


def _wait(what: str, predicate, timeout_s: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert proc is None or proc.poll() is None, f"the run ended while waiting for {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.1)
    return value


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def _kill_tree(proc: subprocess.Popen, pids: set[int]) -> None:
    """After a failed test: what is left of the run, by the pids it had."""
    for pid in _alive(pids | ({proc.pid} if proc.poll() is None else set())):
        os.kill(pid, signal.SIGKILL)
    proc.wait()


def _exact(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())
    return summary


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_to_the_launcher_stops_every_process_with_a_checkpoint(tmp_path, sig):
    run_dir = tmp_path / "runs" / "term"
    proc = _start(tmp_path, "--trainer.run_name", "term", "--train.steps", "1000")
    tree: set[int] = set()
    try:
        _wait("3 steps", lambda: _steps(run_dir) >= 3, 240, proc)
        tree = _wait("the trainer, a generator and a reward server", lambda: len(t := _tree(proc.pid)) >= 3 and t,
                     60, proc)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _kill_tree(proc, tree)
    assert proc.returncode == 0, out
    assert _wait("every child gone", lambda: not _alive(tree), 30), _alive(tree)
    summary = _exact(run_dir)
    assert summary["stop_reason"] == f"signal {sig.name}" and 3 <= summary["steps"] < 1000
    assert (run_dir / "checkpoint" / f"step_{summary['steps']:06d}" / "trainer_state.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_9_of_the_launcher_stops_its_children_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "runs" / "k9"
    proc = _start(tmp_path, "--trainer.run_name", "k9", "--train.steps", "1000")
    tree: set[int] = set()
    try:
        _wait("3 steps", lambda: _steps(run_dir) >= 3, 240, proc)
        tree = _wait("the trainer, a generator and a reward server", lambda: len(t := _tree(proc.pid)) >= 3 and t,
                     60, proc)
        proc.kill()
        proc.communicate()
        assert _wait("every child gone", lambda: not _alive(tree), 60)
    finally:
        _kill_tree(proc, tree)
    summary = _exact(run_dir)
    assert summary["stop_reason"] == f"signal SIGTERM: its launcher (pid {proc.pid}) died"
    assert (run_dir / "checkpoint" / f"step_{summary['steps']:06d}" / "trainer_state.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_run_on_the_same_folder_or_port_is_refused_naming_the_owner(tmp_path):
    run_dir = tmp_path / "runs" / "one"
    bind = f"tcp://127.0.0.1:{_free_port()}"
    proc = _start(tmp_path, "--trainer.run_name", "one", "--train.steps", "1000", "--trainer.bind", bind)
    tree: set[int] = set()
    try:
        _wait("the first step", lambda: _steps(run_dir) >= 1, 240, proc)
        tree = _tree(proc.pid)
        for extra in ([], ["--resume"]):
            started = time.monotonic()
            second = _start(tmp_path, "--trainer.run_name", "one", "--train.steps", "5", *extra)
            out, _ = second.communicate(timeout=60)
            assert second.returncode == 2 and time.monotonic() - started < 30, out
            assert out.strip() == (f"tailrace run: error: trainer.run_name: {run_dir} is in use by "
                                   f"another run (pid {proc.pid} on {socket.gethostname()}, trainer at {bind}, "
                                   f"since {json.loads((run_dir / 'run.lock').read_text())['started']}); stop "
                                   "that run first, or pick another trainer.run_name"), out
        other = _start(tmp_path, "--trainer.run_name", "two", "--train.steps", "5", "--trainer.bind", bind)
        out, _ = other.communicate(timeout=60)
        assert other.returncode == 2 and out.startswith(f"tailrace run: error: trainer.bind: {bind} "), out
        assert f"pid {proc.pid} on " in out and not (tmp_path / "runs" / "two").exists()
        assert _steps(run_dir) >= 1 and proc.poll() is None  # the first run trains on
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _kill_tree(proc, tree)
    assert proc.returncode == 0, out
    assert _exact(run_dir)["stop_reason"] == "signal SIGTERM"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resume_comes_back_on_the_fixed_address_with_the_runs_settings(tmp_path):
    run_dir = tmp_path / "runs" / "fixed"
    bind = f"tcp://127.0.0.1:{_free_port()}"
    first = _start(tmp_path, "--trainer.run_name", "fixed", "--train.steps", "2", "--trainer.bind", bind,
                   "--checkpoint.every_steps", "1", "--checkpoint.keep", "10")
    out, _ = first.communicate(timeout=240)
    assert first.returncode == 0, out
    resumed = _start(tmp_path, "--trainer.run_name", "fixed", "--train.steps", "4", "--resume")
    out, _ = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, out
    said = [line for line in out.splitlines() if line.startswith("tailrace run: resumed from step ")]
    assert len(said) == 1 and said[0].startswith(f"tailrace run: resumed from step 2 of {run_dir} (config.toml "
                                                 "+ overrides: ") and ", train.steps 4," in said[0], out
    assert f"trainer at {bind};" in out
    assert json.loads((run_dir / "endpoint.json").read_text())["address"] == bind
    assert (run_dir / "checkpoint" / "step_000003").is_dir()  # checkpoint.every_steps 1 kept its value
    saved = load_config(run_dir / "config.toml")
    assert saved.trainer.bind == bind and saved.checkpoint.every_steps == 1 and saved.train.steps == 4
    assert _exact(run_dir)["steps"] == 4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_the_launcher_stops_for_a_crashed_child_says_why_in_its_summary(tmp_path):
    run_dir = tmp_path / "runs" / "crash"
    proc = _start(tmp_path, "--trainer.run_name", "crash", "--train.steps", "1000", "--launch.on_child_crash", "stop")
    tree: set[int] = set()
    try:
        _wait("2 steps", lambda: _steps(run_dir) >= 2, 240, proc)
        tree = _tree(proc.pid)
        generator = next(pid for pid in tree if "--name gen-0" in Path(f"/proc/{pid}/cmdline").read_text().replace(
            "\0", " "))
        os.kill(generator, signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            _kill_tree(proc, tree)
    assert proc.returncode == 1 and "gen-0 crashed (code -9); stopping the run" in out, out
    summary = _exact(run_dir)
    assert summary["stop_reason"] == "gen-0 crashed with code -9 (tailrace run stopped the trainer: signal SIGINT)"
