"""The prompts of a run, read before anything loads: a missing or bad data file, a task no reward can
score or a synthetic task that does not exist is refused in one line naming the setting (exit 2), not
after the model has loaded. Used by `tailrace run`, `tailrace trainer` and `tailrace eval`.
Test: pytest tests/engine/test_launch_faults.py
"""

from __future__ import annotations

import dataclasses

from tailrace.engine.config import DataConfig, RunConfig

ROWS_CHECKED = 1000
"""Rows of a file source read before anything starts: a bad file fails at once, not after the model loads."""


def _rows_tasks(data: DataConfig, setting: str, num_rows: int) -> set[str]:
    """The tasks of the first num_rows rows of `data.source` (a .jsonl or .parquet file), each checked to
    have a prompt; ValueError naming `setting` for a missing file, a bad row or no row at all. hf: sources
    are left to `datasets`, in the role that loads them."""
    from tailrace.engine.data.chat import conversation
    from tailrace.engine.data.prompt_sources import file_rows

    if data.source.startswith("hf:"):
        return set()
    tasks: set[str] = set()
    try:
        for index, row in enumerate(file_rows(data)):
            if index == num_rows:
                break
            if conversation(row, data.prompt_field, index) is None and not isinstance(row.get(data.prompt_field), str):
                raise ValueError(f"data: row {index} has no string field {data.prompt_field!r}, nor a list of "
                                 f"turns there or in 'messages' (set data.prompt_field)")
            tasks.add(row["task"] if isinstance(row.get("task"), str) else data.task)
    except ValueError as exc:
        text = str(exc)
        raise ValueError(text.replace("data.source", setting, 1) if text.startswith("data.source") else
                         f"{setting}: {data.source}: {text.removeprefix('data: ')}") from None
    if not tasks:
        raise ValueError(f"{setting}: {data.source} has no rows")
    return tasks


def prompt_tasks(data: DataConfig, setting: str = "data.source", num_rows: int = ROWS_CHECKED) -> set[str]:
    """The tasks of a prompt source as far as it can be read before a tokenizer loads: data.task for the
    synthetic stream (which must be a built-in task), the tasks of a file's first num_rows rows."""
    from tailrace.engine.data.tasks import TASK_NAMES

    if data.source == "synthetic":
        if data.task not in TASK_NAMES:
            raise ValueError(f"data.task: {data.task!r} is not a built-in task ({', '.join(TASK_NAMES)}), and "
                             f"{setting} = synthetic draws prompts of those; give {setting} a file for your own task")
        return {data.task}
    return _rows_tasks(data, setting, num_rows)


def check_prompts(cfg: RunConfig) -> None:
    """The prompts of a GRPO run (data.source, and eval.source when eval.every_steps is set) can be read,
    and with reward.mode = builtin every task among them has a built-in reward: a run that would discard
    their samples as no_reward_fn is refused instead."""
    from tailrace.engine.data.tasks import REWARD_FNS

    tasks = prompt_tasks(cfg.data)
    if cfg.eval.every_steps:
        tasks |= prompt_tasks(dataclasses.replace(cfg.data, source=cfg.eval.source), "eval.source")
    unknown = sorted(tasks - set(REWARD_FNS))
    if cfg.reward.mode == "builtin" and unknown:
        raise ValueError(f"reward.mode: builtin scores only the built-in tasks ({', '.join(REWARD_FNS)}), and the "
                         f"prompts have task {', '.join(map(repr, unknown))}: use reward.mode auto with a reward server "
                         "for it (or reward.functions)")
