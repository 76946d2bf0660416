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
import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

ROUND_TRIP_EXAMPLE = "hello world, 12 + 30 = 42"
"""Plain lowercase text with spaces, digits and punctuation: what any text tokenizer must give back."""

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_path(path: str) -> None:
    """ValueError naming model.path unless it is "" / "tiny" / "tiny_longtail" (the shipped models), a folder
    with a config.json, or a Hub id (owner/name) that is not a local path."""
    from tailrace.engine.core.models import SHIPPED_MODELS, resolve_model_path

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
    from tailrace.engine.core import run_lock

    claimed = run_lock.claimed_by(runs_dir, address, run_dir)
    if claimed is not None:
        folder, owner = claimed
        raise ValueError(f"{setting}: {address} is the port of another run, in {folder} ({owner}); pick "
                         "another port, or port 0 for a free one")


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
