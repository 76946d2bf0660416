"""Built-in synthetic tasks, their rewards, and the shipped tiny model (examples/tiny).

Run: pytest tests/engine/data/test_tasks.py
"""

from __future__ import annotations

import itertools
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tailrace.engine.data import tasks

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY = REPO_ROOT / "examples" / "tiny"


def _take(task: str, seed: int, start: int, n: int) -> list[tasks.Prompt]:
    return list(itertools.islice(tasks.synthetic_prompts(task, seed=seed, start=start), n))


# --- prompts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("task", tasks.TASK_NAMES)
def test_prompts_are_deterministic_by_seed_and_resume_at_an_offset(task):
    first = _take(task, seed=3, start=0, n=50)
    assert first == _take(task, seed=3, start=0, n=50)
    assert _take(task, seed=3, start=20, n=30) == first[20:]
    assert [p.prompt_id for p in first] == list(range(50))
    assert first[7] == tasks.make_prompt(task, 3, 7)
    assert [p.text for p in _take(task, seed=4, start=0, n=50)] != [p.text for p in first]


def test_prompts_do_not_depend_on_the_process_hash_seed():
    code = "from tailrace.engine.data.tasks import make_prompt; print(make_prompt('reverse', 5, 11).text)"
    texts = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        done = subprocess.run(
            [sys.executable, "-c", code],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        texts.add(done.stdout.strip())
    assert texts == {tasks.make_prompt("reverse", 5, 11).text}


def test_tasks_module_imports_no_torch():
    code = "import sys, tailrace.engine.data.tasks; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, timeout=60, check=True)


@pytest.mark.parametrize("task", tasks.TASK_NAMES)
def test_prompt_shape_and_reference_answer(task):
    for prompt in _take(task, seed=0, start=0, n=200):
        answer = prompt.metadata["answer"]
        assert prompt.task == prompt.metadata["task"] == task
        assert prompt.text.endswith("=") and set(answer) <= set(tasks.ALPHABET)
        assert tasks.MIN_LENGTH <= len(answer) == prompt.metadata["length"] <= tasks._task(task).max_length
        assert tasks.reference_answer(task, prompt.text) == answer
    prefix = {"reverse": "rev:", "copy": "copy:", "reverse_longtail": "rev:"}[task]
    assert tasks.make_prompt(task, 0, 0).text.startswith(prefix)


def test_response_lengths_are_heavy_tailed():
    lengths = sorted(p.metadata["length"] + 1 for p in _take("reverse", seed=0, start=0, n=5000))  # + EOS
    median = statistics.median(lengths)
    p99 = lengths[int(0.99 * len(lengths))]
    assert p99 >= 4 * median, (median, p99)
    assert max(lengths) <= tasks.MAX_LENGTH + 1


def test_longtail_task_lengths_are_like_the_papers():
    """p99 / median of the answer lengths (+ EOS) >= 8; the same reward as reverse on the same prompt."""
    prompts = _take("reverse_longtail", seed=0, start=0, n=5000)
    lengths = sorted(p.metadata["length"] + 1 for p in prompts)
    assert lengths[int(0.99 * len(lengths))] >= 8 * statistics.median(lengths)
    assert max(lengths) <= 128 + 1
    p = prompts[0]
    assert tasks.score(p.text, p.metadata["answer"], p.metadata) == 1.0
    assert tasks.score_task("reverse", p.text, "x", {}) == tasks.score(p.text, "x", p.metadata)


def test_unknown_task_and_bad_index_are_value_errors():
    with pytest.raises(ValueError, match="task"):
        next(tasks.synthetic_prompts("sort", seed=0))
    with pytest.raises(ValueError, match="index"):
        tasks.make_prompt("reverse", 0, -1)


# --- rewards -------------------------------------------------------------------------------------


def test_reward_hand_cases():
    meta = {"task": "reverse"}
    assert tasks.score("rev:abcde=", "edcba", meta) == 1.0
    assert tasks.score("rev:abcde=", "", meta) == 0.0
    assert tasks.score("rev:abcde=", "edcbX", meta) == pytest.approx(0.8)  # one substitution
    assert tasks.score("rev:abcde=", "edcb", meta) == pytest.approx(0.8)  # stopped one early
    assert tasks.score("rev:abcde=", "edcbaa", meta) == pytest.approx(5 / 6)  # ran on by one
    assert tasks.score("rev:abcde=", "edcba" + "x" * 45, meta) == pytest.approx(0.1)  # length penalty
    assert tasks.score("rev:abcde=", "abcde", meta) == pytest.approx(0.2)  # copied instead of reversed
    assert tasks.score("rev:abcde=", "edcba<eos>junk", meta) == 1.0  # decoded with special tokens kept
    assert tasks.score("copy:abcde=", "abcde", {"task": "copy"}) == 1.0
    assert tasks.score("rev:abcde=", "zzzzzzzz", meta) == 0.0
    assert tasks.score("rev:abcde=", "edcba", {}) == 1.0  # the default task


def test_rewards_stay_in_unit_interval_on_garbage():
    rng = random.Random(0)
    alphabet = tasks.ALPHABET + "=:<> !"
    for prompt in _take("reverse", seed=1, start=0, n=200):
        completion = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 100)))
        reward = tasks.score(prompt.text, completion, dict(prompt.metadata))
        assert 0.0 <= reward <= 1.0
        assert reward < 0.6  # random text earns little


def test_reward_functions_registered_by_task():
    assert set(tasks.REWARD_FNS) == set(tasks.TASK_NAMES)
    prompt = tasks.make_prompt("copy", 0, 3)
    assert tasks.REWARD_FNS["copy"](prompt.text, prompt.metadata["answer"], prompt.metadata) == 1.0
    assert tasks.score_task("copy", prompt.text, prompt.metadata["answer"], prompt.metadata) == 1.0


def test_reward_recomputes_the_answer_from_the_prompt():
    # metadata comes over the wire: a wrong "answer" in it must not be rewarded
    assert tasks.score("rev:abc=", "zzz", {"task": "reverse", "answer": "zzz"}) == 0.0
    with pytest.raises(ValueError, match="prompt"):
        tasks.score("copy:abc=", "abc", {"task": "reverse"})
    with pytest.raises(ValueError, match="task"):
        tasks.score("rev:abc=", "cba", {"task": "sort"})
    with pytest.raises(ValueError, match="metadata.task"):
        tasks.score("rev:abc=", "cba", {"task": 3})


def test_levenshtein():
    assert tasks.levenshtein("", "abc") == 3
    assert tasks.levenshtein("kitten", "sitting") == 3
    assert tasks.levenshtein("abc", "abc") == 0


# --- the shipped tiny model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(TINY)
    model = AutoModelForCausalLM.from_pretrained(TINY).eval()
    return tokenizer, model


def test_tiny_model_folder_is_small_and_complete():
    names = {p.name for p in TINY.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not any("optimizer" in name for name in names)
    assert sum(p.stat().st_size for p in TINY.iterdir()) <= 20 * 2**20


def test_deepened_model_computes_the_same_function(tiny, tmp_path):
    """tools/make_tiny_model.py --deepen: 12 layers, the same logits as the shipped 4 (long-tail bench policy)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tools.make_tiny_model import deepen

    _, model = tiny
    deep = AutoModelForCausalLM.from_pretrained(deepen(TINY, tmp_path / "deep", 12)).eval()
    assert deep.config.num_hidden_layers == 12
    ids = torch.randint(4, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(deep(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="deepen"):
        deepen(TINY, tmp_path / "bad", 10)


def test_tokenizer_round_trip(tiny):
    tokenizer, _ = tiny
    assert len(tokenizer) == len(tasks.VOCAB) == 64
    assert tokenizer.convert_ids_to_tokens(list(range(len(tasks.VOCAB)))) == list(tasks.VOCAB)
    for prompt in _take("reverse", seed=2, start=0, n=50):
        text = prompt.text + prompt.metadata["answer"]
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id and len(ids) == len(text) + 1  # one token per character
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    ids = tokenizer("a b=9?")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a b=9?"  # spaces and symbols survive
    assert (
        tokenizer.decode(
            [*tokenizer("cba", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id],
            skip_special_tokens=True,
        )
        == "cba"
    )
    assert tokenizer("Z")["input_ids"][1] == tokenizer.unk_token_id


def test_model_loads_and_matches_tokenizer(tiny):
    import torch

    tokenizer, model = tiny
    config = model.config
    assert config.vocab_size == len(tokenizer)
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    assert config.model_type in ("llama", "qwen2")
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    assert config.tie_word_embeddings
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    ids = tokenizer("rev:abc=", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits_BTV = model(input_ids=ids).logits
    assert logits_BTV.shape == (1, ids.shape[1], len(tokenizer))


def test_model_has_learnt_the_task_on_short_strings(tiny):
    import torch

    tokenizer, model = tiny
    prompts = [p for p in _take("reverse", seed=99, start=0, n=200) if p.metadata["length"] <= 6][:16]
    batch = tokenizer([p.text for p in prompts], return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(**batch, do_sample=False, max_new_tokens=12)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    rewards = [tasks.score(p.text, t, dict(p.metadata)) for p, t in zip(prompts, texts, strict=True)]
    assert statistics.mean(rewards) >= 0.6  # an untrained model scores about 0.1
