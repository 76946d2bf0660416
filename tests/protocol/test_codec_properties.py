"""Property-based codec tests (hypothesis): random valid messages of every kind, drawn from the schema's
own bounds, round trip equal; mutated or random frames never raise anything but ProtocolError.
Run: pytest tests/protocol/test_codec_properties.py
"""

import types
import typing
from typing import Literal

import msgpack
import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from wire_examples import assert_same, examples, rollout

from tailrace.protocol.codec import ProtocolError, decode, encode
from tailrace.protocol.messages import PROTOCOL_VERSION, EnvObservation, Rollout, WeightsNotice
from tailrace.protocol.schema import (
    INT64_MAX,
    INT64_MIN,
    MESSAGE_CLASSES,
    Array,
    Scalar,
    hints,
    is_struct,
    split,
)

TRV = b"TR" + bytes((PROTOCOL_VERSION,))  # a header's magic and this protocol version

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
                "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool}


@st.composite
def tensors(draw, dtypes=None, ndim=None, length=None):
    """A torch tensor or numpy array, sometimes non-contiguous, sometimes over the inline threshold."""
    name = draw(st.sampled_from(sorted(dtypes or TORCH_DTYPES)))
    if length is not None:
        shape = [length]
    else:
        rank = ndim if ndim is not None else draw(st.integers(0, 3))
        shape = draw(st.lists(st.sampled_from([0, 1, 2, 5, 17]), min_size=rank, max_size=rank))
        if rank == 1:
            shape = [draw(st.sampled_from([0, 1, 7, 255, 256, 257, 400]))]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    value = (torch.randn(shape, generator=g, dtype=torch.float64) * 1000).to(TORCH_DTYPES[name])
    if name == "bool":
        value = torch.randint(0, 2, shape, generator=g).bool()
    if len(shape) >= 2 and draw(st.booleans()):
        value = value.transpose(0, 1).contiguous().transpose(0, 1)  # same values, non-contiguous
    if name != "bfloat16" and draw(st.booleans()):
        return value.numpy()
    return value


def strategy(tp):
    if tp == Scalar:
        return st.one_of(st.none(), st.booleans(), st.integers(INT64_MIN, INT64_MAX), st.floats(),
                         st.text(max_size=20))
    tp, bounds, spec = split(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    lo, hi, max_len = bounds.get("ge"), bounds.get("le"), bounds.get("max_length")
    if origin in (types.UnionType, typing.Union):
        inner = next(a for a in args if a is not type(None))
        return st.one_of(st.none(), strategy(inner))
    if origin is Literal:
        return st.sampled_from(args)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(lo, hi)
    if tp is float:
        return st.floats(min_value=lo, max_value=hi, allow_nan=lo is None and hi is None)
    if tp is str:
        return st.text(max_size=min(max_len, 30))
    if tp is Array:
        return tensors(spec and spec.dtypes, spec and spec.ndim)
    if origin is list:
        return st.lists(strategy(args[0]), max_size=min(max_len, 5))
    if origin is dict:
        return st.dictionaries(st.text(max_size=12), strategy(args[1]), max_size=min(max_len, 4))
    if is_struct(tp):
        return messages(tp)
    raise TypeError(tp)


@st.composite
def rollouts(draw):
    length = draw(st.sampled_from([0, 1, 5, 300]))
    int_dtypes = ("int32", "int64")
    fields = {name: draw(strategy(tp)) for name, tp in hints(Rollout).items()}
    fields["completion_token_ids"] = draw(tensors(int_dtypes, length=length))
    fields["behaviour_logprobs"] = draw(tensors(("float32",), length=length))
    fields["policy_versions"] = draw(tensors(int_dtypes, length=length))
    fields["loss_mask"] = draw(st.one_of(st.none(), tensors(("uint8",), length=length)))
    fields["min_policy_version"], fields["max_policy_version"] = sorted(
        (fields["min_policy_version"], fields["max_policy_version"]))
    return Rollout(**fields)


@st.composite
def weights_notices(draw):
    """WeightsNotices whose broadcast fields, when transport is "broadcast", pass its cross-field checks."""
    fields = {name: draw(strategy(tp)) for name, tp in hints(WeightsNotice).items()}
    if fields["transport"] == "broadcast":
        world = draw(st.integers(2, 1 << 16))
        fields |= {"broadcast_store": fields["broadcast_store"] or "h:1", "broadcast_group": fields["broadcast_group"] or "g",
                   "broadcast_backend": fields["broadcast_backend"] or "gloo", "broadcast_world_size": world,
                   "broadcast_rank": draw(st.integers(1, world - 1)),
                   "broadcast_bucket_bytes": max(1, fields["broadcast_bucket_bytes"]),
                   "broadcast_timeout_s": draw(st.floats(0.001, 3600.0))}
    return WeightsNotice(**fields)


def messages(cls):
    if cls is EnvObservation:  # its reward is nil or finite (a NaN one is refused: test_codec.py)
        fields = {name: strategy(tp) for name, tp in hints(cls).items()}
        return st.builds(cls, **(fields | {"reward": st.one_of(st.none(), st.floats(allow_nan=False,
                                                                                   allow_infinity=False))}))
    if cls is Rollout:
        return rollouts()
    if cls is WeightsNotice:
        return weights_notices()
    return st.builds(cls, **{name: strategy(tp) for name, tp in hints(cls).items()})


any_message = st.sampled_from(sorted(MESSAGE_CLASSES.values(), key=lambda c: c.KIND)).flatmap(messages)


@FUZZ
@given(any_message)
def test_random_valid_messages_round_trip(msg):
    frames = encode(msg)
    assert_same(msg, decode(frames))
    assert_same(msg, decode([bytes(memoryview(f).cast("B")) for f in frames]))


def decode_or_protocol_error(frames):
    try:
        decode(frames)
    except ProtocolError as exc:
        assert exc.code in (400, 401, 402, 403, 404), exc
        assert str(exc)


@st.composite
def mutated(draw):
    msg = draw(st.one_of(any_message, st.sampled_from([m for m, _ in examples()])))
    frames = [bytearray(memoryview(f).cast("B")) for f in encode(msg)]
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.sampled_from([0, *[1] * 4, *range(2, len(frames))]))  # mostly the body
        if i >= len(frames):
            continue
        frame = frames[i]
        action = draw(st.sampled_from(["flip", "truncate", "extend", "drop_frame", "add_frame", "set"]))
        if action == "flip" and frame:
            frame[draw(st.integers(0, len(frame) - 1))] ^= 1 << draw(st.integers(0, 7))
        elif action == "set" and frame:
            frame[draw(st.integers(0, len(frame) - 1))] = draw(st.integers(0, 255))
        elif action == "truncate":
            del frame[draw(st.integers(0, len(frame))):]
        elif action == "extend":
            frame.extend(draw(st.binary(min_size=1, max_size=8)))
        elif action == "drop_frame" and len(frames) > 1:
            del frames[i]
        elif action == "add_frame":
            frames.insert(i, bytearray(draw(st.binary(max_size=16))))
    return [bytes(f) for f in frames]


@FUZZ
@given(mutated())
def test_mutated_frames_raise_only_protocol_error(frames):
    decode_or_protocol_error(frames)


wire_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(),
              st.text(max_size=8), st.binary(max_size=16), st.sampled_from(["float32", "int32", "bool", "policy"])),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=20,
)


@FUZZ
@given(st.sampled_from(sorted(MESSAGE_CLASSES)), wire_values, st.lists(st.binary(max_size=64), max_size=3))
def test_random_bodies_raise_only_protocol_error(kind, body, extra):
    header = b"TR" + bytes((PROTOCOL_VERSION, kind))
    decode_or_protocol_error([header, msgpack.packb(body), *extra])


@st.composite
def leaf_replaced(draw):
    """A valid message's wire values with one leaf replaced by a random value: exercises validators."""
    msg = draw(any_message)
    frames = encode(msg)
    values = msgpack.unpackb(frames[1])
    path, node = [], values
    while isinstance(node, list | dict) and node:
        key = draw(st.sampled_from(list(node.keys()) if isinstance(node, dict) else range(len(node))))
        path.append((node, key))
        node = node[key]
        if not draw(st.integers(0, 2)):
            break
    assume(path)
    parent, key = path[-1]
    parent[key] = draw(wire_values)
    return [frames[0], msgpack.packb(values), *frames[2:]]


@FUZZ
@given(leaf_replaced())
def test_random_field_values_raise_only_protocol_error(frames):
    decode_or_protocol_error(frames)


@FUZZ
@given(st.lists(st.binary(max_size=40), max_size=5))
def test_random_frames_raise_only_protocol_error(frames):
    decode_or_protocol_error(frames)
    decode_or_protocol_error([b"TR" + bytes((PROTOCOL_VERSION, 20)), *frames])


def test_numpy_and_torch_inputs_decode_alike():
    value = np.arange(12, dtype=np.int32)
    a = encode(Rollout(**{**msgspec.structs.asdict(rollout()), "prompt_token_ids": value}))
    b = encode(Rollout(**{**msgspec.structs.asdict(rollout()), "prompt_token_ids": torch.from_numpy(value)}))
    assert a[1] == b[1]
