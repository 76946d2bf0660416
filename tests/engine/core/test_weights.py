"""Weight broadcast bookkeeping: chunking, version retention, assembly through the real codec."""

import pytest
import torch

from tailrace.engine.core.weights import WeightsAssembler, WeightsStore, chunk_state_dict
from tailrace.protocol.codec import decode, encode


def state(n=5, size=100):
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(size, generator=g) for i in range(n)}


def test_chunking_respects_budget_and_order():
    s = state(5, 100)  # 400 bytes each
    chunks = chunk_state_dict(s, 900)
    assert [list(c) for c in chunks] == [["layer0.weight", "layer1.weight"], ["layer2.weight", "layer3.weight"],
                                         ["layer4.weight"]]
    assert chunk_state_dict({}, 10) == []
    assert len(chunk_state_dict(s, 1)) == 5  # one oversized tensor per chunk


def test_store_roundtrip_over_codec_and_retention():
    store = WeightsStore(chunk_bytes=900, keep=2)
    for version in range(3):
        notice = store.publish("policy", version, state())
    assert store.chunk("policy", 0, 0) is None  # evicted
    assert store.chunk("policy", 2, 99) is None
    assert store.latest("policy").version == 2 and store.latest("drafter") is None
    assembler = WeightsAssembler(decode(encode(notice)))
    result = None
    while (index := assembler.next_index()) is not None:
        result = assembler.add(decode(encode(store.chunk("policy", 2, index))))
    assert result is not None
    for name, tensor in state().items():
        assert torch.equal(result[name], tensor)


def test_assembler_rejects_mismatched_chunks():
    store = WeightsStore(chunk_bytes=900)
    notice = store.publish("policy", 1, state())
    other = WeightsStore(chunk_bytes=900)
    other.publish("policy", 2, state())
    assembler = WeightsAssembler(notice)
    with pytest.raises(ValueError, match="while assembling"):
        assembler.add(other.chunk("policy", 2, 0))
