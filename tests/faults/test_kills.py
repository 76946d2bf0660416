"""kill -9 of every role at random moments, SIGINT + resume, and a fuzz burst on the live endpoint, with
real processes over loopback (`tailrace run --launch.on_child_crash restart`). The run always finishes with
samples_handed_out == samples_trained + sum(discarded) and no prompt trained twice (trained.jsonl).
Each wait has its own deadline (tools/benches/faultkit.py Run.wait); pytest-timeout bounds the rest.

Run: pytest -m slow tests/faults/test_kills.py   (the scripted faults: python tools/bench.py faults)
"""

import random

import pytest

from tools.benches import faultkit as fk
from tools.benches.faults import Faulty


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_kill_9_of_each_role_at_random_moments_then_resume(tmp_path, exact_accounting):
    # Enough steps that the run outlives the scripted faults on an idle machine (a step takes ~0.1 s).
    steps = 300
    faulty = Faulty(tmp_path / "runs", steps=steps, seed=random.randrange(1 << 30), log=print)
    with fk.TrainerWatch(faulty.run_dir) as watch:
        faulty.first_run(watch)
        faulty.resumed_run(watch, fuzz_frames=40)
    figures = faulty.figures
    assert figures["kills_survived"] == figures["kills"] == 3 and figures["hangs"] == figures["crashes"] == 0, figures
    summary = exact_accounting(faulty.run_dir)
    assert summary["steps"] == steps
    # The silent generator's samples came back: by its lease running out, or (when the script's random
    # timing lets it leave first) as a dead generator's; either way re-dispatched and trained once (exact_accounting).
    assert summary["discarded"].get("lease_expired", 0) + summary["discarded"].get("generator_dead", 0) > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigint_then_resume_trains_every_prompt_once(tmp_path, exact_accounting):
    runs = tmp_path / "runs"
    args = fk.run_args(runs, "int", steps=16)
    run = fk.Run(args, runs / "int")
    try:
        run.wait_steps(random.randint(3, 7), 240)
        assert run.stop() == 0, run.output()[-3000:]  # SIGINT: checkpoint, Shutdown to every peer
    finally:
        run.stop()
    resumed = fk.Run(args, runs / "int", resume=True)
    assert resumed.finish(timeout_s=240) == 0, resumed.output()[-3000:]
    assert exact_accounting(runs / "int")["steps"] == 16


@pytest.mark.timeout(200)
def test_a_fuzz_burst_on_the_live_trainer_while_it_trains(tmp_path, exact_accounting):
    runs = tmp_path / "runs"
    run = fk.Run(fk.run_args(runs, "fuzz", steps=1000, extra=("--launch.num_generators", "1")), runs / "fuzz")
    try:
        run.wait_steps(2, 150)
        before = run.steps()
        sent = fk.fuzz(fk.trainer_address(run.run_dir), 60, seed=random.randrange(1 << 30))
        run.wait_steps(before + 3, 60)  # training went on during and after the burst
        assert sent == 60
        assert run.stop() == 0, run.output()[-3000:]
    finally:
        run.stop()
    assert "crashed" not in run.output()
    exact_accounting(run.run_dir)
