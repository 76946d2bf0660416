"""Nothing lost or trained twice, checked where a plausible bug would break it (issue 15 §11): a dead
generator's samples go to another generator at once (not after their lease), a discarded sample is never
counted as trained, and a resumed trainer continues at the checkpoint's data position, not at prompt 0.
The trainer service runs in-process against fake generators over loopback. Run: pytest tests/faults/test_accounting.py
"""

import asyncio

import pytest

from tailrace.engine.config import load_config
from tailrace.engine.core.samples import PromptRecord, TrainSample
from tailrace.engine.trainer import trained_log
from tailrace.engine.trainer.controller import Controller
from tailrace.engine.trainer.service import TrainerService
from tailrace.protocol import messages as m
from tailrace.protocol.transport import Client


def _service(tmp_path, *overrides, resume=False):
    cfg = load_config(None, ["--train.steps", "1000", "--train.groups_per_step", "1", "--sampling.group_size", "4",
                             "--reward.mode", "builtin", "--trainer.bind", "tcp://127.0.0.1:0",
                             "--trainer.runs_dir", str(tmp_path), "--trainer.run_name", "acc", *overrides])
    return TrainerService(cfg, resume=resume)


async def _started(service):
    while service.server is None or service.state == "starting":
        await asyncio.sleep(0.02)
    return service.server.address


async def _take_work(address, name, capacity):
    gen = Client(address, role="generator", name=name, max_inflight=capacity)
    await asyncio.wait_for(gen.connect(), 10)
    await gen.send(m.WorkRequest(capacity=capacity, policy_version=0))
    work = await asyncio.wait_for(gen.recv(), 10)
    assert isinstance(work, m.Work)
    return gen, work


@pytest.mark.timeout(120)
async def test_a_dead_generators_samples_go_to_another_generator_at_once(tmp_path):
    service = _service(tmp_path)  # derived lease: at least 30 s, so only the death can free the samples
    run = asyncio.create_task(service.run())
    try:
        address = await _started(service)
        first, work = await _take_work(address, "doomed", 4)
        taken = {(i.group_id, i.first_sample_id, i.num_samples) for i in work.items}
        await first.close()  # says Shutdown: the trainer sees the generator leave
        second, work = await _take_work(address, "heir", 4)
        assert {(i.group_id, i.first_sample_id, i.num_samples) for i in work.items} == taken
        assert service.controller.discarded["generator_dead"] == 4
        await second.close()
    finally:
        service.request_stop("test over")
        await asyncio.wait_for(run, 60)


def _sample(group_id, sample_id):
    return TrainSample(group_id=group_id, sample_id=sample_id, prompt_ids=[1, 2], completion_ids=[3],
                       behaviour_logprobs=[-0.5], policy_versions=[0], reward=1.0)


def test_a_discarded_sample_is_counted_as_discarded_not_trained():
    prompts = iter([PromptRecord(i, [1, 2], "p", "math") for i in range(10)])
    ctrl = Controller(prompts, group_size=4, groups_per_step=1, max_staleness=1)
    (_, rng, _), = ctrl.request_work("gen", 4).items
    ctrl.on_received(rng.group_id, 0)
    ctrl.on_discard(rng.group_id, 0, "bad_rollout")
    for sid in (1, 2, 3):
        ctrl.on_received(rng.group_id, sid)
        ctrl.on_scored(rng.group_id, sid, _sample(rng.group_id, sid))
    batch = ctrl.pop_batch()
    ctrl.on_trained(batch, 0)
    assert (ctrl.samples_handed_out, ctrl.samples_trained, dict(ctrl.discarded)) == (4, 3, {"bad_rollout": 1})
    ctrl.check_accounting()


@pytest.mark.timeout(120)
def test_a_resumed_trainer_continues_at_the_checkpoints_data_position(tmp_path):
    service = _service(tmp_path, "--controller.max_staleness", "5")  # room for six groups in flight
    for _ in range(5):  # admit (consume) five prompts, as handing out work does
        assert service.controller.request_work("gen", 4) is not None
    consumed = service.source.position
    assert consumed == 5
    service.save_checkpoint()
    resumed = _service(tmp_path, "--controller.max_staleness", "5", resume=True)
    assert resumed.source.position == consumed
    ids = [p.prompt_id for p, _, _ in resumed.controller.request_work("gen", 4 * 6).items]
    assert ids == [0, 1, 2, 3, 4, consumed]  # the five untrained groups again first, then new prompts
    assert trained_log.read(tmp_path / "acc") == []
