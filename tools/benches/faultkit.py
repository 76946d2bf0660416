"""Fault injection against real tailrace processes over loopback, shared by `python tools/bench.py faults`
(tools/benches/faults.py) and the fault suite (tests/faults/).

    Run            one `tailrace run` subprocess: its children by pid, steps from metrics.jsonl, waits with
                   a deadline and a reason (Hang), kill -9 of one child, a stop that leaves nothing behind
    process_tree   every process descended from a pid; alive(): which of some pids still run (orphans)
    freeze         SIGSTOP of one child for a while, then SIGCONT
    small_disk     a tmpfs of a few MiB mounted under the run folder (a full disk), grown later (root only)
    TrainerWatch   a thread with a tool connection on the trainer's notice socket (reconnects when the
                   trainer restarts): the largest trainer/loop/max_stall_ms any trainer reported
    hold_work      a silent generator: says Hello, takes work, heartbeats, never answers (leases reclaim it)
    fuzz           random, truncated, oversized frames and MessagePack bombs on a live endpoint, before
                   and after a handshake (tools/benches/fuzzframes.py builds them)
    accounting     what a finished run's summary.json and trained.jsonl say: samples lost, trained twice

Processes are stopped only by the pids this module started (or their launcher's children).
Test: pytest tests/faults/
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


class Hang(AssertionError):
    """A wait ran past its deadline: the reason says what did not happen."""


def child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_args(runs_dir: Path, name: str, *, steps: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The `tailrace run` command line the fault runs share: small groups, short completions, checkpoints
    every 2 steps, restarts on a child crash."""
    return [sys.executable, "-m", "tailrace.engine.cli", "run", "--trainer.runs_dir", str(runs_dir),
            "--trainer.run_name", name, "--train.steps", str(steps), "--train.groups_per_step", "2",
            "--sampling.group_size", "4", "--sampling.max_new_tokens", "24", "--launch.num_generators", "2",
            "--launch.on_child_crash", "restart", "--checkpoint.every_steps", "2",
            "--checkpoint.keep", "50", "--trainer.stats_interval_s", "0.3", "--no-progress", *extra]


class Run:
    """One `tailrace run` subprocess. Its output goes to runs_dir/<name>.launcher-<n>.log."""

    def __init__(self, argv: list[str], run_dir: Path, *, resume: bool = False):
        self.run_dir = run_dir
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        n = len(list(run_dir.parent.glob(f"{run_dir.name}.launcher-*.log")))
        self.log_path = run_dir.parent / f"{run_dir.name}.launcher-{n}.log"
        self.started_s = time.monotonic()
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(argv + (["--resume"] if resume else []), cwd=run_dir.parent,
                                         env=child_env(), stdout=log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> dict[int, str]:
        """pid -> command line of each running child of the launcher."""
        out = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
        found = {}
        for line in out.splitlines()[1:]:
            pid, ppid, args = (line.split(None, 2) + [""])[:3]
            if int(ppid) == self.proc.pid:
                found[int(pid)] = args
        return found

    def child_pid(self, name: str) -> int | None:
        """The pid of the running child `name`: "trainer", or one started with `--name NAME`."""
        for pid, args in self.children().items():
            if (name == "trainer" and " trainer " in args) or f"--name {name} " in args + " ":
                return pid
        return None

    def steps(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.is_file() else 0

    def wait(self, what: str, predicate: Callable[[], Any], timeout_s: float, *, while_running: bool = True) -> Any:
        """predicate()'s first truthy value, polled every 0.1 s; Hang after timeout_s, or when the run ended
        (while_running)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = predicate()
            if value:
                return value
            if while_running and self.proc.poll() is not None:
                raise Hang(f"the run ended (code {self.proc.returncode}) while waiting for {what}")
            if time.monotonic() > deadline:
                raise Hang(f"no {what} within {timeout_s:.0f} s")
            time.sleep(0.1)

    def wait_steps(self, steps: int, timeout_s: float) -> None:
        self.wait(f"step {steps} (at {self.steps()})", lambda: self.steps() >= steps, timeout_s)

    def kill(self, name: str, timeout_s: float = 120.0) -> int:
        """kill -9 of the child `name` once it runs; returns its pid."""
        pid = self.wait(f"a running {name}", lambda: self.child_pid(name), timeout_s)
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_restarted(self, name: str, old_pid: int, timeout_s: float = 60.0) -> int:
        return self.wait(f"{name} restarted", lambda: (p := self.child_pid(name)) not in (None, old_pid) and p,
                         timeout_s)

    def finish(self, timeout_s: float) -> int:
        """The launcher's exit code once it ends by itself; Hang (after stopping it) past timeout_s."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise Hang(f"the run did not end within {timeout_s:.0f} s") from None

    def stop(self, grace_s: float = 60.0) -> int:
        """SIGINT (what Ctrl-C does), then kill -9 of the launcher's children and the launcher by pid."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                for pid in self.children():
                    os.kill(pid, signal.SIGKILL)
                self.proc.kill()
        return self.proc.wait()


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name: [state, ppid, ...]; None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_tree(root: int) -> dict[int, str]:
    """Every process descended from `root` now: pid -> its start time (so that a pid used again later by
    another process does not count as one of these)."""
    out = subprocess.run(["ps", "-eo", "pid,ppid"], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = collections.defaultdict(list)
    for line in out.splitlines()[1:]:
        pid, ppid = map(int, line.split())
        children[ppid].append(pid)
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for pid in children[todo.pop()]:
            if (fields := _stat(pid)) is not None:
                found[pid] = fields[19]  # starttime, field 22 of stat
            todo.append(pid)
    return found


def alive(tree: dict[int, str]) -> set[int]:
    """The processes of a process_tree() that still run (a zombie waiting for its parent does not)."""
    return {pid for pid, started in tree.items()
            if (fields := _stat(pid)) is not None and fields[0] != "Z" and fields[19] == started}


def freeze(run: Run, name: str, seconds: float) -> dict[str, Any]:
    """SIGSTOP of the child `name` for `seconds`, then SIGCONT (a process frozen by a debugger, swapped out,
    or starved). Returns its pid, the steps trained meanwhile and whether the trainer declared it dead."""
    pid = run.wait(f"a running {name}", lambda: run.child_pid(name), 120)
    trainer_log = run.run_dir / "logs" / "trainer.log"
    # A peer of the trainer, not a process still starting (frozen before its Hello, it is no one's to judge).
    run.wait(f"{name} joined", lambda: f"generator {name!r} joined" in trainer_log.read_text(errors="replace"), 120)
    run.wait_steps(run.steps() + 3, 120)  # versions published since: a member of the weights broadcast group
    before = run.steps()
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    log = trainer_log.read_text(errors="replace")
    return {"pid": pid, "steps_while_frozen": run.steps() - before, "declared_dead": f"generator {name!r} dead" in log}


def can_mount() -> bool:
    """Whether small_disk can mount a tmpfs here (root, and mount(8) permitted)."""
    return os.geteuid() == 0 and subprocess.run(["mount", "--version"], capture_output=True).returncode == 0


class small_disk:  # noqa: N801 (a context manager, used as a verb)
    """`with small_disk(path, size_mb):` a tmpfs of size_mb mounted at path (created), unmounted after;
    grow(size_mb) resizes it in place (what freeing space does). Needs root (can_mount)."""

    def __init__(self, path: Path, size_mb: int):
        self.path, self.size_mb = path, size_mb

    def __enter__(self) -> small_disk:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size_mb}m", "tmpfs", str(self.path)], check=True)
        return self

    def grow(self, size_mb: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size_mb}m", str(self.path)], check=True)

    def __exit__(self, *exc: Any) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of a process in MiB, None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, TypeError, ValueError):
        return None
    return None


class TrainerWatch:
    """Reads the trainer's Stats from its notice socket in a thread of its own, following restarts (a new
    endpoint.json). `max_stall_ms`: the largest trainer/loop/max_stall_ms seen; `latest`: last counters."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.max_stall_ms = 0.0
        self.latest: dict[str, float] = {}
        self.events: collections.Counter[str] = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._follow()), name="trainer-watch",
                                        daemon=True)

    def __enter__(self) -> TrainerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _address(self) -> str | None:
        try:
            return json.loads((self.run_dir / "endpoint.json").read_text())["address"]
        except (OSError, ValueError, KeyError):
            return None

    async def _follow(self) -> None:
        from tailrace.protocol.transport import ConnectionLost, TransportError

        while not self._stop.is_set():
            address = self._address()
            if address is None:
                await asyncio.sleep(0.2)
                continue
            try:
                await self._read(address)
            except (ConnectionLost, TransportError, TimeoutError, OSError):
                await asyncio.sleep(0.2)  # the trainer went away; the next one writes a new endpoint.json

    async def _read(self, address: str) -> None:
        from tailrace.protocol import messages as m
        from tailrace.protocol.transport import Client

        async with Client(address, role="tool", name=f"fault-watch-{os.getpid()}") as client:
            await client.connect(timeout_s=5.0)
            await client.subscribe()
            while not self._stop.is_set() and self._address() == address:
                try:
                    msg = await asyncio.wait_for(client.recv_notice(), timeout=0.5)
                except TimeoutError:
                    continue
                if isinstance(msg, m.Event):
                    self.events[msg.event] += 1
                elif isinstance(msg, m.Stats) and msg.role == "trainer":
                    self.latest = dict(msg.counters)
                    self.max_stall_ms = max(self.max_stall_ms, msg.counters.get("trainer/loop/max_stall_ms", 0.0))


def trainer_address(run_dir: Path) -> str:
    return json.loads((run_dir / "endpoint.json").read_text())["address"]


def hold_work(address: str, name: str, capacity: int, release: threading.Event, timeout_s: float) -> threading.Thread:
    """A silent generator in a thread: Hello, one WorkRequest, then heartbeats only until `release` (or
    timeout_s). Its samples come back only by their lease running out."""

    async def silent() -> None:
        from tailrace.protocol import messages as m
        from tailrace.protocol.transport import Client

        async with Client(address, role="generator", name=name, max_inflight=capacity) as gen:
            await gen.connect(timeout_s=10.0)
            await gen.send(m.WorkRequest(capacity=capacity, policy_version=0))
            deadline = time.monotonic() + timeout_s
            while not release.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.2)

    thread = threading.Thread(target=lambda: asyncio.run(silent()), name=f"silent-{name}", daemon=True)
    thread.start()
    return thread


def fuzz(address: str, num_frames: int, seed: int) -> int:
    """Send about num_frames hostile messages to `address`; returns how many were sent."""
    from tools.benches.fuzzframes import burst

    return burst(address, num_frames, seed)


def accounting(run_dir: Path) -> dict[str, Any]:
    """samples_lost (handed out - trained - discarded) and samples_trained_twice (samples of a prompt
    trained again after the prompt's group was trained: a prompt id seen in two groups, or a sample id
    twice in one group, over the steps trained.jsonl keeps) of a finished run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    lost = summary["samples_handed_out"] - summary["samples_trained"] - sum(summary["discarded"].values())
    from tailrace.engine.trainer import trained_log

    first_group: dict[int, int] = {}  # prompt id -> the group that trained it first
    seen: set[tuple[int, int]] = set()
    twice = 0
    for line in trained_log.read(run_dir):
        for group_id, prompt_id, sample_id in line["samples"]:
            again = (group_id, sample_id) in seen or first_group.setdefault(prompt_id, group_id) != group_id
            twice += again
            seen.add((group_id, sample_id))
    return {"summary": summary, "samples_lost": lost, "samples_trained_twice": twice,
            "samples_trained_logged": len(seen)}
