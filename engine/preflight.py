"""Checks before a role starts anything heavy, so that a mistake costs one line naming the setting, at once,
instead of a traceback later: the model folder exists, the trainer's port is free (and not claimed by
another running run of the runs folder, which may still be loading its model), the prompt rows can be
read and every task among them has a reward (check_prompts), the tokenizer round-trips text (a warning:
training goes on, but rewards that compare text will be wrong). And a start that fails removes the run
folder it created (removed_if_start_fails).

No torch or transformers import here. Test: pytest tests/engine/test_user_path.py
tests/engine/test_launch_faults.py tests/engine/test_run_lock.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tailrace.engine.config import DataConfig, RunConfig

ROUND_TRIP_EXAMPLE = "hello world, 12 + 30 = 42"
"""Plain lowercase text with spaces, digits and punctuation: what any text tokenizer must give back."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_path(path: str) -> None:
    """ValueError naming model.path unless it is "" / "tiny" / "tiny_longtail" (the shipped models), a folder
    with a config.json, or a Hub id (owner/name) that is not a local path."""
    from tailrace.engine.models import SHIPPED_MODELS, resolve_model_path

    if path == "" or path in SHIPPED_MODELS:
        resolve_model_path(path or "tiny")
        return
    folder = Path(path).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ValueError(f"model.path: {path} has no config.json (expected a Hugging Face checkpoint folder, "
                             "as save_pretrained writes it)")
        return
    if _HUB_ID.match(path) and not path.startswith((".", "~")):
        return  # a Hub id: transformers fetches it where the Hub is reachable
    raise ValueError(f"model.path: {path} does not exist (a local Hugging Face checkpoint folder, or a Hub id "
                     "such as Qwen/Qwen2.5-0.5B-Instruct)")


def check_bind_free(address: str, setting: str = "trainer.bind") -> None:
    """ValueError naming `setting` when a tcp:// address with a fixed port is already taken. The probe
    binds as ZeroMQ does (SO_REUSEADDR), so a port in TIME_WAIT is not reported."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not port.isdigit() or int(port) == 0:
        return
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("" if host == "*" else host, int(port)))
        except OSError as exc:
            raise ValueError(f"{setting}: {address} is not available ({exc.strerror or exc}): another run or "
                             f"program holds port {port}; pick another port, or port 0 for a free one") from None


def check_port_unclaimed(runs_dir: Path, address: str, run_dir: Path, setting: str = "trainer.bind") -> None:
    """ValueError naming `setting` when a running run of runs_dir has the same fixed port in its
    trainer.bind: it binds the port only once its model has loaded, so check_bind_free may not see it yet."""
    from tailrace.engine import run_lock

    claimed = run_lock.claimed_by(runs_dir, address, run_dir)
    if claimed is not None:
        folder, owner = claimed
        raise ValueError(f"{setting}: {address} is the port of another run, in {folder} ({owner}); pick "
                         "another port, or port 0 for a free one")


ROWS_CHECKED = 1000
"""Rows of a file source read before anything starts: a bad file fails at once, not after the model loads."""


def _rows_tasks(data: DataConfig, setting: str, num_rows: int) -> set[str]:
    """The tasks of the first num_rows rows of `data.source` (a .jsonl or .parquet file), each checked to
    have a prompt; ValueError naming `setting` for a missing file, a bad row or no row at all. hf: sources
    are left to `datasets`, in the role that loads them."""
    from tailrace.engine.chat import conversation
    from tailrace.engine.data import file_rows

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
    from tailrace.engine.tasks import TASK_NAMES

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
    from tailrace.engine.tasks import REWARD_FNS

    tasks = prompt_tasks(cfg.data)
    if cfg.eval.every_steps:
        tasks |= prompt_tasks(dataclasses.replace(cfg.data, source=cfg.eval.source), "eval.source")
    unknown = sorted(tasks - set(REWARD_FNS))
    if cfg.reward.mode == "builtin" and unknown:
        raise ValueError(f"reward.mode: builtin scores only the built-in tasks ({', '.join(REWARD_FNS)}), and the "
                         f"prompts have task {', '.join(map(repr, unknown))}: use reward.mode auto with a reward server "
                         "for it (or reward.functions)")


def round_trip_warning(tokenizer: Any, model: str, example: str = ROUND_TRIP_EXAMPLE) -> str | None:
    """A warning when decode(encode(example)) is not example (e.g. a tokenizer rebuilt by transformers
    that drops spaces): completions and rewards would then see different text than the model wrote."""
    ids = tokenizer.encode(example, add_special_tokens=False)
    back = tokenizer.decode(ids, skip_special_tokens=True)
    if back == example:
        return None
    return (f"the tokenizer of {model or 'tiny'} does not round-trip text: {example!r} comes back as {back!r}; "
            "completions and rewards will see altered text (check the tokenizer files or your transformers version)")


@contextlib.contextmanager
def removed_if_start_fails(run_dir: Path) -> Iterator[None]:
    """The folders that the block creates for run_dir (it and any missing parents) are removed again when
    the block raises before any process wrote a log: a failed start leaves no empty run folder behind,
    and the logs that its error message names stay."""
    top: Path | None = None
    if not run_dir.exists():
        top = run_dir
        while not top.parent.exists():
            top = top.parent
    try:
        yield
    except BaseException:
        logs = run_dir / "logs"
        wrote_logs = logs.is_dir() and any(log.stat().st_size > 0 for log in logs.iterdir() if log.is_file())
        if top is not None and not wrote_logs:
            shutil.rmtree(top, ignore_errors=True)
        raise
