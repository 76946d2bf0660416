"""runs/<name>/samples.jsonl: a few completions of every trained step as text, so a user sees what the
model writes and what the reward made of it; and `tailrace samples`, which prints them.

    tailrace samples RUN_DIR [--step N] [--last K] [--json]

One JSON object per sample: {"step", "group_id", "sample_id", "prompt", "completion", "reward",
"group_rewards" (every reward of its group, by sample id), "policy_versions" ([oldest, newest] that
sampled it), "completion_tokens", "finish_reason"}. metrics.samples_per_step of them per step, taken from
the step's groups in turn (each group's first sample, then each group's second, ...), so a step's first
lines show different prompts. The completion is decoded with the run's tokenizer as the reward saw it
(special tokens skipped); the prompt is the text the reward got (a conversation: the rendered template).
After a resume the lines of steps past the checkpoint are dropped, as metrics.jsonl's are.
Test: pytest tests/engine/trainer/test_sample_log.py
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

FILE_NAME = "samples.jsonl"


def records(step: int, batch: Sequence[Any], num: int, decode: Callable[[list[int]], str]) -> list[dict[str, Any]]:
    """Up to `num` samples of `batch` (controller GroupStates, scored), one group after the other."""
    ordered = [[g.results[sid] for sid in sorted(g.results)] for g in batch]
    picked = [(g, samples[i]) for i in range(max(map(len, ordered), default=0))
              for g, samples in zip(batch, ordered, strict=True) if i < len(samples)][:num]
    return [{"step": step, "group_id": g.group_id, "sample_id": s.sample_id, "prompt": g.prompt.text,
             "completion": decode(s.completion_ids.tolist()), "reward": s.reward,
             "group_rewards": [g.results[sid].reward for sid in sorted(g.results)],
             "policy_versions": [s.min_policy_version, s.max_policy_version],
             "completion_tokens": s.num_completion_tokens, "finish_reason": s.finish_reason}
            for g, s in picked]


def append(run_dir: Path, lines: list[dict[str, Any]]) -> None:
    if lines:
        with (run_dir / FILE_NAME).open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))


def read(path: Path) -> list[dict[str, Any]]:
    """The records of a samples.jsonl (a line being written, or torn by a crash, is skipped)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            out.append(record)
    return out


def select(lines: list[dict[str, Any]], *, step: int | None = None, last: int = 1) -> list[dict[str, Any]]:
    """The records of `step`, or of the last `last` steps present."""
    if step is not None:
        return [r for r in lines if r["step"] == step]
    steps = sorted({r["step"] for r in lines})[-last:] if last > 0 else []
    return [r for r in lines if r["step"] in set(steps)]


def _block(label: str, text: str) -> str:
    body = text if text else "(empty)"
    return f"  {label:<12}" + body.replace("\n", "\n" + " " * 14)


def render(record: dict[str, Any]) -> str:
    """One sample in a few lines: where it comes from, its reward beside its group's, then the texts."""
    low, high = record["policy_versions"]
    versions = f"policy v{low}" if low == high else f"policy v{low}-v{high}"
    group = " ".join(f"{r:.3g}" for r in record["group_rewards"])
    head = (f"step {record['step']}  group {record['group_id']}  sample {record['sample_id']}  "
            f"reward {record['reward']:.3f}  (group: {group})  {versions}  "
            f"{record['completion_tokens']} tokens, {record['finish_reason']}")
    return "\n".join((head, _block("prompt:", record["prompt"]), _block("completion:", record["completion"])))


def _path(run: str) -> Path:
    path = Path(run)
    if path.is_dir():
        path = path / FILE_NAME
    if not path.is_file():
        raise ValueError(f"{run}: no {FILE_NAME} there (a run folder, runs/<name>, writes it once a step has "
                         "trained, unless metrics.samples_per_step = 0)")
    return path


def main(args: Any, overrides: list[str] | None = None) -> int:
    """`tailrace samples` (args: run, step, last, json)."""
    if args.last < 1:
        raise ValueError(f"--last {args.last}: must be >= 1")
    path = _path(args.run)
    lines = read(path)
    chosen = select(lines, step=args.step, last=args.last)
    if not chosen:
        steps = sorted({r["step"] for r in lines})
        held = f"steps {steps[0]}-{steps[-1]}" if steps else "no step yet"
        raise ValueError(f"{path}: no samples for step {args.step} (it holds {held})" if args.step is not None
                         else f"{path}: no samples yet")
    try:
        for i, record in enumerate(chosen):
            print(json.dumps(record, ensure_ascii=False) if args.json else ("\n" if i else "") + render(record))
        sys.stdout.flush()
    except BrokenPipeError:  # `tailrace samples RUN | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
