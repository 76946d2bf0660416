"""Faults benchmark: one `tailrace run` with scripted faults against the same run without them.

    python tools/bench.py faults [--quick] [--json]

The faulty run, in order, each at a random moment (seeded): kill -9 of a generator, kill -9 of the reward
server (the launcher restarts both, --launch.on_child_crash restart), a silent generator that takes work and
never answers (--controller.lease_s small, so its lease runs out), a generator frozen (SIGSTOP) past the dead
verdict and woken (tools/benches/faults_operator.py), kill -9 of the trainer and `--resume`, then a fuzz
burst on the resumed trainer's endpoint while it trains; after it, a run on a full disk (faults_operator,
root only). A kill is survived when training advances past it within its deadline; a wait past its
deadline is a hang. Figures: kills, kills_survived, hangs, samples_lost (handed out - trained - discarded),
samples_trained_twice (trained.jsonl, per prompt; these three over both runs), frozen_generator and
full_disk (their own figures), fuzz_frames, crashes (child crashes not caused here, or a launcher that
failed), max_loop_stall_ms (the trainer's trainer/loop/max_stall_ms over both trainers), rss_growth_mb
(resumed trainer, from before the fuzz burst to the end), wall_s_faults, wall_s_clean and their ratio, and
the machine's load.
Then the launcher's own faults, each on a run of its own (tools/benches/launcher_faults.py): SIGTERM to the
launcher, a second run on its folder, kill -9 of the launcher; figures orphans (processes left: 0),
sigterm_survived, second_run_refused, launcher_kill9_survived, launcher_samples_lost.
Machinery: tools/benches/faultkit.py. Test: pytest -m slow tests/faults/test_kills.py
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tools.benches import faultkit as fk
from tools.benches import faults_operator, launcher_faults

LEASE_S = 4.0  # the silent generator's samples come back after this


def _clean(runs: Path, steps: int, log: Callable[[str], None]) -> float:
    started = time.monotonic()
    run = fk.Run(fk.run_args(runs, "clean", steps=steps), runs / "clean")
    code = run.finish(timeout_s=600)
    assert code == 0, run.output()[-3000:]
    log(f"clean run: {steps} steps in {time.monotonic() - started:.1f} s")
    return time.monotonic() - started


class Faulty:
    """The scripted faults of one run; counts what survived."""

    def __init__(self, runs: Path, steps: int, seed: int, log: Callable[[str], None]):
        self.runs, self.steps, self.log = runs, steps, log
        self.rng = random.Random(seed)
        self.args = fk.run_args(runs, "faults", steps=steps, extra=("--controller.lease_s", str(LEASE_S)))
        self.run_dir = runs / "faults"
        self.figures: dict[str, Any] = {"kills": 0, "kills_survived": 0, "hangs": 0, "crashes": 0, "fuzz_frames": 0}

    def _advance(self, run: fk.Run, what: str, steps: int = 2, timeout_s: float = 120.0) -> bool:
        try:
            run.wait_steps(min(run.steps() + steps, self.steps), timeout_s)
            return True
        except fk.Hang as exc:
            self.figures["hangs"] += 1
            self.log(f"hang after {what}: {exc}")
            return False

    def _kill_child(self, run: fk.Run, name: str) -> None:
        time.sleep(self.rng.uniform(0.0, 2.0))
        pid = run.kill(name)
        self.figures["kills"] += 1
        run.wait_restarted(name, pid)
        if self._advance(run, f"kill -9 {name}"):
            self.figures["kills_survived"] += 1
        self.log(f"kill -9 {name} (pid {pid}): training at step {run.steps()}")

    def _silent_generator(self, run: fk.Run) -> None:
        release = threading.Event()
        thread = fk.hold_work(fk.trainer_address(self.run_dir), "silent", 8, release, timeout_s=120)
        before = run.steps()
        self._advance(run, "a silent generator", steps=3, timeout_s=LEASE_S * 10 + 60)
        release.set()
        thread.join(timeout=30)
        self.log(f"silent generator: steps {before} -> {run.steps()}")

    def first_run(self, watch: fk.TrainerWatch) -> None:
        run = fk.Run(self.args, self.run_dir)
        try:
            run.wait_steps(self.rng.randint(2, 4), 300)
            self._kill_child(run, "gen-0")
            self._kill_child(run, "reward-0")
            self._silent_generator(run)
            self._advance(run, "the silent generator left", steps=self.rng.randint(1, 3))
            self.figures["frozen_generator"] = frozen = faults_operator.frozen_generator(run, "gen-1", self.log)
            self.figures["hangs"] += frozen["hangs"]
            time.sleep(self.rng.uniform(0.0, 1.0))
            run.kill("trainer")
            self.figures["kills"] += 1
            code = run.finish(timeout_s=120)
            assert code != 0, "the launcher should say its trainer died"
            self.figures["crashes"] += max(0, run.output().count("crashed (code") - 2)  # our two kills
        finally:
            run.stop()

    def resumed_run(self, watch: fk.TrainerWatch, fuzz_frames: int) -> None:
        run = fk.Run(self.args, self.run_dir, resume=True)
        try:
            run.wait_steps(run.steps() + 2, 300)
            self.figures["kills_survived"] += 1  # the trainer's kill: resumed and trains again
            trainer = run.child_pid("trainer")
            rss_before = fk.rss_mb(trainer)
            before = run.steps()
            self.figures["fuzz_frames"] = fk.fuzz(fk.trainer_address(self.run_dir), fuzz_frames, self.rng.randint(0, 1 << 30))
            self.log(f"fuzz burst: {self.figures['fuzz_frames']} messages, steps {before} -> {run.steps()}")
            self._advance(run, "the fuzz burst")
            rss_after = rss_before
            while run.proc.poll() is None and (rss := fk.rss_mb(trainer)) is not None:
                rss_after = max(rss_after, rss)
                time.sleep(0.2)
            code = run.finish(timeout_s=600)
            self.figures["crashes"] += (code != 0) + run.output().count("crashed (code")
            self.figures["rss_growth_mb"] = round(rss_after - rss_before, 1) if rss_before else None
        finally:
            run.stop()


def run(quick: bool, log: Callable[[str], None]) -> dict[str, Any]:
    # The faulty run must outlive the scripted faults: a step is ~0.1 s on an idle machine, and the frozen
    # generator alone (15 s past its 10 s dead verdict) lets the other generator train ~150 steps.
    steps = 600 if quick else 1000
    runs = Path(tempfile.mkdtemp(prefix="tailrace-faults-"))
    try:
        wall_clean = _clean(runs, steps, log)
        faulty = Faulty(runs, steps, seed=15, log=log)
        started = time.monotonic()
        with fk.TrainerWatch(runs / "faults") as watch:
            faulty.first_run(watch)
            faulty.resumed_run(watch, fuzz_frames=60 if quick else 200)
        wall_faults = time.monotonic() - started
        counted = fk.accounting(runs / "faults")
        summary = counted["summary"]
        assert summary["steps"] == steps, summary
        disk = faults_operator.full_disk(runs, log)
        launcher = launcher_faults.run(runs, log)
        return {**faulty.figures, **launcher, "full_disk": disk, "hangs": faulty.figures["hangs"] + disk.get("hangs", 0),
                "samples_lost": counted["samples_lost"] + disk.get("samples_lost", 0),
                "samples_trained_twice": counted["samples_trained_twice"] + disk.get("samples_trained_twice", 0),
                "max_loop_stall_ms": round(watch.max_stall_ms, 1), "steps": steps,
                "discarded": summary["discarded"], "wall_s_faults": round(wall_faults, 1),
                "wall_s_clean": round(wall_clean, 1), "ratio": round(wall_faults / wall_clean, 2),
                "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count()}
    finally:
        shutil.rmtree(runs, ignore_errors=True)
