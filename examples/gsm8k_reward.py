"""Reward function for gsm8k-style data: 1.0 when the completion's last number equals the reference
answer's (the number after "####" in gsm8k's `answer` column, or the whole answer when it is a number),
else 0.0; `formatted` says whether the completion wrote its answer after "####" as the data does.

    reward.functions = [{fn = "examples.gsm8k_reward:score"}]      (examples/qwen05b_gpu.toml)
    tailrace reward --connect ADDR --fn examples.gsm8k_reward:score --tasks gsm8k
Run from the repository root. Test: pytest tests/engine/test_examples.py -k gsm8k
"""

from __future__ import annotations

import re
from typing import Any

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
tasks = ("gsm8k",)


def _number(text: str) -> float | None:
    found = NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


def reference(answer: str) -> float | None:
    """The reference number: after the last "####" when there is one (gsm8k), else the answer's last number."""
    return _number(answer.rpartition("####")[2] if "####" in answer else answer)


def score(prompt: str, completion: str, metadata: dict[str, Any]) -> dict[str, float]:
    want = reference(str(metadata.get("answer", "")))
    if want is None:
        raise ValueError("metadata['answer'] holds no number to compare with")
    tail = completion.rpartition("####")[2] if "####" in completion else completion
    got = _number(tail)
    return {"reward": float(got is not None and abs(got - want) < 1e-6), "formatted": float("####" in completion)}
