"""The ready configs in examples/ (docs/getting-started.md, "Examples"): each one loads and validates on a CPU; the tiny CPU
run is the quickstart's defaults spelled out; the arithmetic example trains with examples/reward_server.py
attached over the protocol. Run: pytest tests/engine/test_examples.py (the end-to-end run is `slow`)
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tailrace.engine.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").rglob("*.toml"))


def test_the_examples_are_there():
    names = {p.relative_to(ROOT / "examples").as_posix() for p in EXAMPLES}
    assert {"tiny_cpu.toml", "arithmetic/config.toml"} <= names, names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(ROOT / "examples").as_posix())
def test_every_example_config_loads_and_validates(path):
    cfg = load_config(path)
    assert cfg.train.steps >= 1
    source = cfg.data.source
    if source.endswith((".jsonl", ".parquet")):
        assert (ROOT / source).is_file(), f"{path.name}: data.source {source} is not in the repository"


def test_the_tiny_cpu_example_is_the_quickstart_defaults():
    assert load_config(ROOT / "examples" / "tiny_cpu.toml") == RunConfig()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_arithmetic_example_trains_with_the_example_reward_server(tmp_path):
    address = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    common = dict(cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run = subprocess.Popen([sys.executable, "-m", "tailrace.engine.cli", "run", "--config",
                            "examples/arithmetic/config.toml", "--trainer.bind", address, "--train.steps", "4",
                            "--trainer.runs_dir", str(tmp_path / "runs"), "--no-progress"], **common)
    reward = subprocess.Popen([sys.executable, "examples/reward_server.py", "--connect", address,
                               "--tasks", "arith"], **common)
    try:
        out, _ = run.communicate(timeout=240)
        reward_out, _ = reward.communicate(timeout=30)
    finally:
        for proc in (run, reward):
            if proc.poll() is None:
                proc.kill()
    assert run.returncode == 0, out
    assert reward.returncode == 0, reward_out
    run_dir = tmp_path / "runs" / "arithmetic"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["scored_by"]["server"] >= 4 * 8 * 8
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(line["trainer/reward/details/exact_count"] == 64 for line in lines)


def test_the_gsm8k_reward_compares_the_last_number_with_the_reference():
    from examples.gsm8k_reward import reference, score

    answer = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    assert reference(answer) == 72.0 and reference("1,234") == 1234.0
    assert score("q", "48 + 24 = 72. #### 72", {"answer": answer}) == {"reward": 1.0, "formatted": 1.0}
    assert score("q", "so 72 clips", {"answer": answer}) == {"reward": 1.0, "formatted": 0.0}
    assert score("q", "#### 71", {"answer": answer})["reward"] == 0.0
    assert score("q", "no idea", {"answer": answer})["reward"] == 0.0
    with pytest.raises(ValueError, match="no number"):
        score("q", "72", {"answer": "none"})


def test_the_gpu_example_names_a_gpu_and_vllm():
    cfg = load_config(ROOT / "examples" / "qwen05b_gpu.toml")
    assert cfg.model.device == "cuda" and cfg.generator.backend == "vllm"
    assert cfg.reward.functions and cfg.data.source == "hf:openai/gsm8k:main:train"


def _docs_block(page: str, section: str, language: str) -> str:
    text = (ROOT / "docs" / page).read_text()
    body = text[text.index(f"\n## {section}\n"):]
    end = body.find("\n## ", 1)  # the next section, if the page has one
    body = body if end < 0 else body[:end]
    start = body.index(f"```{language}\n") + len(f"```{language}\n")
    return body[start: body.index("```", start)]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_docs_python_api_example_runs_as_written(tmp_path):
    """docs/getting-started.md's "Python API" snippet, verbatim, in a folder holding the examples (it names
    examples/arithmetic/prompts.jsonl), with its 20 steps."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    code = _docs_block("getting-started.md", "Python API", "python")
    assert "tailrace.run(cfg, reward_fn=score)" in code
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=380)
    assert done.returncode == 0, done.stderr[-3000:]
    reward_last, checkpoint = done.stdout.split()[-2:]
    assert 0.0 <= float(reward_last) <= 1.0
    assert (Path(checkpoint) if Path(checkpoint).is_absolute() else tmp_path / checkpoint).joinpath("config.json").is_file()
    summary = json.loads(next((tmp_path / "runs").glob("*/summary.json")).read_text())
    assert summary["steps"] == 20 and summary["scored_by"]["server"] >= 20 * 8 * 8
