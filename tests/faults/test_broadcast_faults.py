"""Weights by broadcast under faults, with real processes (`tailrace run`, two torch-backend generators):
a generator frozen (SIGSTOP) in the weight group and then killed with -9 never hangs the trainer: its
broadcast fails within trainer.weights_broadcast_timeout_s, training goes on meanwhile, the group re-forms
without it (and with its restarted successor), and the run finishes with exact accounting.
Each wait has its own deadline (tools/benches/faultkit.py Run.wait); pytest-timeout bounds the rest.

Run: pytest -m slow tests/faults/test_broadcast_faults.py
"""

import os
import signal

import pytest

from tools.benches import faultkit as fk

TIMEOUT_S = 3.0  # trainer.weights_broadcast_timeout_s: how long a frozen member may hold a broadcast


def _log(run_dir, name):
    path = run_dir / "logs" / f"{name}.log"
    return path.read_text(errors="replace") if path.is_file() else ""


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_generator_frozen_then_killed_mid_broadcast_never_hangs_the_trainer(tmp_path):
    runs = tmp_path / "runs"
    steps = 100  # long enough that the run outlives the frozen member's failed broadcast on an idle machine too
    args = fk.run_args(runs, "bc", steps=steps, extra=(
        "--trainer.weights_broadcast_timeout_s", str(TIMEOUT_S), "--trainer.heartbeat_interval_s", "0.5",
        "--trainer.missed_heartbeats", "80", "--controller.lease_s", "20"))  # frozen: still a member for 40 s
    run = fk.Run(args, runs / "bc")
    try:
        run.wait_steps(3, 240)  # versions 1..3 published: the group formed
        frozen = run.wait("gen-1 running", lambda: run.child_pid("gen-1"), 60)
        os.kill(frozen, signal.SIGSTOP)
        at_freeze = run.steps()
        # The trainer's next broadcast (or its join) meets the frozen member and fails within its timeout.
        run.wait("the trainer to give up on the frozen member",
                 lambda: "by broadcast failed" in _log(runs / "bc", "trainer")
                 or "did not join" in _log(runs / "bc", "trainer"), 120)
        run.wait("a step while gen-1 is frozen", lambda: run.steps() > at_freeze, 120)
        os.kill(frozen, signal.SIGKILL)  # mid-broadcast from the group's view: it never answered
        run.wait_restarted("gen-1", frozen)
        assert run.finish(timeout_s=300) == 0, run.output()[-3000:]
    finally:
        run.stop()
    counted = fk.accounting(runs / "bc")
    summary = counted["summary"]
    assert counted["samples_lost"] == 0 and counted["samples_trained_twice"] == 0, summary
    assert summary["steps"] == steps
    bc = summary["weights_broadcast"]
    assert bc.get("broadcast_failed", 0) >= 1 and bc.get("broadcasts", 0) >= 2, bc
    # The restarted gen-1 and gen-0 took versions by broadcast after the fault.
    # gen-0's own receive failed with the frozen member's group: it stays a member (not served by chunks
    # from then on), so it takes versions by broadcast after the fault too.
    assert summary["weights_by_generator"]["gen-0"]["by_broadcast"] > at_freeze + 2, summary["weights_by_generator"]
    assert summary["weights_by_generator"]["gen-1"]["by_broadcast"] >= 1, summary["weights_by_generator"]
