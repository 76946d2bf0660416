"""Faults an operator meets every week (issue 31), with real processes over loopback (`tailrace run`):

- a generator frozen (SIGSTOP) past the trainer's dead verdict, then woken (SIGCONT): it rejoins as a new
  session, the run goes on with default launcher settings and finishes with exact accounting;
- a full disk under the run folder (a tmpfs of 40 MiB, room for two checkpoints; root only): each failed
  checkpoint is named in one line and leaves no .tmp-step_N, the second in a row stops the run resumably,
  and once there is room `--resume` finishes it with exact accounting;
- chat rows with a tokenizer that has no chat template: refused at start-up in seconds, in one line naming
  data.chat_template; a bad row met only during admission stops the run in seconds with its message.

Each wait has a deadline (tools/benches/faultkit.py Run.wait); pytest-timeout bounds the rest.
Run: pytest -m slow tests/faults/test_operator_faults.py   (the scripted faults: python tools/bench.py faults)
"""

import json
import time

import pytest

from tools.benches import faultkit as fk


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_generator_frozen_past_the_dead_verdict_rejoins_and_the_run_finishes_exactly(tmp_path, exact_accounting):
    runs = tmp_path / "runs"
    # The launcher's default on_child_crash (stop): a generator that exits on waking stops the run. The dead
    # verdict after 3 missed 1-s heartbeats keeps the test short; the freeze lasts well past it.
    args = fk.run_args(runs, "frozen", steps=2000, extra=("--launch.on_child_crash", "stop",
                                                          "--trainer.missed_heartbeats", "3"))
    run = fk.Run(args, runs / "frozen")
    try:
        run.wait_steps(3, 240)
        frozen = fk.freeze(run, "gen-0", seconds=12.0)
        assert frozen["declared_dead"], frozen
        # Training goes on after the verdict: gen-1 gets the versions by chunks while the broadcast that the
        # frozen member holds waits out its 30 s timeout (trainer/broadcaster.py member_gone).
        assert frozen["steps_while_frozen"] >= 10, frozen  # without it: the 1-3 steps before the group stalls
        log = runs / "frozen" / "logs" / "gen-0.log"
        run.wait("gen-0 rejoining", lambda: "joining as a new session" in log.read_text(), 60)
        trainer_log = runs / "frozen" / "logs" / "trainer.log"
        run.wait("gen-0's second session", lambda: trainer_log.read_text().count("generator 'gen-0' joined") >= 2, 60)
        before = run.steps()
        run.wait_steps(before + 4, 120)  # training goes on with both generators
        assert run.child_pid("gen-0") == frozen["pid"]  # the same process, never restarted
        assert run.stop() == 0, run.output()[-3000:]
    finally:
        run.stop()
    assert "crashed" not in run.output(), run.output()[-3000:]
    summary = exact_accounting(runs / "frozen")
    assert summary["discarded"].get("generator_dead", 0) > 0  # what it held went to gen-1, and trained once


CHECKPOINT_MB = 16  # one checkpoint of the tiny model: model + Adam state (DCP) and model.safetensors


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(not fk.can_mount(), reason="mounting a tmpfs needs root")
def test_a_full_disk_is_named_leaves_no_partial_checkpoint_and_the_run_resumes_exactly(tmp_path, exact_accounting):
    runs = tmp_path / "runs"
    args = [a for a in fk.run_args(runs, "full", steps=12) if a != "--no-progress"]  # the launcher's own line
    with fk.small_disk(runs / "full", 2 * CHECKPOINT_MB + CHECKPOINT_MB // 2) as disk:
        run = fk.Run(args, runs / "full")
        code = run.finish(timeout_s=240)  # steps 2 and 4 fit; 6 fails (skipped), 8 fails (stop)
        out = run.output()
        assert code == 1, out[-3000:]
        named = [line for line in out.splitlines() if line.startswith("tailrace trainer: cannot write ")]
        skipped = f"tailrace trainer: cannot write {runs}/full/checkpoint/.tmp-step_000006: [Errno 28] No space left"
        assert any(line.startswith(skipped) and "skipped" in line for line in named), out[-3000:]
        stopped = [line for line in named if "stopped at step 8, resumable" in line]
        assert stopped and ".tmp-step_000008" in stopped[0] and "checkpoint step_000004" in stopped[0], out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        checkpoints = runs / "full" / "checkpoint"
        assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000002", "step_000004"]
        summary = json.loads((runs / "full" / "summary.json").read_text())
        assert summary["steps"] == 8 and "No space left" in summary["stop_reason"]
        gen_log = (runs / "full" / "logs" / "gen-0.log").read_text()
        assert "No space left" in gen_log and "run finished" not in gen_log  # told the real reason
        disk.grow(1024)  # room again
        resumed = fk.Run(args, runs / "full", resume=True)
        assert resumed.finish(timeout_s=240) == 0, resumed.output()[-3000:]
        assert exact_accounting(runs / "full")["steps"] == 12


def _chat_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


TURNS = [{"role": "user", "content": "reverse abc"}]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_chat_rows_without_a_template_are_refused_at_start_up_in_one_line(tmp_path):
    data = _chat_rows(tmp_path / "chat.jsonl", [{"prompt": TURNS, "answer": "cba"}] * 8)
    runs = tmp_path / "runs"
    started = time.monotonic()
    run = fk.Run(fk.run_args(runs, "chat", steps=4, extra=("--data.source", str(data), "--data.task", "reverse")),
                 runs / "chat")
    code = run.finish(timeout_s=90)  # today: "no progress for 11 s: 0 groups in flight" forever
    out = run.output()
    assert code != 0, out[-3000:]
    named = [line for line in out.splitlines() if "data.chat_template" in line]
    assert len(named) == 1 and "no chat template" in named[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert time.monotonic() - started < 60


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_bad_row_met_during_admission_stops_the_run_with_its_message(tmp_path, exact_accounting):
    """A row that passes the start-up checks (data/checks.py reads the first rows; a usable chat template is
    not run there) but fails when admitted: the template refuses its role. The run stops with the message."""
    rows = [{"prompt": f"reverse {w}", "answer": w[::-1]} for w in ("abc", "bcd", "cde", "def")]
    rows.append({"prompt": [{"role": "tool", "content": "abc"}], "answer": "cba"})
    data = _chat_rows(tmp_path / "rows.jsonl", rows + rows[:4] * 4)
    template = tmp_path / "no_tools.jinja"
    template.write_text("{% for m in messages %}{% if m['role'] == 'tool' %}"
                        "{{ raise_exception('tool turns are not supported') }}{% endif %}{{ m['content'] }}\n"
                        "{% endfor %}")
    runs = tmp_path / "runs"
    run = fk.Run(fk.run_args(runs, "bad", steps=50, extra=("--data.source", str(data), "--data.task", "reverse",
                                                           "--data.chat_template", str(template),
                                                           "--launch.num_generators", "1")), runs / "bad")
    code = run.finish(timeout_s=150)  # today: the net loop dies with it, and the run waits forever
    out = run.output()
    assert code != 0, out[-3000:]
    assert "data: row 4: the chat template cannot render it: tool turns are not supported" in out, out[-3000:]
    summary = json.loads((runs / "bad" / "summary.json").read_text())
    assert "row 4" in summary["stop_reason"]
    gen_log = (runs / "bad" / "logs" / "gen-0.log").read_text()
    assert "row 4" in gen_log and "run finished" not in gen_log  # told the real reason
    exact_accounting(runs / "bad")
