"""Drafter sharing, generator -> trainer -> generators (protocol/SPEC.md, "Drafter sharing"): the trainer
in-process fetches an announced drafter from a fake generator and republishes it to another, which
fetches the same tensors; uploads that are not the next version or not a drafter for the trainer's policy
(names, shapes, dtypes, sizes) are refused and counted, never served or checkpointed, and with
trainer.accept_drafters false none is taken; the generator's side (announce, serve, fetch, adopt between
steps) runs on a bare GeneratorService with fakes.

Run: pytest tests/engine/test_drafter_sharing.py
"""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from tailrace.engine.config import load_config
from tailrace.engine.core.drafter import Drafter
from tailrace.engine.core.weights import WeightsAssembler, WeightsStore
from tailrace.engine.generator import service as gen_service
from tailrace.engine.generator.service import GeneratorService
from tailrace.engine.generator.speculation.drafter_training import SpotTrainer
from tailrace.engine.trainer.drafters import DRAFTER_FILE
from tailrace.engine.trainer.service import TrainerService
from tailrace.protocol import messages as m
from tailrace.protocol.transport import Client


def make_service(tmp_path, resume: bool = False, *overrides: str):
    cfg = load_config(None, ["--train.steps", "1", "--train.groups_per_step", "1", "--sampling.group_size", "4",
                             "--reward.mode", "builtin", "--trainer.bind", "tcp://127.0.0.1:0",
                             "--trainer.runs_dir", str(tmp_path), "--trainer.run_name", "drafters",
                             "--trainer.heartbeat_interval_s", "0.2", *overrides])
    return TrainerService(cfg, resume=resume)


async def wait_bound(service):
    while service.server is None or not service.server.address.rpartition(":")[2].isdigit():
        await asyncio.sleep(0.02)
    return service.server.address


def drafter_state(service, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """A drafter for the service's policy (the layout it derives), every element `scale`."""
    return {k: torch.full(v.shape, scale, dtype=v.dtype) for k, v in service.drafters.reference.items()}


async def recv_kind(client, kind, timeout_s: float = 10.0):
    while True:
        msg = await asyncio.wait_for(client.recv(), timeout_s)
        if isinstance(msg, kind):
            return msg


async def serve_upload(gen, store: WeightsStore, version: int) -> None:
    """Announce `version` of the drafter in `store` and answer the trainer's fetches until none remain."""
    notice = store.latest("drafter")
    assert notice.version == version
    await gen.send(notice)
    for _ in range(notice.num_chunks):
        fetch = await recv_kind(gen, m.WeightsFetch)
        assert (fetch.model, fetch.version) == ("drafter", version)
        await gen.send(store.chunk("drafter", fetch.version, fetch.chunk_index))


async def fetch_all(gen, notice: m.WeightsNotice) -> dict[str, torch.Tensor]:
    assembler = WeightsAssembler(notice)
    index = 0
    while index is not None:
        await gen.send(m.WeightsFetch(model="drafter", version=notice.version, chunk_index=index))
        tensors = assembler.add(await recv_kind(gen, m.WeightsChunk))
        index = assembler.next_index()
    return tensors


async def wait_for(predicate, timeout_s: float = 10.0) -> None:
    async def poll():
        while not predicate():
            await asyncio.sleep(0.02)
    await asyncio.wait_for(poll(), timeout_s)


@pytest.mark.timeout(120)
async def test_trainer_relays_a_generator_drafter_to_the_others_and_serves_it_after_resume(tmp_path):
    service = make_service(tmp_path)
    run = asyncio.create_task(service.run())
    address = await wait_bound(service)
    caps = {"vocab_size": service.vocab_size}
    good = drafter_state(service, 1.0)
    try:
        async with Client(address, role="generator", name="a", max_inflight=8, capabilities=caps) as a, \
                Client(address, role="generator", name="b", max_inflight=8, capabilities=caps) as b:
            await asyncio.wait_for(a.connect(), 10)
            welcome_b = await asyncio.wait_for(b.connect(), 10)
            assert welcome_b.drafter_version == 0
            store = WeightsStore(chunk_bytes=64 << 10)  # several chunks
            store.publish("drafter", 1, good)
            await serve_upload(a, store, 1)
            notice = await recv_kind(b, m.WeightsNotice)
            assert (notice.model, notice.version, notice.num_tensors) == ("drafter", 1, len(good))
            assert (await recv_kind(a, m.WeightsNotice)).version == 1  # the uploader hears it too
            got = await fetch_all(b, notice)
            assert all(torch.equal(got[k], v) for k, v in good.items())
            assert service.server.drafter_version == 1

            # Only the next version is taken: neither the served one again nor one that skips ahead.
            for version in (1, 5):
                store.publish("drafter", version, drafter_state(service, 9.0))
                await a.send(store.latest("drafter"))
            await wait_for(lambda: service.counters["trainer/drafter/announcements_skipped"] == 2)

            # Not a drafter for this policy: refused (at the announcement, or chunk by chunk), counted,
            # never republished; the served drafter stays.
            name, first = next(iter(good.items()))
            bad_uploads = [
                {**good, name: first.flatten()},  # same bytes, wrong shape
                {**good, name: first.double()},  # wrong dtype (and size)
                {("x" + k if k == name else k): v for k, v in good.items()},  # a name it does not have
                {k: v for k, v in good.items() if k != name},  # one missing
            ]
            for bad in bad_uploads:
                bad_store = WeightsStore(chunk_bytes=64 << 10)
                notice = bad_store.publish("drafter", 2, bad)
                await a.send(notice)
                if notice.total_bytes == store.latest("drafter").total_bytes and notice.num_tensors == len(good):
                    fetch = await recv_kind(a, m.WeightsFetch)
                    await a.send(bad_store.chunk("drafter", 2, fetch.chunk_index))
            await wait_for(lambda: service.counters["trainer/drafter/rejected"] == len(bad_uploads))
            assert service.counters["trainer/drafter/rejected/layout"] == len(bad_uploads)
            assert service.server.drafter_version == 1 and service.drafters.fetch is None

            # A generator that joins later learns of the served drafter at once.
            async with Client(address, role="generator", name="c", max_inflight=8, capabilities=caps) as c:
                welcome_c = await asyncio.wait_for(c.connect(), 10)
                assert welcome_c.drafter_version == 1
                assert (await recv_kind(c, m.WeightsNotice)).version == 1

            # The next upload replaces the served drafter; the checkpoint keeps the latest.
            store.publish("drafter", 2, drafter_state(service, 2.0))
            await serve_upload(a, store, 2)
            assert (await recv_kind(b, m.WeightsNotice)).version == 2

            folder = service.save_checkpoint()
            saved = load_file(str(folder / DRAFTER_FILE))
            assert all(torch.equal(saved[k], v) for k, v in drafter_state(service, 2.0).items())
    finally:
        service.request_stop("test over")
        await asyncio.wait_for(run, 60)
    # Resumed, the trainer serves the checkpoint's drafter again: a joining generator is told of v2.
    resumed = make_service(tmp_path, True)
    assert resumed.drafter_version() == 2
    assert all(torch.equal(resumed.drafters.state[k], v) for k, v in drafter_state(resumed, 2.0).items())
    run = asyncio.create_task(resumed.run())
    address = await wait_bound(resumed)
    try:
        async with Client(address, role="generator", name="d", max_inflight=8, capabilities=caps) as d:
            assert (await asyncio.wait_for(d.connect(), 10)).drafter_version == 2
            notice = await recv_kind(d, m.WeightsNotice)
            assert (notice.model, notice.version) == ("drafter", 2)
            got = await fetch_all(d, notice)
            assert all(torch.equal(got[k], v) for k, v in drafter_state(resumed, 2.0).items())
    finally:
        resumed.request_stop("test over")
        await asyncio.wait_for(run, 60)
    # With trainer.accept_drafters off, nothing is taken, and no saved drafter is served either.
    closed = make_service(tmp_path, True, "--trainer.accept_drafters", "false")
    assert closed.drafter_version() == 0 and closed.drafters.reference is None
    run = asyncio.create_task(closed.run())
    address = await wait_bound(closed)
    try:
        async with Client(address, role="generator", name="e", max_inflight=8, capabilities=caps) as e:
            await asyncio.wait_for(e.connect(), 10)
            await e.send(store.publish("drafter", 1, good))
            await wait_for(lambda: closed.counters["trainer/drafter/rejected/off"] == 1)
            assert closed.server.drafter_version == 0
    finally:
        closed.request_stop("test over")
        await asyncio.wait_for(run, 60)
    # A damaged drafter file costs the drafter, not the run.
    for folder in (tmp_path / "drafters" / "checkpoint").iterdir():
        if (folder / DRAFTER_FILE).is_file():
            (folder / DRAFTER_FILE).write_bytes(b"not safetensors")
    assert make_service(tmp_path, True).drafter_version() == 0


# ---------------------------------------------------------------------------------------- generator side


@pytest.fixture(scope="module")
def policy(tiny_lm):
    return tiny_lm("qwen2", attn="sdpa", tie_word_embeddings=False).eval()


class FakeClient:
    def __init__(self):
        self.sent = []

    async def send(self, msg):
        self.sent.append(msg)


def bare_generator(policy, *, speculation: bool = True) -> GeneratorService:
    gen = object.__new__(GeneratorService)
    gen.name = "gen-test"
    gen.spot = SpotTrainer(Drafter.for_policy(policy, seed=1)) if speculation else None
    gen.drafter_store = WeightsStore(chunk_bytes=4096) if speculation else None
    gen.drafter_assembler = None
    gen.ready_drafter = None
    gen.drafter_published_steps = 0
    gen.drafters_rejected = 0
    gen.client = FakeClient()
    gen.backend = SimpleNamespace(num_changed=0)
    gen.backend.drafter_changed = lambda: setattr(gen.backend, "num_changed", gen.backend.num_changed + 1)
    return gen


async def test_generator_announces_and_serves_its_drafter(policy):
    gen = bare_generator(policy)
    await gen.maybe_publish_drafter()
    assert gen.client.sent == []  # not enough training yet
    gen.spot.num_steps = gen_service.DRAFTER_PUBLISH_STEPS
    await gen.maybe_publish_drafter()
    notice = gen.client.sent[-1]
    assert isinstance(notice, m.WeightsNotice) and (notice.model, notice.version) == ("drafter", 1)
    assembler = WeightsAssembler(notice)
    for i in range(notice.num_chunks):
        assembler.add(gen.serve_drafter(m.WeightsFetch(model="drafter", version=1, chunk_index=i)))
    assert assembler.next_index() is None and set(assembler.tensors) == set(gen.spot.drafter.state_dict())
    gone = gen.serve_drafter(m.WeightsFetch(model="drafter", version=9, chunk_index=0))
    assert isinstance(gone, m.Error) and gone.text.startswith("drafter")


async def test_generator_fetches_and_adopts_a_newer_drafter_between_steps(policy):
    gen = bare_generator(policy)
    trainer_store = WeightsStore(chunk_bytes=4096)
    donor = Drafter.for_policy(policy, seed=2)
    notice = trainer_store.publish("drafter", 4, donor.export_state())
    await gen.on_drafter_notice(notice)
    while gen.ready_drafter is None:
        fetch = gen.client.sent[-1]
        assert isinstance(fetch, m.WeightsFetch) and fetch.model == "drafter"
        await gen.on_drafter_chunk(trainer_store.chunk("drafter", fetch.version, fetch.chunk_index))
    gen.adopt_drafter()
    assert gen.spot.drafter.version == 4 and gen.backend.num_changed == 1
    assert all(torch.equal(v, donor.state_dict()[k]) for k, v in gen.spot.drafter.state_dict().items())
    num_sent = len(gen.client.sent)
    await gen.on_drafter_notice(notice)  # not newer than ours: ignored
    assert len(gen.client.sent) == num_sent

    # Names that do not match this drafter: rejected and counted, the drafter untouched.
    bad = trainer_store.publish("drafter", 6, {"proj.weight": torch.zeros(3, 3)})
    await gen.on_drafter_notice(bad)
    await gen.on_drafter_chunk(trainer_store.chunk("drafter", 6, 0))
    gen.adopt_drafter()
    assert gen.drafters_rejected == 1 and gen.spot.drafter.version == 4 and gen.backend.num_changed == 1


async def test_generator_without_speculation_ignores_drafter_notices(policy):
    gen = bare_generator(policy, speculation=False)
    await gen.on_drafter_notice(m.WeightsNotice(model="drafter", version=3, num_chunks=1, num_tensors=1,
                                                total_bytes=4))
    assert gen.client.sent == []
    assert isinstance(gen.serve_drafter(m.WeightsFetch(model="drafter", version=3, chunk_index=0)), m.Error)
