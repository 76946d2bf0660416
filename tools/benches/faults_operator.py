"""The faults benchmark's operator faults (issue 31), beside the kills of tools/benches/faults.py:

    frozen_generator   SIGSTOP of a generator past the trainer's dead verdict (default settings: 10 s), then
                       SIGCONT, inside the faulty run: it must rejoin as a new session (the same process, no
                       restart) and training must go on
    full_disk          a run on a tmpfs with room for two checkpoints (mounted and unmounted here; root
                       only): each failed write named in one line, no partial checkpoint left, the run
                       stopped resumably; the tmpfs grown, `--resume` finishes it with exact accounting

Machinery: tools/benches/faultkit.py. Test: pytest -m slow tests/faults/test_operator_faults.py
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.benches import faultkit as fk

DEAD_VERDICT_S = 10.0  # trainer.heartbeat_interval_s x trainer.missed_heartbeats, their defaults
CHECKPOINT_MB = 16  # one checkpoint of the tiny model (DCP model + Adam state, and model.safetensors)


def frozen_generator(run: fk.Run, name: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Freeze `name` past the dead verdict and see it come back. A wait past its deadline is a hang."""
    frozen = fk.freeze(run, name, seconds=DEAD_VERDICT_S + 5.0)
    gen_log = run.run_dir / "logs" / f"{name}.log"
    figures = {"declared_dead": frozen["declared_dead"], "rejoined": False, "restarted": False, "hangs": 0,
               "steps_while_frozen": frozen["steps_while_frozen"]}
    try:
        run.wait(f"{name} rejoining", lambda: "joining as a new session" in gen_log.read_text(errors="replace"), 60)
        figures["rejoined"] = True
        run.wait_steps(run.steps() + 2, 120)
    except fk.Hang as exc:
        figures["hangs"] += 1
        log(f"hang after freezing {name}: {exc}")
    figures["restarted"] = run.child_pid(name) != frozen["pid"]
    log(f"frozen {name} for {DEAD_VERDICT_S + 5:.0f} s: {figures}")
    return figures


def full_disk(runs: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """A run whose folder fills up, then resumed once there is room."""
    if not fk.can_mount():
        return {"skipped": "mounting a tmpfs needs root"}
    args = [a for a in fk.run_args(runs, "full", steps=12) if a != "--no-progress"]
    run_dir = runs / "full"
    figures: dict[str, Any] = {"hangs": 0}
    started = time.monotonic()
    with fk.small_disk(run_dir, 2 * CHECKPOINT_MB + CHECKPOINT_MB // 2) as disk:
        try:
            run = fk.Run(args, run_dir)
            figures["stop_code"] = run.finish(timeout_s=300)
            out = run.output()
            named = [line for line in out.splitlines()
                     if line.startswith("tailrace trainer: cannot write ") and "No space left on device" in line]
            figures["lines_naming_the_path"] = len(named)
            figures["stopped_resumably"] = any("resumable" in line for line in named)
            figures["tracebacks"] = out.count("Traceback")
            figures["partial_checkpoints_left"] = len(list((run_dir / "checkpoint").glob(".tmp-*")))
            disk.grow(1024)
            resumed = fk.Run(args, run_dir, resume=True)
            figures["resumed_code"] = resumed.finish(timeout_s=300)
            counted = fk.accounting(run_dir)
            figures |= {"samples_lost": counted["samples_lost"], "samples_trained_twice": counted["samples_trained_twice"],
                        "steps": counted["summary"]["steps"]}
        except fk.Hang as exc:
            figures["hangs"] += 1
            log(f"hang on a full disk: {exc}")
    figures["wall_s"] = round(time.monotonic() - started, 1)
    log(f"full disk: {figures}")
    return figures
