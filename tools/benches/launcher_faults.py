"""The faults an operator deals to `tailrace run` itself, for `python tools/bench.py faults`
(tools/benches/faults.py): each on a run of its own, with real processes.

    SIGTERM        to the launcher while it trains (what kill, timeout, Slurm and systemd send), with a
                   second `tailrace run` on the same folder started first: the second is refused (exit 2
                   within SECOND_RUN_S, naming the first run's pid); the first stops with a checkpoint of
                   its last step, stop_reason "signal SIGTERM", exit 0, exact accounting
    kill -9        of the launcher while it trains: its children stop by themselves (engine/core/lifeline.py),
                   the trainer with a checkpoint and stop_reason naming the dead launcher

Figures: orphans (processes of either launcher's tree still running ORPHAN_WAIT_S after it ended),
sigterm_survived, launcher_kill9_survived, second_run_refused, and the samples lost in these runs.
Test: pytest -m slow tests/engine/test_launch_faults.py
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.benches import faultkit as fk

ORPHAN_WAIT_S = 30.0
SECOND_RUN_S = 30.0


def _orphans(tree: dict[int, str]) -> int:
    deadline = time.monotonic() + ORPHAN_WAIT_S
    while fk.alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    return len(fk.alive(tree))


def _stopped_with_checkpoint(run_dir: Path, reason: str) -> tuple[bool, int]:
    """(stop_reason is `reason` and the checkpoint holds the last step, samples lost)."""
    try:
        counted = fk.accounting(run_dir)
    except (OSError, ValueError, KeyError):
        return False, 0
    summary = counted["summary"]
    checkpointed = (run_dir / "checkpoint" / f"step_{summary['steps']:06d}" / "trainer_state.json").is_file()
    return summary["stop_reason"] == reason and checkpointed, counted["samples_lost"]


def _training(runs: Path, name: str) -> tuple[fk.Run, dict[int, str]]:
    run = fk.Run(fk.run_args(runs, name, steps=100000), runs / name)
    run.wait_steps(3, 300)
    tree = run.wait("the trainer, generators and reward server", lambda: len(t := fk.process_tree(run.proc.pid)) >= 4
                    and t, 60)
    return run, tree


def _sigterm(runs: Path, log: Callable[[str], None]) -> dict[str, Any]:
    run, tree = _training(runs, "term")
    try:
        started = time.monotonic()
        second = fk.Run(fk.run_args(runs, "term", steps=5), runs / "term")
        code = second.finish(timeout_s=SECOND_RUN_S)
        refused = code == 2 and f"(pid {run.proc.pid} on " in second.output()
        log(f"second run on the folder: exit {code} in {time.monotonic() - started:.1f} s: "
            f"{second.output().strip()[-300:]}")
        run.proc.send_signal(signal.SIGTERM)
        code = run.finish(timeout_s=120)
    finally:
        run.stop()
    orphans = _orphans(tree)
    survived, lost = _stopped_with_checkpoint(runs / "term", "signal SIGTERM")
    log(f"SIGTERM to the launcher: exit {code}, {orphans} of {len(tree)} processes left, checkpoint: {survived}")
    return {"orphans": orphans, "sigterm_survived": survived and code == 0 and orphans == 0,
            "second_run_refused": refused, "samples_lost": lost}


def _kill9(runs: Path, log: Callable[[str], None]) -> dict[str, Any]:
    run, tree = _training(runs, "kill9")
    try:
        run.proc.kill()
        run.proc.wait()
        orphans = _orphans(tree)
    finally:
        for pid in fk.alive(tree):  # a failed stop: nothing of ours keeps running
            os.kill(pid, signal.SIGKILL)
    reason = f"signal SIGTERM: its launcher (pid {run.proc.pid}) died"
    survived, lost = _stopped_with_checkpoint(runs / "kill9", reason)
    log(f"kill -9 of the launcher: {orphans} of {len(tree)} processes left, checkpoint: {survived}; "
        f"{json.dumps(reason)}")
    return {"orphans": orphans, "launcher_kill9_survived": survived and orphans == 0, "samples_lost": lost}


def run(runs: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """The figures of both faults, orphans and samples lost summed over them."""
    term, kill9 = _sigterm(runs, log), _kill9(runs, log)
    return {"orphans": term["orphans"] + kill9["orphans"], "sigterm_survived": term["sigterm_survived"],
            "second_run_refused": term["second_run_refused"],
            "launcher_kill9_survived": kill9["launcher_kill9_survived"],
            "launcher_samples_lost": term["samples_lost"] + kill9["samples_lost"]}
