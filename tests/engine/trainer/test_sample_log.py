"""runs/<name>/samples.jsonl and `tailrace samples` (engine/trainer/sample_log.py): which samples of a step
are written (spread over its groups, bounded), what a line holds, and how the command prints and selects
them. A real run writes it in tests/engine/test_end_to_end.py. Run: pytest tests/engine/trainer/test_sample_log.py
"""

import json

import pytest
import torch

from tailrace.engine.cli import main as cli
from tailrace.engine.core.samples import PromptRecord, TrainSample
from tailrace.engine.trainer import sample_log
from tailrace.engine.trainer.controller import GroupState


def _state(group_id, text, rewards, versions=(0, 0)):
    prompt = PromptRecord(prompt_id=group_id, token_ids=[1, 2], text=text, task="t")
    state = GroupState(group_id=group_id, prompt=prompt, admitted_version=0, group_size=len(rewards))
    for sid, reward in enumerate(rewards):
        n = 2 + sid
        ids = torch.arange(10 * group_id + sid, 10 * group_id + sid + n)
        state.results[sid] = TrainSample(group_id=group_id, sample_id=sid, prompt_ids=torch.tensor([1, 2]),
                                         completion_ids=ids, behaviour_logprobs=torch.full((n,), -1.0),
                                         policy_versions=torch.tensor([versions[0]] * (n - 1) + [versions[1]]),
                                         reward=reward, finish_reason="length" if sid == 1 else "stop")
    return state


def _decode(ids):
    return "-".join(map(str, ids))


def test_a_step_writes_a_bounded_number_of_samples_one_group_after_the_other():
    batch = [_state(7, "p7", [0.0, 1.0, 0.5]), _state(3, "p3", [0.25, 0.25]), _state(9, "p9", [1.0])]
    lines = sample_log.records(5, batch, 4, _decode)
    assert [(r["group_id"], r["sample_id"]) for r in lines] == [(7, 0), (3, 0), (9, 0), (7, 1)]
    first = lines[0]
    assert first == {"step": 5, "group_id": 7, "sample_id": 0, "prompt": "p7", "completion": "70-71", "reward": 0.0,
                     "group_rewards": [0.0, 1.0, 0.5], "policy_versions": [0, 0], "completion_tokens": 2,
                     "finish_reason": "stop"}
    assert lines[3]["finish_reason"] == "length" and lines[3]["completion"] == "71-72-73"
    assert len(sample_log.records(5, batch, 100, _decode)) == 6 and sample_log.records(5, batch, 0, _decode) == []
    stale = sample_log.records(5, [_state(1, "p", [0.0, 0.0], versions=(2, 3))], 1, _decode)
    assert stale[0]["policy_versions"] == [2, 3]


def _run_folder(tmp_path):
    for step in (1, 2, 3):
        batch = [_state(step, f"rev:ab{step}=", [0.0, 1.0]), _state(10 + step, "two\nlines", [0.5, 0.5])]
        sample_log.append(tmp_path, sample_log.records(step, batch, 2, lambda ids: "ba" if ids[0] < 100 else ""))
    with (tmp_path / sample_log.FILE_NAME).open("a") as f:
        f.write('{"step": 4, "grou')  # a line being written
    return tmp_path


def test_tailrace_samples_prints_the_last_step_readably(tmp_path, capsys):
    assert cli(["samples", str(_run_folder(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "step 1" not in out and out.count("step 3  group") == 2
    assert "step 3  group 3  sample 0  reward 0.000  (group: 0 1)  policy v0  2 tokens, stop" in out
    assert "  prompt:     rev:ab3=\n  completion: ba\n" in out
    assert "  prompt:     two\n              lines\n  completion: (empty)" in out  # continuation lines indented


def test_tailrace_samples_selects_steps_and_prints_json(tmp_path, capsys):
    run = str(_run_folder(tmp_path))
    assert cli(["samples", run, "--last", "2", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in lines] == [2, 2, 3, 3] and lines[0]["prompt"] == "rev:ab2="
    assert cli(["samples", run + "/samples.jsonl", "--step", "1", "--json"]) == 0
    assert {json.loads(line)["step"] for line in capsys.readouterr().out.splitlines()} == {1}


@pytest.mark.parametrize("args, text", [
    (["--step", "9"], "no samples for step 9 (it holds steps 1-3)"),
    (["--last", "0"], "--last 0: must be >= 1"),
])
def test_tailrace_samples_errors_are_one_line(tmp_path, capsys, args, text):
    assert cli(["samples", str(_run_folder(tmp_path)), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tailrace samples: error: ") and text in err and len(err.splitlines()) == 1


def test_settings_and_a_folder_without_samples_are_refused(tmp_path, capsys):
    assert cli(["samples", str(tmp_path)]) == 2
    assert "no samples.jsonl there" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["samples", str(_run_folder(tmp_path)), "--train.lr", "1"])
    assert "unrecognized arguments: --train.lr 1" in capsys.readouterr().err
