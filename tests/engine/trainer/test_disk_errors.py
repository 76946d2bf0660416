"""A full disk under the run folder (issue 31), with ENOSPC injected where the files are written: a failed
checkpoint leaves no .tmp-step_N and is named in one line; the trainer skips one, stops resumably on the
second in a row, and stops at once when metrics cannot be written; its peers hear the real reason and
summary.json is written. A real full disk (a tmpfs) with real processes: tests/faults/test_operator_faults.py.
Run: pytest tests/engine/trainer/test_disk_errors.py
"""

import asyncio
import errno
import json

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from tailrace.engine.config import load_config
from tailrace.engine.trainer import checkpoint
from tailrace.engine.trainer.service import TrainerService
from tailrace.engine.trainer.writes import WriteFailed, os_error, writing
from tailrace.protocol import messages as m
from tailrace.protocol.transport import Client

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def test_the_oserror_behind_a_dcp_failure_is_found_and_named_with_the_path(tmp_path):
    wrapped = CheckpointException("save failed", {0: (ENOSPC, None)})
    assert os_error(wrapped) is ENOSPC
    assert os_error(RuntimeError("no")) is None
    with pytest.raises(WriteFailed) as failed, writing(tmp_path / "x"):
        raise wrapped
    assert str(failed.value) == f"cannot write {tmp_path / 'x'}: [Errno 28] No space left on device"
    with pytest.raises(ValueError), writing(tmp_path / "x"):  # not a write failure: left alone
        raise ValueError("bad")


def make_service(tmp_path, *overrides, resume=False):
    cfg = load_config(None, ["--train.steps", "10", "--train.groups_per_step", "1", "--sampling.group_size", "2",
                             "--reward.mode", "builtin", "--trainer.bind", "tcp://127.0.0.1:0",
                             "--trainer.runs_dir", str(tmp_path), "--trainer.run_name", "disk",
                             "--checkpoint.every_steps", "2", *overrides])
    return TrainerService(cfg, resume=resume)


def full_disk_at(monkeypatch, steps):
    """ENOSPC from DCP's write of the checkpoints of these steps, after a partial file is written."""
    real = checkpoint._dcp

    def dcp(fn, state, path):
        if fn is checkpoint.dcp.save and int(path.parent.name.rsplit("_", 1)[1]) in steps:
            (path.parent / "partial.bin").write_bytes(b"\0" * 1024)
            raise CheckpointException("save", {0: (ENOSPC, None)})
        return real(fn, state, path)

    monkeypatch.setattr(checkpoint, "_dcp", dcp)


async def generate_until_shutdown(address, service):
    """A generator that answers every sample with a short valid completion, until the trainer's Shutdown."""
    eos = service.tokenizer.eos_token_id
    good = [service.tokenizer.convert_tokens_to_ids(c) for c in "ab"] + [eos]
    async with Client(address, role="generator", name="gen", capabilities={"vocab_size": service.vocab_size}) as gen:
        await asyncio.wait_for(gen.connect(), 10)
        while True:
            await gen.send(m.WorkRequest(capacity=2, policy_version=0))
            msg = await asyncio.wait_for(gen.recv(), 30)
            while not isinstance(msg, m.Work | m.Shutdown):
                msg = await asyncio.wait_for(gen.recv(), 30)
            if isinstance(msg, m.Shutdown):
                return msg.reason
            for item in msg.items:
                v = item.min_policy_version
                for sid in range(item.first_sample_id, item.first_sample_id + item.num_samples):
                    ids = torch.tensor(good, dtype=torch.int32)
                    await gen.send(m.Rollout(group_id=item.group_id, sample_id=sid,
                                             prompt_token_ids=torch.tensor(item.prompt_token_ids, dtype=torch.int32),
                                             completion_token_ids=ids, behaviour_logprobs=torch.full((3,), -0.5),
                                             policy_versions=torch.full((3,), v, dtype=torch.int32),
                                             min_policy_version=v, max_policy_version=v, finish_reason="stop"))
            if msg.exhausted:
                await asyncio.sleep(0.2)


async def run_with_generator(service):
    run = asyncio.create_task(service.run())
    while service.server is None or service.state == "starting":
        await asyncio.sleep(0.02)
    reason = await asyncio.wait_for(generate_until_shutdown(service.server.address, service), 90)
    try:
        return reason, await asyncio.wait_for(run, 60), None
    except WriteFailed as exc:
        return reason, None, exc


@pytest.mark.timeout(180)
async def test_a_checkpoint_that_cannot_be_written_is_skipped_once_and_the_second_stops_the_run_resumably(
        tmp_path, monkeypatch, capfd):
    full_disk_at(monkeypatch, {4, 6})
    service = make_service(tmp_path)
    reason, summary, failed = await run_with_generator(service)
    run_dir = tmp_path / "disk"
    assert failed is not None and summary is None  # run() raises it: `tailrace trainer` exits 1
    lines = [line for line in capfd.readouterr().err.splitlines() if "No space left on device" in line]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"tailrace trainer: cannot write {run_dir}/checkpoint/.tmp-step_000004: [Errno 28]")
    assert "skipped" in lines[0] and "step_000002" in lines[0]
    assert ".tmp-step_000006" in lines[1] and "stopped at step 6, resumable" in lines[1] and "step_000002" in lines[1]
    assert "stopped at step 6" in reason  # the generators hear the real reason, not "run finished"
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == ["latest", "step_000002"]
    written = json.loads((run_dir / "summary.json").read_text())
    assert written["steps"] == 6 and "No space left" in written["stop_reason"]
    assert written["checkpoint"].endswith("latest")
    resumed = make_service(tmp_path, resume=True)
    assert resumed.learner.step_count == 2


@pytest.mark.timeout(180)
async def test_metrics_that_cannot_be_written_stop_the_run_at_once_without_a_final_checkpoint(tmp_path, monkeypatch,
                                                                                               capfd):
    from tailrace.engine.core import metrics

    real = metrics.JsonlSink.log

    def log(self, step, values):
        if step == 3:
            self._file.write = lambda text: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
        return real(self, step, values)

    monkeypatch.setattr(metrics.JsonlSink, "log", log)
    service = make_service(tmp_path)
    reason, _, failed = await run_with_generator(service)
    run_dir = tmp_path / "disk"
    assert failed is not None and failed.path == str(run_dir / "metrics.jsonl")
    lines = [line for line in capfd.readouterr().err.splitlines() if "No space left on device" in line]
    assert lines == [f"tailrace trainer: cannot write {run_dir}/metrics.jsonl: [Errno 28] No space left on device; "
                     "the run stopped at step 3, resumable: --resume continues from checkpoint step_000002 once "
                     "there is room (the steps after it are trained again)"]
    assert "metrics.jsonl" in reason
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == ["latest", "step_000002"]
