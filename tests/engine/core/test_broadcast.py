"""Weights by broadcast (engine/core/broadcast.py): the bucket plan both sides derive, and a real gloo group of a
trainer and generators (threads of this process, over loopback TCP) receiving bit-equal weights, joining
late, and failing within its timeout when a member never comes.

Run: pytest tests/engine/core/test_broadcast.py
"""

import threading

import pytest
import torch

from tailrace.engine.core.broadcast import (
    Group,
    JoinFailed,
    Receiver,
    fingerprint,
    layout_of,
    master_store,
    pack,
    plan,
    store_address,
    unpack,
)
from tailrace.protocol.messages import WeightsNotice

pytestmark = pytest.mark.timeout(60)


def _state(seed=0):
    g = torch.Generator().manual_seed(seed)
    state = {"model.embed_tokens.weight": torch.randn(64, 16, generator=g),
             "model.layers.0.mlp.weight": torch.randn(32, 16, generator=g).to(torch.bfloat16),
             "model.norm.weight": torch.randn(16, generator=g),
             "model.layers.0.scale": torch.randn((), generator=g).to(torch.float64),
             "model.empty": torch.zeros(0, 4)}
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied: two names, one tensor
    return state


def test_plan_is_fixed_by_the_layout_alone():
    state = _state()
    reordered = dict(reversed(list(state.items())))
    assert plan(layout_of(state), 1024) == plan(layout_of(reordered), 1024)
    assert fingerprint(layout_of(state)) == fingerprint(layout_of(reordered))
    changed = dict(state, **{"model.norm.weight": torch.zeros(17)})
    assert fingerprint(layout_of(changed)) != fingerprint(layout_of(state))
    as_half = dict(state, **{"model.norm.weight": torch.zeros(16, dtype=torch.float16)})
    assert fingerprint(layout_of(as_half)) != fingerprint(layout_of(state))


def test_buckets_hold_one_dtype_within_the_size_and_cover_every_tensor_once():
    state = _state()
    buckets = plan(layout_of(state), 1024)
    names = [s.name for b in buckets for s in b.slots]
    assert sorted(names) == sorted(state)
    for bucket in buckets:
        assert {state[s.name].dtype for s in bucket.slots} == {bucket.dtype}
        item = torch.empty((), dtype=bucket.dtype).element_size()
        assert bucket.numel * item <= 1024 or len(bucket.slots) == 1  # a big tensor gets its own bucket
    assert any(len(b.slots) == 1 and b.numel * 4 > 1024 for b in buckets)  # the 64x16 embedding
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan(layout_of(state), 0)


def test_pack_then_unpack_is_bit_equal():
    state = _state()
    for bucket in plan(layout_of(state), 512):
        for name, view in unpack(bucket, pack(bucket, state)).items():
            assert view.dtype == state[name].dtype and view.shape == state[name].shape
            assert torch.equal(view.view(-1).view(torch.uint8), state[name].reshape(-1).view(torch.uint8))


def test_store_address_takes_the_connect_host_for_a_wildcard():
    assert store_address("10.0.0.5:29500", "tcp://10.0.0.5:5555") == ("10.0.0.5", 29500)
    assert store_address("0.0.0.0:29500", "tcp://trainer.local:5555") == ("trainer.local", 29500)
    for bad in ("nohost", ":1", "h:0", "h:99999", "h:x"):
        with pytest.raises(ValueError, match="broadcast_store"):
            store_address(bad, "tcp://127.0.0.1:5555")


def _notice(store, group, rank, world, layout, version=1, timeout_s=10.0, bucket_bytes=1024):
    return WeightsNotice(model="policy", version=version, num_chunks=1, num_tensors=6, total_bytes=1,
                         transport="broadcast", broadcast_store=f"127.0.0.1:{store.port}", broadcast_group=group,
                         broadcast_backend="gloo", broadcast_rank=rank, broadcast_world_size=world,
                         broadcast_bucket_bytes=bucket_bytes, broadcast_layout=layout, broadcast_timeout_s=timeout_s)


def _serve(store, name, world, states, timeout_s=10.0, bucket_bytes=1024):
    """The trainer's side: join once, broadcast each state in turn."""
    group = Group(store, name, 0, world, backend="gloo", timeout_s=timeout_s)
    group.join()
    for state in states:
        for _ in group.broadcast(plan(layout_of(state), bucket_bytes), lambda b, s=state: pack(b, s)):
            pass
    group.close()


def _receive_all(receiver, notices, out):
    try:
        out.extend(receiver.receive(n) for n in notices)
    except Exception as exc:  # surfaced by the test's assertions
        out.append(exc)


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


def test_two_generators_get_every_version_bit_equal():
    store = master_store("127.0.0.1", 10.0)
    versions = [_state(seed) for seed in range(3)]
    layout = fingerprint(layout_of(versions[0]))
    outs = [[], []]
    threads = [threading.Thread(target=_receive_all, args=(
        Receiver(_state(), "tcp://127.0.0.1:1"), [_notice(store, "w1", r, 3, layout, v + 1) for v in range(3)],
        outs[r - 1])) for r in (1, 2)]
    for t in threads:
        t.start()
    _serve(store, "w1", 3, versions)
    for t in threads:
        t.join(30)
    for out in outs:
        assert len(out) == 3 and not any(isinstance(o, Exception) for o in out), out
        for received, sent in zip(out, versions, strict=True):
            assert sorted(received) == sorted(sent)
            for name in sent:
                assert received[name].dtype == sent[name].dtype
                assert torch.equal(_bits(received[name]), _bits(sent[name])), name


def test_a_member_that_never_joins_fails_the_group_within_the_timeout():
    store = master_store("127.0.0.1", 5.0)
    layout = fingerprint(layout_of(_state()))
    out = []
    member = threading.Thread(target=_receive_all, args=(
        Receiver(_state(), "tcp://127.0.0.1:1"), [_notice(store, "w2", 1, 3, layout, timeout_s=1.0)], out))
    member.start()
    group = Group(store, "w2", 0, 3, backend="gloo", timeout_s=1.0)
    with pytest.raises(JoinFailed) as info:
        group.join()  # rank 2 never comes
    assert info.value.missing == (2,)
    member.join(10)
    assert not member.is_alive() and isinstance(out[0], JoinFailed)  # called off, not left waiting


def test_a_receiver_refuses_another_layout_before_joining():
    receiver = Receiver(_state(), "tcp://127.0.0.1:1")
    store = master_store("127.0.0.1", 5.0)
    with pytest.raises(ValueError, match="broadcast_layout"):
        receiver.receive(_notice(store, "w3", 1, 2, "0" * 32))


def test_a_bad_rendezvous_answer_is_refused_as_a_field_error():
    """A broadcast WeightsNotice that names no store, a rank outside the group, an unknown backend or no
    timeout never reaches a generator's receiver: decoding refuses it with 401 (the peer gets an Error)."""
    import msgpack

    from tailrace.protocol.codec import ProtocolError, decode, encode

    good = WeightsNotice(model="policy", version=1, num_chunks=1, num_tensors=6, total_bytes=1, transport="broadcast",
                         broadcast_store="127.0.0.1:5", broadcast_group="w1", broadcast_backend="gloo",
                         broadcast_rank=1, broadcast_world_size=3, broadcast_bucket_bytes=1024,
                         broadcast_layout="0" * 32, broadcast_timeout_s=1.0)
    frames = encode(good)
    assert decode(frames) == good
    fields = list(good.__struct_fields__)
    for field, value in (("broadcast_rank", 0), ("broadcast_rank", 3), ("broadcast_store", ""),
                         ("broadcast_backend", "mpi"), ("broadcast_timeout_s", 0.0), ("broadcast_bucket_bytes", 0),
                         ("broadcast_group", ""), ("transport", "carrier-pigeon")):
        body = msgpack.unpackb(frames[1])
        body[fields.index(field)] = value
        with pytest.raises(ProtocolError) as info:
            decode([frames[0], msgpack.packb(body), *frames[2:]])
        assert info.value.code == 401, (field, value, info.value)
