"""Prompt sources: synthetic stream with a resumable position, JSONL rows, prompts too long skipped,
hf:NAME[[:CONFIG]:SPLIT] sources (datasets faked, and a real local folder when datasets is installed)."""

import json
import sys
import types

import pytest

from tailrace.engine.config import DataConfig
from tailrace.engine.data.prompt_sources import PromptSource, parse_hf_source


class CharTokenizer:
    def encode(self, text):
        return [ord(c) % 50 + 4 for c in text]


def test_synthetic_position_resumes_exactly():
    full = PromptSource(DataConfig(), CharTokenizer(), max_prompt_tokens=1000)
    first = [next(full) for _ in range(5)]
    resumed = PromptSource(DataConfig(), CharTokenizer(), max_prompt_tokens=1000, position=3)
    assert [p.text for p in first[3:]] == [next(resumed).text for _ in range(2)]
    assert full.position == 5 and first[0].metadata["task"] == "reverse" and "answer" in first[0].metadata


def test_jsonl_rows_metadata_and_too_long_skipped(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"question": "short", "solution": "42", "task": "math", "level": 3},
            {"question": "x" * 100, "solution": "1"},
            {"question": "ok", "solution": "7"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = DataConfig(source=str(path), prompt_field="question", answer_field="solution", task="default")
    source = PromptSource(cfg, CharTokenizer(), max_prompt_tokens=10)
    got = list(source)
    assert [p.text for p in got] == ["short", "ok"]
    assert got[0].task == "math" and got[0].metadata["answer"] == "42" and got[0].metadata["level"] == 3
    assert got[1].task == "default"
    assert source.skipped_too_long == 1 and source.position == 3


def test_bad_sources_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="not 'synthetic'"):
        PromptSource(DataConfig(source=str(tmp_path / "missing.jsonl")), CharTokenizer(), max_prompt_tokens=10)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        next(PromptSource(DataConfig(source=str(bad)), CharTokenizer(), max_prompt_tokens=10))


def _numbered_file(tmp_path, n):
    path = tmp_path / "n.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(n)))
    return str(path)


def test_file_data_is_read_data_epochs_times_then_says_so(tmp_path):
    cfg = DataConfig(source=_numbered_file(tmp_path, 3), epochs=2)
    source = PromptSource(cfg, CharTokenizer(), max_prompt_tokens=100)
    got = [p.text for p in source]
    assert got == ["p0", "p1", "p2"] * 2 and source.epochs_done == 2
    assert [p.prompt_id for p in PromptSource(cfg, CharTokenizer(), max_prompt_tokens=100)] == list(range(6))
    assert source.exhausted_text() == "data exhausted after 2 epochs of 3 prompts (data.epochs = 2)"


def test_shuffled_epochs_differ_follow_the_seed_and_resume_inside_an_epoch(tmp_path):
    cfg = DataConfig(source=_numbered_file(tmp_path, 20), epochs=2, shuffle=True, seed=7)
    full = [p.text for p in PromptSource(cfg, CharTokenizer(), max_prompt_tokens=100)]
    first, second = full[:20], full[20:]
    assert sorted(first) == sorted(second) == sorted(f"p{i}" for i in range(20))
    assert first != second and first != [f"p{i}" for i in range(20)]
    assert full == [p.text for p in PromptSource(cfg, CharTokenizer(), max_prompt_tokens=100)]
    other_seed = DataConfig(source=cfg.source, epochs=2, shuffle=True, seed=8)
    assert full != [p.text for p in PromptSource(other_seed, CharTokenizer(), max_prompt_tokens=100)]
    for position in (5, 20, 27):  # inside the first epoch, at the boundary, inside the second
        resumed = PromptSource(cfg, CharTokenizer(), max_prompt_tokens=100, position=position)
        assert [p.text for p in resumed] == full[position:]


def test_data_epochs_must_be_positive():
    with pytest.raises(ValueError, match="data.epochs"):
        DataConfig(epochs=0)


# ---------------------------------------------------------------------------------------- hf:NAME[:CONFIG]:SPLIT


@pytest.mark.parametrize("source, parsed", [
    ("hf:openai/gsm8k", ("openai/gsm8k", None, "train")),
    ("hf:openai/gsm8k:test", ("openai/gsm8k", None, "test")),
    ("hf:openai/gsm8k:main:train", ("openai/gsm8k", "main", "train")),
    ("hf:/data/my set:socratic:test[:10]", ("/data/my set", "socratic", "test[:10]")),
    ("hf:openai/gsm8k:test[10%:20%]", ("openai/gsm8k", None, "test[10%:20%]")),
])
def test_hf_sources_name_config_and_split(source, parsed):
    assert parse_hf_source(source) == parsed


@pytest.mark.parametrize("source", ["hf:", "hf:a::train", "hf:a:b:c:d", "hf:a:", "hf::train", "hf:a[:5]", "hf:a:train[:5"])
def test_bad_hf_sources_show_the_grammar(source):
    with pytest.raises(ValueError, match="data.source: .* is not hf:NAME, hf:NAME:SPLIT or hf:NAME:CONFIG:SPLIT"):
        parse_hf_source(source)


def test_hf_sources_pass_config_and_split_to_load_dataset(monkeypatch):
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return [{"question": "q0", "answer": "a0"}, {"question": "q1", "answer": "a1"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    cfg = DataConfig(source="hf:openai/gsm8k:main:train", prompt_field="question")
    got = list(PromptSource(cfg, CharTokenizer(), max_prompt_tokens=100))
    assert [p.text for p in got] == ["q0", "q1"] and got[1].metadata["answer"] == "a1"
    PromptSource(DataConfig(source="hf:openai/gsm8k:test", prompt_field="question"), CharTokenizer(),
                 max_prompt_tokens=100)
    assert calls == [(("openai/gsm8k", "main"), {"split": "train"}), (("openai/gsm8k",), {"split": "test"})]


def test_a_local_dataset_folder_with_configs_loads_like_the_hub_one(tmp_path):
    pytest.importorskip("datasets")
    pytest.importorskip("pyarrow")
    # gsm8k's layout on the Hub: one folder per config, declared in the README's YAML header.
    folder = tmp_path / "gsm8k"
    for config in ("main", "socratic"):
        (folder / config).mkdir(parents=True)
        for split, n in (("train", 3), ("test", 2)):
            (folder / config / f"{split}.jsonl").write_text("".join(
                json.dumps({"question": f"{config} {split} {i}", "answer": f"#### {i}"}) + "\n" for i in range(n)))
    header = "".join(f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train.jsonl\n"
                     f"  - split: test\n    path: {c}/test.jsonl\n" for c in ("main", "socratic"))
    (folder / "README.md").write_text(f"---\nconfigs:\n{header}---\n")
    for source, expected in ((f"hf:{folder}:main:train", [f"main train {i}" for i in range(3)]),
                             (f"hf:{folder}:socratic:test", [f"socratic test {i}" for i in range(2)])):
        cfg = DataConfig(source=source, prompt_field="question", shuffle=True, epochs=2)
        got = list(PromptSource(cfg, CharTokenizer(), max_prompt_tokens=100))
        assert sorted(p.text for p in got[:len(expected)]) == expected and len(got) == 2 * len(expected)
        assert {p.metadata["answer"] for p in got} == {f"#### {i}" for i in range(len(expected))}
