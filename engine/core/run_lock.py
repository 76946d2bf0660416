"""One run per run folder: an exclusive flock on runs/<name>/run.lock, taken before anything starts.

    take(run_dir, bind)   the lock, or ValueError naming trainer.run_name and the owner (pid, address)
    check_free(run_dir)   the same refusal without taking it (--resume says this before anything else)
    RunLock.say(address)  records the trainer's address once it is bound, for the next one refused
    claimed_by(...)       the running run of a runs folder that claimed a fixed port (preflight)

The kernel drops a flock when the last descriptor of its open file closes, so a crashed owner (kill -9
included) leaves no lock behind, and the file itself is never removed (removing a lock file races with
the next owner). `tailrace run` hands the descriptor to its children (Popen pass_fds) with ENV naming the
file, so the folder stays owned while any process of the run lives, also after the launcher died; a
trainer started by hand takes the lock itself. The file holds JSON: pid, host, bind, address, started.

No torch import here. Test: pytest tests/engine/core/test_run_lock.py
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

FILE_NAME = "run.lock"
ENV = "TAILRACE_RUN_LOCK"  # the lock file a child's launcher holds for it (and handed it the descriptor of)
RETRY_S = 0.5  # another process's probe (claimed_by) holds the file for microseconds: try again this long

_held: dict[Path, RunLock] = {}  # locks this process holds, by lock file


class RunLock:
    """This process owns the run folder while the descriptor `fd` is open."""

    def __init__(self, path: Path, fd: int, info: dict[str, Any]):
        self.path, self.fd, self.info = path, fd, info

    def say(self, **fields: Any) -> None:
        """Add fields (the trainer's address) to what the lock file tells the next one refused."""
        self.info |= fields
        data = json.dumps(self.info).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        if _held.pop(self.path, None) is self:
            os.close(self.fd)


def _read(path: Path) -> dict[str, Any]:
    for _ in range(5):  # the owner may be rewriting it (say)
        try:
            info = json.loads(path.read_text())
            if isinstance(info, dict):
                return info
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    return {}


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def owner_text(path: Path) -> str:
    """Who holds the lock at `path`, in words: pid, address, since when."""
    info = _read(path)
    pid = info.get("pid")
    where = info.get("address") or (f"{info['bind']}, not bound yet" if info.get("bind") else "address unknown")
    since = f", since {info['started']}" if info.get("started") else ""
    who = f"pid {pid} on {info.get('host', '?')}" if pid else "an unknown process"
    if pid and not _alive(pid) and info.get("host") == socket.gethostname():
        who += f", which has exited while a process it started holds the folder (`fuser {path}` names it)"
    return f"{who}, trainer at {where}{since}"


def _in_use(run_dir: Path, path: Path) -> str:
    return (f"trainer.run_name: {run_dir} is in use by another run ({owner_text(path)}); stop that run first, "
            "or pick another trainer.run_name")


def check_free(run_dir: Path) -> None:
    """ValueError naming the owner when another process holds run_dir's lock (take() decides for good)."""
    path = run_dir / FILE_NAME
    if path.resolve() not in _held and os.environ.get(ENV) != str(path.resolve()) and _held_by_another(path):
        raise ValueError(_in_use(run_dir, path.resolve()))


def take(run_dir: Path, *, bind: str) -> RunLock | None:
    """The run folder's lock (creating the folder), or ValueError naming its owner. None when this
    process's launcher holds it for it (ENV). Taking it again in the process that holds it returns it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = (run_dir / FILE_NAME).resolve()
    if path in _held:
        return _held[path]
    if os.environ.get(ENV) == str(path):
        return None
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + RETRY_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.02)
                continue
            os.close(fd)
            raise ValueError(_in_use(run_dir, path)) from None
    lock = RunLock(path, fd, {"pid": os.getpid(), "host": socket.gethostname(), "bind": bind, "address": "",
                              "started": time.strftime("%Y-%m-%d %H:%M:%S")})
    lock.say()
    _held[path] = lock
    return lock


def _held_by_another(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def _endpoint(address: str) -> tuple[str, str] | None:
    """(host, port) of a tcp:// address with a fixed port; None otherwise."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not port.isdigit() or int(port) == 0:
        return None
    return host.strip("[]"), port


def claimed_by(runs_dir: Path, bind: str, own_run_dir: Path) -> tuple[Path, str] | None:
    """(run folder, owner text) of a running run in runs_dir whose trainer.bind is the same fixed port as
    `bind` (a run still loading its model has not bound it yet, so a socket probe cannot see it)."""
    mine = _endpoint(bind)
    if mine is None or not runs_dir.is_dir():
        return None
    for path in sorted(runs_dir.glob(f"*/{FILE_NAME}")):
        if path.parent.resolve() == own_run_dir.resolve() or path.resolve() in _held:
            continue
        theirs = _endpoint(str(_read(path).get("bind", "")))
        wildcard = {"*", "0.0.0.0", "::", ""}
        if theirs is None or theirs[1] != mine[1]:
            continue
        if theirs[0] == mine[0] or theirs[0] in wildcard or mine[0] in wildcard:
            if _held_by_another(path):
                return path.parent, owner_text(path)
    return None
