"""Writes to the run folder that fail (a full disk, a quota, an I/O error), named in one line.

    writing(path)   a block whose OSError becomes WriteFailed naming `path` (or the file the error names)
    WriteFailed     "cannot write PATH: [Errno 28] No space left on device", plus what the trainer did
    os_error(exc)   the OSError behind an exception, also inside torch.distributed.checkpoint's
                    CheckpointException (a BaseException holding each rank's error)
    say(line)       the line on stderr, which the operator sees, once, flushed

What the trainer does with them: engine/trainer/saving.py. Test: pytest tests/engine/trainer/test_disk_errors.py
"""

from __future__ import annotations

import contextlib
import errno
import sys
from collections.abc import Iterator
from pathlib import Path


class WriteFailed(Exception):
    """An OSError while writing `path`; `outcome` (set by the trainer) says what became of the run."""

    def __init__(self, path: str | Path, error: OSError):
        super().__init__(str(path), error)
        self.path = str(error.filename or path)
        self.error = error
        self.outcome = ""

    def __str__(self) -> str:
        code = errno.errorcode.get(self.error.errno or 0)
        error = f"[Errno {self.error.errno}] {self.error.strerror}" if code else str(self.error)
        return f"cannot write {self.path}: {error}" + (f"; {self.outcome}" if self.outcome else "")


def os_error(exc: BaseException) -> OSError | None:
    """The OSError that `exc` is or wraps (its cause chain, DCP's per-rank failures), else None."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError):
            return current
        for failure in getattr(current, "failures", {}).values():  # CheckpointException: rank -> (exc, trace)
            todo.append(failure[0] if isinstance(failure, tuple) else failure)
        todo += [current.__cause__, current.__context__]
    return None


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    try:
        yield
    except WriteFailed:
        raise
    except BaseException as exc:
        error = os_error(exc)
        if error is None:
            raise
        raise WriteFailed(path, error) from exc


def say(line: str) -> None:
    """One line on stderr. Under `tailrace run` that is the trainer's log, itself perhaps on the full disk:
    the line then reaches the operator through the launcher (Event "write_failed"), not from here."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass

