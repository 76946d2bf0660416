"""Example reward server: exact match against metadata["answer"] scores 1.0, a partial match less.

Run it next to a trainer (the trainer logs the address it listens on):
    python examples/reward_server.py --connect tcp://127.0.0.1:PORT [--tasks copy,math] [--max-concurrency 16]
The SDK (protocol/reward_sdk.py) handles the handshake, heartbeats, credits, concurrency and timeouts; this
file is only the scoring rule. Test: pytest tests/protocol/test_reward_sdk.py -k example
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script from a checkout: make `protocol` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _normalise(text: str) -> str:
    return " ".join(text.strip().lower().split())


def score(prompt: str, completion: str, metadata: dict[str, Any]) -> dict[str, float]:
    """1.0 for the exact answer (whitespace and case aside); otherwise the fraction of the answer's
    leading characters the completion gets right, scaled to at most 0.5."""
    answer = _normalise(str(metadata.get("answer", "")))
    got = _normalise(completion)
    if not answer:
        raise ValueError("metadata has no 'answer' to compare with")
    exact = float(got == answer)
    prefix = 0
    for a, b in zip(answer, got, strict=False):
        if a != b:
            break
        prefix += 1
    partial = prefix / len(answer)
    return {"reward": 1.0 if exact else 0.5 * partial, "exact": exact, "prefix": partial}


if __name__ == "__main__":
    from tailrace.protocol.reward_sdk import main

    sys.exit(main(score))
