"""tools/top.py's text view: one line per process, trainer first, speculation shown where it runs.

Run: pytest tests/test_top.py   (the live snapshot over the protocol: tests/engine/test_end_to_end.py)
"""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("top", Path(__file__).resolve().parents[1] / "tools" / "top.py")
top = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(top)


def test_render_lists_processes_with_their_highlights():
    plain = {"generator/queue/running": 3, "generator/queue/waiting": 1, "generator/throughput/wall_tokens_per_s": 812}
    spec = {**plain, "generator/spec/spec_steps": 40, "generator/spec/mean_accept_len": 3.25,
            "generator/spec/accept_rate": 0.81, "generator/spec/drafter_version": 2}
    trainer = {"trainer/step": 4, "trainer/steps_total": 150, "trainer/reward/last": 0.5}
    snapshot = {"run_id": "r", "address": "tcp://127.0.0.1:1", "processes": {
        "gen-b": {"role": "generator", "state": "generating", "policy_version": 4, "wall_s": 1.0, "counters": spec},
        "gen-a": {"role": "generator", "state": "idle", "policy_version": 3, "wall_s": 1.0, "counters": plain},
        "trainer": {"role": "trainer", "state": "training", "policy_version": 4, "wall_s": 1.0, "counters": trainer}}}
    lines = top.render(snapshot).splitlines()
    assert lines[0] == "run r at tcp://127.0.0.1:1"
    assert [line.split()[0] for line in lines[2:]] == ["trainer", "gen-a", "gen-b"]
    assert "step 4/150" in lines[2] and "reward 0.500" in lines[2]
    assert "812 tok/s" in lines[3] and "spec" not in lines[3]
    assert "spec: 3.25 drafts accepted/step (81%), drafter v2" in lines[4]
