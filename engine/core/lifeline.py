"""A child of `tailrace run` stops when its launcher dies, also by kill -9 (which no handler sees).

The launcher starts each child with TAILRACE_LAUNCHER_PID in its environment; the child's command line
(engine/cli.py) calls follow_launcher() first thing, which takes the variable out of the environment (so
its own children, torchrun's ranks or vLLM's workers, do not act on it) and asks the kernel for SIGTERM
when its parent dies: prctl(PR_SET_PDEATHSIG) on Linux, kept across exec (the trainer's re-exec under
torchrun). The kernel's signal comes at once and needs nothing of the child: no thread, no free event
loop. Elsewhere a daemon thread compares the parent pid every POLL_S seconds and sends the same SIGTERM.
A launcher already gone before the request took effect is seen by the parent pid check that follows it.
SIGTERM is what each role already stops on: the trainer finishes its step, checkpoints and writes
summary.json, whose stop_reason (stop_reason below) then says that the launcher died; a generator or a
reward server holds nothing of the run's state and exits at once.

Test: pytest tests/engine/core/test_lifeline.py
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

LAUNCHER_PID_ENV = "TAILRACE_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
POLL_S = 0.5

_launcher_pid: int | None = None


def child_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a child of this process that must stop when this process dies."""
    return env | {LAUNCHER_PID_ENV: str(os.getpid())}


def follow_launcher() -> int | None:
    """With TAILRACE_LAUNCHER_PID set: SIGTERM to this process when its parent, the launcher, dies.
    Returns the launcher's pid, or None when this process was not started by one."""
    global _launcher_pid
    value = os.environ.pop(LAUNCHER_PID_ENV, "")
    if not value.isdigit():
        return None
    _launcher_pid = int(value)
    if not _kernel_signals_death():
        threading.Thread(target=_watch_parent, name="launcher-watch", daemon=True).start()
    if os.getppid() != _launcher_pid:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
    return _launcher_pid


def _kernel_signals_death() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent() -> None:
    while os.getppid() == _launcher_pid:
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGTERM)


def stop_reason(signum: int) -> str:
    """What a role stopping on signal `signum` writes as its stop reason: `signal SIGTERM`, and when the
    signal came because its launcher died, that too."""
    reason = f"signal {signal.Signals(signum).name}"
    if _launcher_pid is not None and os.getppid() != _launcher_pid:
        reason += f": its launcher (pid {_launcher_pid}) died"
    return reason
