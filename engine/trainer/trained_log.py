"""runs/<name>/trained.jsonl: which samples each step trained, one line per step,
{"step": 7, "samples": [[group_id, prompt_id, sample_id], ...]}.

It lets a fault test or `python tools/bench.py faults` prove that nothing was trained twice across kills
and resumes (count prompt ids per epoch). After a resume the lines of steps past the checkpoint are
dropped, as metrics.jsonl's are (runs.keep_metrics_up_to): their training was undone with the crash.
Test: pytest tests/faults/test_accounting.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tailrace.engine.trainer.writes import writing

FILE_NAME = "trained.jsonl"


def append(run_dir: Path, step: int, batch: list[Any]) -> None:
    """Record the samples of `batch` (controller GroupStates) as trained by `step`."""
    samples = [[g.group_id, g.prompt.prompt_id, sid] for g in batch for sid in sorted(g.results)]
    with writing(run_dir / FILE_NAME), (run_dir / FILE_NAME).open("a") as f:  # a torn line is dropped on resume
        f.write(json.dumps({"step": step, "samples": samples}) + "\n")


def read(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / FILE_NAME
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
