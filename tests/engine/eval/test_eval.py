"""Evaluation (docs/algorithms.md, "Evaluation"): the pass@k estimator against hand-computed values and a brute-force
enumeration, the held-out synthetic split, the figures of one evaluation, the settings; then a real short
`tailrace run` with eval.every_steps (eval/ keys at the right steps, training accounting still exact) and
`tailrace eval --checkpoint` on its checkpoint, twice (greedy and seeded figures identical)."""

import asyncio
import itertools
import json
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from tailrace.engine.config import RunConfig, load_config
from tailrace.engine.core import models
from tailrace.engine.data.prompt_sources import PromptSource
from tailrace.engine.eval.suite import EvalResults, PromptOutcome, eval_prompts, eval_requests, pass_at_k

ROOT = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------------------------------- pass@k


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, Fraction(2, 5)),          # pass@1 is the share correct
    (5, 2, 2, 1 - Fraction(3, 10)),     # C(3,2) / C(5,2) = 3 / 10 pairs without a correct one
    (10, 3, 4, 1 - Fraction(35, 210)),  # C(7,4) = 35, C(10,4) = 210
    (4, 0, 2, Fraction(0)),
    (4, 4, 1, Fraction(1)),
    (5, 3, 3, Fraction(1)),             # n - c < k: every draw of 3 holds a correct one
    (1, 1, 1, Fraction(1)),
])
def test_pass_at_k_equals_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == float(expected)


def test_pass_at_k_equals_brute_force_enumeration_of_draws():
    for n in range(1, 8):
        for c in range(n + 1):
            correct = [i < c for i in range(n)]
            for k in range(1, n + 1):
                draws = list(itertools.combinations(range(n), k))
                hits = sum(any(correct[i] for i in draw) for draw in draws)
                assert pass_at_k(n, c, k) == float(Fraction(hits, len(draws))), (n, c, k)


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, 2, 0), (4, 2, 5), (3, -1, 1)]:
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(n, c, k)


# ---------------------------------------------------------------------------------------- prompts


def _cfg(*overrides: str) -> RunConfig:
    return load_config(None, ["--eval.every_steps", "1", *overrides])


def test_synthetic_eval_split_is_held_out_of_training():
    """The eval stream is another seed stream of the task; the texts it shares with the training stream
    (short strings repeat) are skipped by the trainer's source, so no training prompt is an eval prompt."""
    tokenizer = models.load_tokenizer("tiny")
    cfg = _cfg("--eval.num_prompts", "200")
    prompts = eval_prompts(cfg, tokenizer, 100)
    texts = {p.text for p in prompts}
    assert len(prompts) == 200 == len(texts) and [p.prompt_id for p in prompts] == list(range(200))
    assert all(p.task == "reverse" and p.metadata["answer"] == p.text[4:-1][::-1] for p in prompts)
    plain = PromptSource(cfg.data, tokenizer, max_prompt_tokens=100)
    shared = {next(plain).text for _ in range(5000)} & texts
    assert shared, "the two streams share short strings: the held-out skip is what keeps them apart"
    source = PromptSource(cfg.data, tokenizer, max_prompt_tokens=100, held_out=frozenset(texts))
    trained = [next(source) for _ in range(5000)]
    assert not {p.text for p in trained} & texts
    assert source.skipped_held_out >= len(shared) and source.position == 5000 + source.skipped_held_out
    assert eval_prompts(cfg, tokenizer, 100) == prompts  # deterministic: the same split in every process


def test_file_eval_source_reads_rows_like_data_source(tmp_path):
    rows = [{"prompt": f"rev:{w}=", "answer": w[::-1]} for w in ("abc", "hello", "xyz")]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = models.load_tokenizer("tiny")
    prompts = eval_prompts(_cfg("--eval.source", str(tmp_path / "held.jsonl"), "--eval.num_prompts", "0"), tokenizer, 100)
    assert [p.text for p in prompts] == ["rev:abc=", "rev:hello=", "rev:xyz="]
    assert [p.metadata["answer"] for p in prompts] == ["cba", "olleh", "zyx"]
    with pytest.raises(ValueError, match="^eval.source: "):
        eval_prompts(_cfg("--eval.source", str(tmp_path / "missing.jsonl")), tokenizer, 100)


def test_each_prompt_gets_one_greedy_sample_and_n_seeded_ones():
    cfg = _cfg("--eval.num_prompts", "3", "--eval.n", "5", "--eval.temperature", "0.7")
    prompts = eval_prompts(cfg, models.load_tokenizer("tiny"), 100)
    requests = eval_requests(cfg, prompts, [2])
    assert [(p.prompt_id, kind, num) for p, kind, num, _ in requests] == [
        (0, "greedy", 1), (0, "sampled", 5), (1, "greedy", 1), (1, "sampled", 5), (2, "greedy", 1), (2, "sampled", 5)]
    greedy, sampled = requests[0][3], requests[1][3]
    assert greedy.temperature == 0.0 and sampled.temperature == 0.7 and sampled.seed is not None
    assert len({r[3].seed for r in requests if r[1] == "sampled"}) == 3  # a seed of its own per prompt


# ---------------------------------------------------------------------------------------- figures


def test_metrics_of_one_evaluation_are_computed_per_prompt():
    cfg = _cfg("--eval.n", "4", "--eval.pass_k", "1,2,4", "--eval.correct_reward", "0.9")
    results = EvalResults(cfg, [PromptOutcome(), PromptOutcome(), PromptOutcome()], seconds=2.0, policy_version=6)
    for prompt_id, greedy, sampled in [(0, 1.0, [1.0, 0.2, 0.95, 0.0]), (1, 0.5, [0.0, 0.0, 0.0, 0.91]),
                                       (2, 0.0, [1.0, 1.0, None, 0.3])]:  # prompt 2: one sample failed
        results.add(prompt_id, "greedy", greedy)
        for reward in sampled:
            results.add(prompt_id, "sampled", reward)
    figures = results.metrics()
    assert figures["eval/greedy/accuracy"] == pytest.approx(1 / 3)
    assert figures["eval/greedy/reward_mean"] == pytest.approx(0.5)
    assert figures["eval/sampled/reward_mean"] == pytest.approx((2.15 + 0.91 + 2.3) / 11)
    assert figures["eval/pass@1"] == pytest.approx((2 / 4 + 1 / 4 + 2 / 3) / 3)
    assert figures["eval/pass@2"] == pytest.approx(((1 - 1 / 6) + (1 - 3 / 6) + (1 - 0 / 3)) / 3)
    assert figures["eval/pass@4"] == pytest.approx((1 + 1) / 2)  # prompt 2 has 3 samples: not counted for k=4
    assert figures["eval/samples_failed"] == 1 and figures["eval/num_prompts"] == 3
    line = results.line(12)
    assert line.startswith("eval at step 12 (policy v6): greedy accuracy 0.333 reward 0.500 | pass@1 0.472")
    assert "3 prompts x 4 samples at T=1, 1 failed, 2.0 s" in line


def test_eval_settings_are_checked_by_name():
    with pytest.raises(ValueError, match=r"^eval.pass_k: \[1, 8\] must be"):
        load_config(None, ["--eval.n", "4", "--eval.pass_k", "1,8"])
    with pytest.raises(ValueError, match="^eval.every_steps: .*dpo"):
        load_config(None, ["--eval.every_steps", "5", "--train.algorithm", "dpo"])
    with pytest.raises(ValueError, match="^eval.num_prompts"):
        load_config(None, ["--eval.num_prompts", "0"])
    with pytest.raises(ValueError, match="^eval.source: synthetic"):
        eval_prompts(_cfg("--data.task", "math"), models.load_tokenizer("tiny"), 100)


# ---------------------------------------------------------------------------------------- real runs


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _tailrace(*args, cwd, timeout):
    return subprocess.run([sys.executable, "-m", "tailrace.engine.cli", *args], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


EVAL_ARGS = ["--eval.num_prompts", "6", "--eval.n", "3", "--eval.pass_k", "1,3", "--eval.temperature", "1.0",
             "--eval.timeout_s", "150"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_with_evaluation_then_eval_of_its_checkpoint(tmp_path):
    run = _tailrace("run", "--train.steps", "4", "--train.groups_per_step", "2", "--sampling.group_size", "4",
                    "--sampling.max_new_tokens", "16", "--launch.num_generators", "1", "--eval.every_steps", "2",
                    *EVAL_ARGS, "--trainer.runs_dir", str(tmp_path / "runs"), "--trainer.run_name", "ev",
                    "--trainer.stats_interval_s", "0.2",
                    # plain decoding: speculation keeps each sample's distribution, not its seeded draw, and
                    # this test compares the in-run figures with `tailrace eval`'s draw for draw
                    "--generator.speculation", "off", cwd=tmp_path, timeout=420)
    assert run.returncode == 0, run.stdout + run.stderr
    run_dir = tmp_path / "runs" / "ev"
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    evaluated = [line["step"] for line in lines if any(k.startswith("eval/") for k in line)]
    assert evaluated == [2, 4]
    for line in lines[1::2]:
        assert line["eval/num_prompts"] == 6 and line["eval/samples_failed"] == 0
        assert line["eval/policy_version"] == line["step"] == line["trainer/policy_version"]
        for key in ("eval/greedy/accuracy", "eval/greedy/reward_mean", "eval/sampled/reward_mean",
                    "eval/pass@1", "eval/pass@3"):
            assert 0.0 <= line[key] <= 1.0, key
        assert line["eval/pass@1"] <= line["eval/pass@3"]
        assert f"trainer: eval at step {line['step']} (policy v{line['step']}): greedy accuracy" in run.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())
    assert summary["samples_trained"] == 4 * 2 * 4  # eval samples are never trained
    ev = summary["eval"]
    assert ev["evaluations"] == 2 and ev["samples_scored"] == 2 * 6 * (1 + 3)
    assert ev["samples_handed_out"] == ev["samples_scored"] + ev.get("samples_failed", 0) + \
        ev.get("samples_redispatched", 0) + ev.get("samples_given_up", 0)
    assert ev["last"] == {k: v for k, v in lines[3].items() if k.startswith("eval/")}

    checkpoint = run_dir / "checkpoint" / "latest"
    # no eval settings given: they come from the run's config.toml
    outs = [_tailrace("eval", "--checkpoint", str(checkpoint), "--json", cwd=tmp_path, timeout=300) for _ in range(2)]
    figures = []
    for out in outs:
        assert out.returncode == 0, out.stdout + out.stderr
        human, last = out.stdout.strip().splitlines()[-2:]
        assert human.startswith("eval at step 4 (policy v4): greedy accuracy ")
        figures.append({k: v for k, v in json.loads(last).items() if k != "eval/seconds"})
    assert figures[0] == figures[1]  # greedy and seeded samples: the same numbers every time
    assert figures[0]["step"] == 4 and figures[0]["eval/num_prompts"] == 6 and figures[0]["eval/samples_failed"] == 0
    assert all(not math.isnan(figures[0][k]) for k in ("eval/greedy/reward_mean", "eval/pass@3"))
    in_run = {k: v for k, v in lines[3].items() if k.startswith("eval/") and k != "eval/seconds"}
    assert in_run == {k: v for k, v in figures[0].items() if k.startswith("eval/")}  # the same model, the same figures
    (tmp_path / "lenient.py").write_text("def score(prompt, completion, metadata):\n    return 1.0\n")
    out = _tailrace("eval", "--checkpoint", str(checkpoint), "--json", "--fn", "lenient:score", "--eval.n", "2",
                    "--eval.pass_k", "2", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lenient = json.loads(out.stdout.strip().splitlines()[-1])
    assert (lenient["eval/greedy/accuracy"], lenient["eval/pass@2"], lenient["n"]) == (1.0, 1.0, 2)


def test_eval_help_names_its_flags():
    out = _tailrace("eval", "--help", cwd=ROOT, timeout=60)
    assert out.returncode == 0
    usage = " ".join(out.stdout.split("\n\n")[0].split())
    assert usage == "usage: tailrace eval [-h] --checkpoint CHECKPOINT [--config CONFIG] [--fn FN] [--json]", usage
    missing = _tailrace("eval", "--checkpoint", str(ROOT / "nope"), cwd=ROOT, timeout=60)
    assert missing.returncode == 2 and "tailrace eval: error: --checkpoint: " in missing.stderr


# ---------------------------------------------------------------------------------------- in process


async def _take(gen, capacity, version):
    from tailrace.protocol import messages as m

    await gen.send(m.WorkRequest(capacity=capacity, policy_version=version))
    while True:
        msg = await asyncio.wait_for(gen.recv(), 20)
        if isinstance(msg, m.Work):
            return msg.items


def _rollout(item, sample_id, token_ids, version, *, eval_flag):
    import torch

    from tailrace.protocol import messages as m

    ids = torch.tensor(token_ids, dtype=torch.int32)
    return m.Rollout(group_id=item.group_id, sample_id=sample_id,
                     prompt_token_ids=torch.tensor(item.prompt_token_ids, dtype=torch.int32),
                     completion_token_ids=ids, behaviour_logprobs=torch.full((len(token_ids),), -0.5),
                     policy_versions=torch.full((len(token_ids),), version, dtype=torch.int32),
                     min_policy_version=version, max_policy_version=version, finish_reason="stop", eval=eval_flag)


async def _until(condition, what):
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(180)
async def test_eval_work_goes_first_is_never_trained_and_survives_a_dead_generator(tmp_path):
    """In process, with fake generators: after step 1 the evaluation is handed out before training work,
    a generator that dies holding it has its eval samples handed out again, an eval sample sent without
    the flag is dropped, the figures are those of the rewards sent, and both accountings hold."""
    from tailrace.engine.trainer.service import TrainerService
    from tailrace.protocol.transport import Client

    cfg = load_config(None, ["--train.steps", "2", "--train.groups_per_step", "1", "--sampling.group_size", "4",
                             "--reward.mode", "builtin", "--trainer.bind", "tcp://127.0.0.1:0",
                             "--trainer.runs_dir", str(tmp_path), "--trainer.run_name", "svc",
                             "--eval.every_steps", "1", "--eval.num_prompts", "2", "--eval.n", "2",
                             "--eval.pass_k", "1,2", "--controller.max_staleness", "0"])
    service = TrainerService(cfg)
    tok, eos = service.tokenizer, service.tokenizer.eos_token_id

    def answer(item, right=True):
        text = tok.decode(item.prompt_token_ids, skip_special_tokens=True)
        return [tok.convert_tokens_to_ids(c) for c in text[4:-1][::-1] + ("" if right else "q")] + [eos]

    run = asyncio.create_task(service.run())
    while service.server is None or not service.server.address.rpartition(":")[2].isdigit():
        await asyncio.sleep(0.02)
    caps = {"vocab_size": service.vocab_size}
    async with Client(service.server.address, role="generator", name="b", capabilities=caps) as b:
        await asyncio.wait_for(b.connect(), 10)
        async with Client(service.server.address, role="generator", name="a", capabilities=caps) as a:
            await asyncio.wait_for(a.connect(), 10)
            (g0,) = await _take(a, 4, 0)
            for sid in range(4):
                await a.send(_rollout(g0, sid, answer(g0), 0, eval_flag=False))
            await _until(lambda: service.evaluator.outstanding == 6, "the evaluation of step 1")
            items = await _take(a, 8, 1)
            assert [(i.eval, i.num_samples) for i in items] == [(True, 1), (True, 2), (True, 1), (True, 2), (False, 2)]
            assert all(i.min_policy_version == 1 and i.group_id >= 1 << 48 for i in items[:4])
            assert [i.sampling.temperature for i in items[:4]] == [0.0, 1.0, 0.0, 1.0]
            (g1_rest,) = await _take(b, 8, 1)  # the rest of training group 1; no eval work is left
            assert not g1_rest.eval and g1_rest.first_sample_id == 2
        # a is gone (Shutdown): its eval samples and its training samples go out again, eval first
        await _until(lambda: len(service.evaluator.queue) == 6, "a's eval samples back in the queue")
        again = await _take(b, 8, 1)
        evals, training = [i for i in again if i.eval], [i for i in again if not i.eval]
        assert sum(i.num_samples for i in evals) == 6 and sum(i.num_samples for i in training) == 2
        greedy = {i.group_id for i in items[:4] if i.num_samples == 1}
        first_prompt = items[0].prompt_token_ids
        for item in evals:  # prompt 0: greedy right, samples right and wrong; prompt 1: all wrong
            right = item.prompt_token_ids == first_prompt and (item.group_id in greedy or item.first_sample_id == 0)
            await b.send(_rollout(item, item.first_sample_id, answer(item, right), 1, eval_flag=True))
        await b.send(_rollout(evals[0], evals[0].first_sample_id, answer(evals[0]), 1, eval_flag=False))
        for item in (g1_rest, *training):
            for sid in range(item.first_sample_id, item.first_sample_id + item.num_samples):
                await b.send(_rollout(item, sid, answer(item), 1, eval_flag=False))
        await _until(lambda: service.learner.step_count == 2 and len(service.evaluator.queue) == 4,
                     "the evaluation of step 2")
        for item in await _take(b, 8, 2):
            for sid in range(item.first_sample_id, item.first_sample_id + item.num_samples):
                await b.send(_rollout(item, sid, answer(item), 2, eval_flag=True))
        summary = await asyncio.wait_for(run, 60)
    assert summary["steps"] == 2 and summary["samples_trained"] == 8
    assert {k: n for k, n in summary["discarded"].items() if n} == {"generator_dead": 2}
    assert summary["samples_handed_out"] == 10 == summary["samples_trained"] + sum(summary["discarded"].values())
    ev = summary["eval"]
    assert (ev["samples_handed_out"], ev["samples_scored"], ev["samples_redispatched"], ev["evaluations"]) == (18, 12, 6, 2)
    assert service.counters["rollouts_dropped/unknown_group"] == 1  # the unflagged eval sample
    lines = [json.loads(line) for line in (tmp_path / "svc" / "metrics.jsonl").read_text().splitlines()]
    first, second = ({k: v for k, v in line.items() if k.startswith(("eval/greedy/accuracy", "eval/pass@"))}
                     for line in lines)
    assert first == {"eval/greedy/accuracy": 0.5, "eval/pass@1": 0.25, "eval/pass@2": 0.5}
    assert second == {"eval/greedy/accuracy": 1.0, "eval/pass@1": 1.0, "eval/pass@2": 1.0}
    assert [line["eval/policy_version"] for line in lines] == [1, 2]
