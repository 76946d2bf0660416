"""Weights by broadcast through the real services, in one process: a TrainerService and torch-backend
GeneratorServices over tcp loopback, the weights over a real gloo group. Every version a generator loads
is bit-equal to what the trainer published for it; a generator that joins later gets the newest version by
broadcast; one that cannot join (its store unreachable) or does not offer to is served by chunks; the run's
accounting is exact. Faults with real processes and kill -9: tests/faults/test_broadcast_faults.py.

Run: pytest tests/engine/trainer/test_weights_broadcast.py (the late joiner's run: add -m slow)
"""

import asyncio

import pytest
import torch

from tailrace.engine.config import load_config
from tailrace.engine.generator.service import GeneratorService
from tailrace.engine.trainer.service import TrainerService
from tailrace.protocol.messages import WeightsAck, WeightsFetch, WeightsNotice


def _trainer(tmp_path, steps, run, bits, *extra):
    cfg = load_config(None, [*run, "--train.steps", str(steps), "--trainer.runs_dir", str(tmp_path),
                             "--trainer.run_name", "bc", *extra])
    service = TrainerService(cfg)
    published = {}

    def publish(model, version, state, _publish=service.store.publish):
        if model == "policy":
            published[version] = bits(state)
        return _publish(model, version, state)

    service.store.publish = publish
    return service, published


def _generator(address, name, run, bits, *extra):
    gen = GeneratorService(load_config(None, [*run, *extra]), address, name=name)
    loaded = {}  # version -> the model's bits right after loading it
    real = gen.backend.update_weights

    def update_weights(weights, version):
        real(weights, version)
        loaded[version] = bits(gen.backend.model.state_dict())

    gen.backend.update_weights = update_weights
    return gen, loaded


async def _address(service):
    while service.server is None or not service.server.address.rpartition(":")[2].isdigit():
        await asyncio.sleep(0.02)
    return service.server.address


def _assert_bit_equal(loaded, published, name):
    assert loaded, f"{name} loaded no version"
    for version, bits in loaded.items():
        assert set(bits) == set(published[version]), name
        for key, value in bits.items():
            assert torch.equal(value, published[version][key]), f"{name} v{version} {key}"


def _exact(summary):
    assert summary["samples_handed_out"] == summary["samples_trained"] + sum(summary["discarded"].values())


@pytest.mark.timeout(120)
async def test_every_version_reaches_each_generator_bit_equal_by_broadcast(tmp_path, broadcast_run, weight_bits):
    trainer, published = _trainer(tmp_path, 3, broadcast_run, weight_bits)
    run = asyncio.create_task(trainer.run())
    address = await _address(trainer)
    gens = [_generator(address, f"gen-{i}", broadcast_run, weight_bits) for i in range(2)]
    tasks = [asyncio.create_task(g.run()) for g, _ in gens]
    summary = await asyncio.wait_for(run, 90)
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    _exact(summary)
    for (gen, loaded), name in zip(gens, ("gen-0", "gen-1"), strict=True):
        _assert_bit_equal(loaded, published, name)
        assert gen.weights_by["broadcast"] == len(loaded) and gen.weights_by["chunks"] == 0, gen.weights_by
    assert summary["weights_broadcast"]["broadcasts"] >= 1


@pytest.mark.slow
@pytest.mark.timeout(200)
async def test_a_late_joiner_gets_the_broadcast_and_one_that_cannot_join_gets_chunks(tmp_path, broadcast_run,
                                                                                     weight_bits):
    trainer, published = _trainer(tmp_path, 8, broadcast_run, weight_bits)
    run = asyncio.create_task(trainer.run())
    address = await _address(trainer)
    first, first_loaded = _generator(address, "gen-0", broadcast_run, weight_bits)
    tasks = [asyncio.create_task(first.run())]
    unreachable, unreachable_loaded = _generator(address, "gen-far", broadcast_run, weight_bits)
    real_receive = unreachable.receiver.receive
    # Its notices name a store port nothing listens on: a real failed join, after the notice's timeout.
    unreachable.receiver.receive = lambda notice: real_receive(
        type(notice)(**{**{f: getattr(notice, f) for f in notice.__struct_fields__}, "broadcast_store": "127.0.0.1:1"}))
    tasks.append(asyncio.create_task(unreachable.run()))
    chunky, chunky_loaded = _generator(address, "gen-chunks", broadcast_run, weight_bits, "--generator.weights_transport", "chunks")
    tasks.append(asyncio.create_task(chunky.run()))
    while trainer.learner.policy_version < 5:
        await asyncio.sleep(0.05)
        assert not run.done(), run
    late, late_loaded = _generator(address, "gen-late", broadcast_run, weight_bits)
    tasks.append(asyncio.create_task(late.run()))
    summary = await asyncio.wait_for(run, 150)
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    _exact(summary)
    for loaded, name in ((first_loaded, "gen-0"), (unreachable_loaded, "gen-far"), (chunky_loaded, "gen-chunks"),
                         (late_loaded, "gen-late")):
        _assert_bit_equal(loaded, published, name)
    # Its first version (5 or later) came by broadcast: the trainer sent it no chunks notice on joining.
    assert min(late_loaded) >= 5 and late.weights_by["chunks"] == 0 and late.weights_by["broadcast"] >= 1, \
        (late_loaded.keys(), late.weights_by)
    assert unreachable.weights_by["broadcast"] == 0 and unreachable.weights_by["chunks"] >= 1
    assert unreachable.weights_by["broadcast_failed"] >= 1
    assert summary["weights_broadcast"]["broadcast_refused"] >= 1
    assert chunky.weights_by["broadcast"] == 0 and chunky.weights_by["chunks"] >= 1
    assert first.weights_by["broadcast"] >= 1


@pytest.mark.timeout(60)
async def test_an_error_in_a_receive_task_ends_the_session_with_its_message(broadcast_run):
    """A receive task is started by the recv loop, beside the main loop: an error it raises past its own
    fallback (here its WeightsAck cannot be sent) ends the session through the main loop, never vanishes."""
    gen = GeneratorService(load_config(None, broadcast_run), "tcp://127.0.0.1:1", name="g")
    notice = WeightsNotice(
        model="policy", version=3, num_chunks=2, num_tensors=38, total_bytes=1, transport="broadcast",
        broadcast_store="127.0.0.1:1", broadcast_group="w1", broadcast_backend="gloo", broadcast_rank=1,
        broadcast_world_size=2, broadcast_bucket_bytes=1024, broadcast_layout=gen.receiver.fingerprint,
        broadcast_timeout_s=1.0)
    inbox = [notice]

    class Client:
        async def recv(self):
            if inbox:
                return inbox.pop()
            await asyncio.Event().wait()  # nothing more from the trainer

        async def send(self, msg):
            if isinstance(msg, WeightsAck):
                raise RuntimeError("the ack could not be sent")

    def receive(notice):
        raise RuntimeError("Connection closed by peer")

    gen.client, gen.receiver.receive = Client(), receive
    gen.state.exhausted = True  # no work: the main loop idles until something wakes it
    recv = asyncio.create_task(gen.recv_loop())
    forever = asyncio.get_running_loop().create_future()
    try:
        with pytest.raises(RuntimeError, match="the ack could not be sent"):
            await asyncio.wait_for(gen.main_loop(recv, forever), 30)
    finally:
        recv.cancel()
    assert gen.weights_by["broadcast_failed"] == 1 and not gen.receive_tasks


@pytest.mark.timeout(60)
async def test_a_failed_broadcast_is_acknowledged_and_the_same_version_fetched_by_chunks(broadcast_run):
    gen = GeneratorService(load_config(None, broadcast_run), "tcp://127.0.0.1:1", name="g")
    sent = []

    class Client:
        async def send(self, msg):
            sent.append(msg)

    def receive(notice):
        raise RuntimeError("Connection closed by peer")  # what gloo raises when a member dies mid-broadcast

    gen.client, gen.receiver.receive = Client(), receive
    await gen.on_broadcast_notice(WeightsNotice(
        model="policy", version=3, num_chunks=2, num_tensors=38, total_bytes=1, transport="broadcast",
        broadcast_store="127.0.0.1:1", broadcast_group="w1", broadcast_backend="gloo", broadcast_rank=1,
        broadcast_world_size=2, broadcast_bucket_bytes=1024, broadcast_layout=gen.receiver.fingerprint,
        broadcast_timeout_s=1.0))
    assert isinstance(sent[0], WeightsAck) and not sent[0].ok and "Connection closed" in sent[0].text, sent
    assert sent[1:] == [WeightsFetch(model="policy", version=3, chunk_index=0)]
    assert gen.weights_by["broadcast_failed"] == 1 and gen.state.ready_weights is None


class _Peer:
    def __init__(self, name, event="joined"):
        self.id, self.name, self.role, self.event = name.encode(), name, "generator", event
        self.hello = type("Hello", (), {"capabilities": {"weights_layout": "L", "weights_broadcast": "gloo"}})()


async def test_a_member_is_excluded_for_its_own_failures_only_and_comes_back():
    """A not-ok acknowledgement of a version whose broadcast failed for the whole group (another member
    froze) leaves the member in; one of a version the others received, or a missed join, excludes it for
    8 versions, then 16 after a second failure in a row; it is a member again after each pause."""
    from collections import Counter

    from tailrace.engine.trainer.broadcaster import Broadcaster

    b = Broadcaster(server=None, counters=Counter(), bucket_bytes=1 << 20, timeout_s=1.0)
    b.layout = "L"
    healthy, slow = _Peer("gen-0"), _Peer("gen-1")

    def at(version):
        b.latest = (version, {}, None)

    def no(peer, version):
        b.on_ack(peer, WeightsAck(model="policy", version=version, ok=False, text="timeout"))

    at(3)
    b.failed.append(3)
    no(healthy, 3)  # the group's failure: still a member
    assert b.can_join(healthy)
    b.sending = 4
    no(healthy, 4)  # while the trainer's side still runs: decided when it ends
    assert b.can_join(healthy) and b.refusals[4] == {healthy.id: "gen-0"}
    b.sending = None
    no(slow, 2)  # a version the others received: its own failure
    assert not b.can_join(slow)
    at(3 + 7)
    assert not b.can_join(slow)
    at(3 + 8)
    assert b.can_join(slow)
    b.exclude(slow.id)  # a second failure in a row (a missed join): twice as long
    at(11 + 15)
    assert not b.can_join(slow)
    at(11 + 16)
    assert b.can_join(slow)
    b.membership_changed(_Peer("gen-1", event="left"))  # gone: its history too
    assert slow.id not in b.strikes and b.can_join(slow)


async def test_a_member_gone_mid_broadcast_gets_the_others_chunks_until_that_broadcast_ends():
    """gloo cannot abort a broadcast in flight, and a frozen member holds it until its timeout. When that member
    is declared dead (or leaves), the other members are sent the latest version's chunk notice at once, and
    can_join is False (so publish sends every version by chunks) until the stuck broadcast ends."""
    from collections import Counter

    from tailrace.engine.trainer.broadcaster import Broadcaster

    sent = []

    class Server:
        address = "tcp://127.0.0.1:5555"
        peers = {}

        async def send(self, peer_id, msg):
            sent.append((peer_id, msg))

    server = Server()
    b = Broadcaster(server=server, counters=Counter(), bucket_bytes=1 << 20, timeout_s=30.0)
    b.layout = "L"
    healthy, frozen, newcomer = _Peer("gen-0"), _Peer("gen-1"), _Peer("gen-2")
    server.peers = {p.id: p for p in (healthy, frozen, newcomer)}
    b.group, b.members = type("Group", (), {"name": "w1"})(), (healthy.id, frozen.id)  # formed: no new rendezvous
    b.store = type("Store", (), {"port": 1})()
    chunks = WeightsNotice(model="policy", version=5, num_chunks=2, num_tensors=3, total_bytes=10)
    b.offer(5, {}, chunks)
    release = asyncio.Event()

    async def stuck(*args):  # the trainer's side of the broadcast, waiting on the frozen member
        await release.wait()

    b._send_bytes = stuck
    sending = asyncio.create_task(b.send(5, {}, chunks, [healthy, frozen]))
    while b.sending != 5:
        await asyncio.sleep(0.01)
    assert [(peer_id, msg.transport) for peer_id, msg in sent] == [(healthy.id, "broadcast"), (frozen.id, "broadcast")]
    sent.clear()
    await b.member_gone(_Peer("gen-2", event="left"))  # not a member: nothing changes
    assert sent == [] and b.can_join(healthy)
    frozen.event = "dead"
    del server.peers[frozen.id]
    await b.member_gone(frozen)
    assert sent == [(healthy.id, chunks)]  # the healthy member fetches the latest version by chunks now
    assert not b.can_join(healthy) and not b.can_join(newcomer)  # and every version until the broadcast ends
    assert b.counters["trainer/weights/broadcast_member_lost"] == 1
    release.set()
    await sending
    assert b.can_join(healthy) and b.can_join(newcomer) and b.lost_member_of is None
    sent.clear()
    await b.member_gone(_Peer("gen-0", event="left"))  # gone while nothing is sent: nothing to serve
    assert sent == []
