"""Prompt sources: synthetic stream with a resumable position, JSONL rows, prompts too long skipped."""

import json

import pytest

from tailrace.engine.config import DataConfig
from tailrace.engine.data import PromptSource


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
