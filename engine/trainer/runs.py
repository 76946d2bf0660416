"""A run's folder, shared by the GRPO and DPO trainers.

    runs/<name>/config.toml    the resolved config (make_run_dir)
    runs/<name>/metrics.jsonl  one line per step; after a resume, the lines of steps past the checkpoint
                               (logged before a crash, trained again) are dropped (keep_metrics_up_to)
Test: pytest tests/engine/test_launch.py tests/engine/trainer/test_dpo.py
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from tailrace.engine.config import RunConfig, to_toml


def make_run_dir(cfg: RunConfig, resume: bool) -> Path:
    name = cfg.trainer.run_name or time.strftime("run-%Y%m%d-%H%M%S")
    run_dir = Path(cfg.trainer.runs_dir) / name
    if resume and not (run_dir / "checkpoint").is_dir():
        raise ValueError(f"--resume: {run_dir}/checkpoint does not exist (set trainer.run_name to the run)")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    return run_dir


def keep_metrics_up_to(path: Path, step: int) -> None:
    """Drop the lines of steps after `step` from a JSONL log (a crash after the checkpoint logged them),
    and a line torn by the crash (kill -9 in the middle of a write)."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if (record := _record(line)) is not None and record.get("step", 0) <= step]
    if len(kept) != len(lines):
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, path)


def _record(line: str) -> dict | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None
