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
