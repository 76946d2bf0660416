"""Codec: round trip of every message kind with exact frame counts, tensor edge cases, and strict decoding
(every malformed input raises ProtocolError naming the kind and field, with the right error code).
Run: pytest tests/protocol/test_codec.py
"""

import ast
import importlib
import math
import time
from pathlib import Path

import msgpack
import msgspec
import numpy as np
import pytest
import torch
import zmq
from wire_examples import assert_same, examples, rollout

import tailrace.protocol.codec as codec
from tailrace.protocol.codec import INLINE_MAX_BYTES, Limits, ProtocolError, decode, encode, peek_header
from tailrace.protocol.messages import (
    PROTOCOL_VERSION,
    EnvClose,
    EnvError,
    EnvObservation,
    EnvReset,
    EnvStep,
    ErrorCode,
    Heartbeat,
    Hello,
    Rollout,
    Score,
    ScoreRequest,
    WeightsChunk,
    Welcome,
    Work,
)
from tailrace.protocol.schema import MESSAGE_CLASSES

TRV = b"TR" + bytes((PROTOCOL_VERSION,))  # a header's magic and this protocol version

# Tensors decoded from bytes frames view immutable memory; torch says so once. Expected here.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")

# ---------------------------------------------------------------------------------------- round trip


def test_every_kind_has_an_example():
    covered = {type(msg) for msg, _ in examples()}
    missing = sorted(cls.__name__ for cls in MESSAGE_CLASSES.values() if cls not in covered)
    assert not missing, f"add an example to tests/protocol/wire_examples.py for {missing}"


@pytest.mark.parametrize("msg, num_frames", examples(), ids=lambda x: type(x).__name__ if not isinstance(x, int) else "")
def test_round_trip_with_exact_frame_count(msg, num_frames):
    frames = encode(msg)
    assert len(frames) == num_frames
    assert frames[0] == b"TR" + bytes((PROTOCOL_VERSION, type(msg).KIND))
    assert peek_header(frames[0]) == (PROTOCOL_VERSION, type(msg).KIND)
    assert_same(msg, decode(frames))
    # What a socket delivers: every frame as bytes.
    assert_same(msg, decode([bytes(memoryview(f).cast("B")) for f in frames]))


def test_decode_accepts_zmq_frames_without_copy():
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://codec-test")
        b.connect("inproc://codec-test")
        for msg, num_frames in examples():
            a.send_multipart(encode(msg), copy=False)
            received = b.recv_multipart(copy=False)
            assert len(received) == num_frames
            assert_same(msg, decode(received))
    finally:
        a.close(linger=0)
        b.close(linger=0)


def test_missing_trailing_optional_fields_take_defaults():
    frames = [encode(Heartbeat(seq=1))[0], msgpack.packb([7])]
    assert decode(frames) == Heartbeat(seq=7, wall_s=0.0)
    body = [[[1, [5, 6], 2]], False]  # Work with one WorkItem that omits every optional field
    item = decode([encode(Work(items=[]))[0], msgpack.packb(body)]).items[0]
    assert item.sampling.max_new_tokens == 256 and item.task == "" and item.prompt_token_ids == [5, 6]


def test_int_accepted_for_float_and_numpy_scalars_encode():
    assert decode([encode(Heartbeat(seq=1))[0], msgpack.packb([1, 5])]).wall_s == 5.0
    msg = decode(encode(Score(request_id=np.int64(3), reward=np.float32(0.5), details={"x": np.float64(2)})))
    assert msg == Score(request_id=3, reward=0.5, details={"x": 2.0}) and type(msg.request_id) is int


def test_encode_errors_name_the_field():
    with pytest.raises(TypeError, match=r"Score\.details"):
        encode(Score(request_id=1, reward=1.0, details={"x": object()}))
    with pytest.raises(TypeError, match=r"Rollout\.prompt_token_ids.*torch.Tensor or numpy"):
        encode(Rollout(**{**msgspec.structs.asdict(rollout()), "prompt_token_ids": _Shaped()}))
    with pytest.raises(TypeError, match="not a registered message"):
        encode(object())


class _Shaped:
    shape = (3,)


# ---------------------------------------------------------------------------------------- tensors


def _chunk(value) -> WeightsChunk:
    return WeightsChunk(model="policy", version=1, chunk_index=0, num_chunks=1, tensors={"t": value})


def _round_trip_tensor(value, num_frames):
    frames = encode(_chunk(value))
    assert len(frames) == num_frames
    out = decode(frames).tensors["t"]
    assert_same(value, out)
    return frames, out


TORCH_CASES = {
    "bfloat16": torch.randn(3, 5).to(torch.bfloat16),
    "float16": torch.randn(7).half(),
    "float64": torch.randn(2, 2, dtype=torch.float64),
    "bool": torch.tensor([True, False, True]),
    "int64": torch.tensor([-(1 << 63), (1 << 63) - 1, 0]),
    "int8": torch.tensor([-128, 127], dtype=torch.int8),
    "uint8": torch.arange(256, dtype=torch.uint8),
    "int16": torch.tensor([-1, 2], dtype=torch.int16),
    "empty": torch.zeros(0),
    "empty_2d": torch.zeros(3, 0, dtype=torch.int64),
    "scalar": torch.tensor(3.5),
    "scalar_bool": torch.tensor(True),
    "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    "sliced": torch.arange(40, dtype=torch.int32)[::3],
    "expanded": torch.tensor([1.0, 2.0]).expand(4, 2),
    "requires_grad": torch.randn(4, requires_grad=True),
    "parameter": torch.nn.Parameter(torch.randn(3)),
    "nan_inf": torch.tensor([math.nan, math.inf, -math.inf, -0.0]),
    "eight_dims": torch.zeros([1] * 8),
}


@pytest.mark.parametrize("name", TORCH_CASES)
def test_torch_tensor_edge_cases(name):
    _round_trip_tensor(TORCH_CASES[name], 2)


NUMPY_CASES = {
    "float16": np.arange(5, dtype=np.float16),
    "bool": np.array([True, False]),
    "int64": np.array([[1, -2], [3, 4]], dtype=np.int64),
    "empty": np.zeros((0, 4), dtype=np.float32),
    "scalar": np.array(2.5, dtype=np.float32),
    "numpy_scalar": np.float64(1.25),
    "transposed": np.arange(12, dtype=np.int32).reshape(3, 4).T,
    "sliced": np.arange(30, dtype=np.float64)[1::4],
    "big_endian": np.arange(6, dtype=">i4"),
}


@pytest.mark.parametrize("name", NUMPY_CASES)
def test_numpy_array_edge_cases(name):
    _round_trip_tensor(NUMPY_CASES[name], 2)


def test_unsupported_dtypes_are_refused_on_encode():
    with pytest.raises(TypeError, match="complex64"):
        encode(_chunk(torch.zeros(2, dtype=torch.complex64)))
    with pytest.raises(TypeError, match="uint32"):
        encode(_chunk(np.zeros(2, dtype=np.uint32)))
    with pytest.raises(TypeError, match="dense"):
        encode(_chunk(torch.eye(2).to_sparse()))


def test_large_tensor_is_its_own_zero_copy_frame():
    value = torch.randn(300_000)  # 1.2 MB
    frames, out = _round_trip_tensor(value, 3)
    payload = frames[2]
    assert memoryview(payload).nbytes == value.nbytes
    assert np.asarray(payload).ctypes.data == value.data_ptr()  # the frame views the tensor: no copy
    assert out.data_ptr() == np.asarray(payload).ctypes.data  # the decoded tensor views the frame
    body = msgpack.unpackb(frames[1])
    assert body[4] == {"t": ["float32", [300_000], 2]}


def test_large_non_contiguous_and_numpy_tensors_get_frames():
    _round_trip_tensor(torch.randn(700, 600).t(), 3)
    _round_trip_tensor(torch.randn(1000, 1000).to(torch.bfloat16)[::2], 3)
    frames, _ = _round_trip_tensor(np.ones((600, 700), dtype=np.float32), 3)
    _round_trip_tensor(np.ones((600, 700), dtype=np.float32)[:, ::2], 3)


def test_inline_threshold_is_inclusive():
    at = torch.arange(INLINE_MAX_BYTES // 4, dtype=torch.float32)
    over = torch.arange(INLINE_MAX_BYTES // 4 + 1, dtype=torch.float32)
    frames, _ = _round_trip_tensor(at, 2)
    assert msgpack.unpackb(frames[1])[4]["t"][2] == at.numpy().tobytes()
    _round_trip_tensor(over, 3)
    assert len(encode(_chunk(over), inline_max_bytes=4096)) == 2
    assert len(encode(_chunk(at), inline_max_bytes=0)) == 3


def test_several_frames_are_numbered_in_field_order():
    msg = WeightsChunk(model="drafter", version=2, chunk_index=1, num_chunks=2,
                       tensors={f"w{i}": torch.full((400,), float(i)) for i in range(4)})
    frames = encode(msg)
    assert len(frames) == 6
    assert [d[2] for d in msgpack.unpackb(frames[1])[4].values()] == [2, 3, 4, 5]
    assert_same(msg, decode(frames))


def test_decoded_small_tensors_are_writable_copies():
    frames = encode(rollout())
    out = decode(frames)
    out.prompt_token_ids[0] = -1  # must not touch the received body
    assert_same(rollout(), decode(frames))


# ---------------------------------------------------------------------------------------- strict decoding


TR = b"TR" + bytes((PROTOCOL_VERSION,))  # a header of this version, less its kind byte
NEWER = b"TR" + bytes((PROTOCOL_VERSION + 1,))


def header(cls, version=PROTOCOL_VERSION) -> bytes:
    return b"TR" + bytes((version, cls.KIND))


def raw(cls, values, *extra):
    return [header(cls), msgpack.packb(values), *extra]


def rollout_values(**changes):
    msg = rollout()
    values = msgpack.unpackb(encode(msg)[1])
    names = Rollout.__struct_fields__
    for name, value in changes.items():
        values[names.index(name)] = value
    return values


def expect(frames, code, where, limits=codec.DEFAULT_LIMITS):
    with pytest.raises(ProtocolError) as info:
        decode(frames, limits)
    assert info.value.code == code, str(info.value)
    assert where in str(info.value), str(info.value)
    return info.value


BAD_FIELDS = {
    "wrong_type": (Heartbeat, ["1", 0.0], "Heartbeat.seq: expected int, got str"),
    "bool_for_int": (Heartbeat, [True], "Heartbeat.seq: expected int, got bool"),
    "float_for_int": (Heartbeat, [1.0], "Heartbeat.seq: expected int, got float"),
    "below_minimum": (Heartbeat, [-1], "Heartbeat.seq: -1 is outside"),
    "above_int64": (Heartbeat, [(1 << 64) - 1], "Heartbeat.seq"),
    "nan_in_bounded_float": (Heartbeat, [1, math.nan], "Heartbeat.wall_s: NaN"),
    "inf_above_bound": (Welcome, ["r", 0, 1, math.inf, 1.0], "Welcome.heartbeat_interval_s"),
    "str_for_float": (Heartbeat, [1, "1.0"], "Heartbeat.wall_s: expected float, got str"),
    "bool_for_float": (Heartbeat, [1, False], "Heartbeat.wall_s: expected float, got bool"),
    "zero_credits": (Welcome, ["r", 0, 0, 1.0, 1.0], "Welcome.credits"),
    "too_few_fields": (Heartbeat, [], "Heartbeat: expected 1..2 fields, got 0"),
    "too_many_fields": (Heartbeat, [1, 0.0, 3], "Heartbeat: expected 1..2 fields, got 3"),
    "body_not_array": (Heartbeat, {"seq": 1}, "Heartbeat: expected an array"),
    "str_for_unbounded_float": (Score, [1, "x"], "Score.reward: expected float, got str"),
    "bad_enum": (Rollout, rollout_values(finish_reason="exploded"), "Rollout.finish_reason: 'exploded' is not one of"),
    "str_too_long": (ScoreRequest, [1, "t" * 257, "", ""], "ScoreRequest.task: length 257"),
    "bytes_for_str": (ScoreRequest, [1, b"copy", "", ""], "ScoreRequest.task: expected str, got bytes"),
    "scalar_map_with_list": (ScoreRequest, [1, "t", "p", "c", {"a": [1]}], "ScoreRequest.metadata['a']: expected a scalar"),
    "map_for_list": (Work, [{"a": 1}], "Work.items: expected array, got dict"),
    "long_map_key": (Score, [1, 1.0, {"k" * 1025: 1.0}], "Score.details: map key"),
    "nested_path": (Work, [[[1, [5], 2], [1, [5], 2, 0, [1.0, 1.0, -1]]]], "Work.items[1].sampling.top_k"),
    "list_element": (Work, [[[1, [5, -3], 2]]], "Work.items[0].prompt_token_ids[1]: -3 is outside"),
    "list_element_type": (Work, [[[1, [5, True], 2]]], "Work.items[0].prompt_token_ids[1]: expected int, got bool"),
    "cross_field": (Rollout, rollout_values(min_policy_version=9), "Rollout: min_policy_version is greater"),
    "descriptor_not_array": (Rollout, rollout_values(prompt_token_ids=b"abcd"), "Rollout.prompt_token_ids: expected a tensor"),
    "descriptor_wrong_length": (Rollout, rollout_values(prompt_token_ids=["int32", [1]]), "Rollout.prompt_token_ids"),
    "wrong_byte_count": (Rollout, rollout_values(prompt_token_ids=["int32", [3], b"\0" * 11]),
                         "Rollout.prompt_token_ids: 11 bytes for int32[3] (needs 12)"),
    "dtype_not_allowed": (Rollout, rollout_values(behaviour_logprobs=["float64", [5], b"\0" * 40]),
                          "Rollout.behaviour_logprobs: dtype 'float64' is not one of"),
    "unknown_dtype": (WeightsChunk, ["policy", 1, 0, 1, {"t": ["complex64", [1], b"\0" * 8]}],
                      "WeightsChunk.tensors['t']: dtype 'complex64'"),
    "wrong_ndim": (Rollout, rollout_values(prompt_token_ids=["int32", [3, 1], b"\0" * 12]),
                   "Rollout.prompt_token_ids: shape [3, 1] must have 1 dimensions"),
    "negative_dim": (WeightsChunk, ["policy", 1, 0, 1, {"t": ["int8", [-1], b""]}], "bad shape"),
    "too_many_dims": (WeightsChunk, ["policy", 1, 0, 1, {"t": ["int8", [1] * 9, b"\0"]}], "dimensions"),
    "huge_empty_shape": (WeightsChunk, ["policy", 1, 0, 1, {"t": ["int8", [0, 1 << 30, 1 << 30], b""]}],
                         "WeightsChunk.tensors['t']: shape [0, 1073741824, 1073741824] is too large"),
    "bool_tensor_bytes": (WeightsChunk, ["policy", 1, 0, 1, {"t": ["bool", [2], b"\x01\x02"]}],
                          "WeightsChunk.tensors['t']: bool tensor holds bytes other than 0 and 1"),
    "tensor_data_str": (WeightsChunk, ["policy", 1, 0, 1, {"t": ["int8", [1], "a"]}],
                        "tensor data must be bin or a frame index"),
    # multi-turn episodes (version 5)
    "loss_mask_length": (Rollout, rollout_values(loss_mask=["uint8", [4], b"\1\1\0\1"]),
                         "Rollout: completion_token_ids has 5 tokens but loss_mask has 4"),
    "loss_mask_dtype": (Rollout, rollout_values(loss_mask=["bool", [5], b"\1" * 5]),
                        "Rollout.loss_mask: dtype 'bool' is not one of"),
    "env_reward_str": (Rollout, rollout_values(env_reward="1.0"), "Rollout.env_reward: expected float"),
    "num_turns_above": (Rollout, rollout_values(num_turns=1025), "Rollout.num_turns: 1025 is outside"),
    "max_turns_zero": (Work, [[[1, [5], 2, 0, [], "", 0, False, 0]]], "Work.items[0].max_turns: 0 is outside"),
    "observation_nan_reward": (EnvObservation, [1, 2, "x", None, False, math.nan], "EnvObservation: reward must be finite"),
    "observation_inf_reward": (EnvObservation, [1, 2, "x", None, True, math.inf], "EnvObservation: reward must be finite"),
    "observation_token_id": (EnvObservation, [1, 2, "", [1, -1]], "EnvObservation.token_ids: expected `int` >= 0"),
    "observation_too_many_tokens": (EnvObservation, [1, 2, "", [0] * 65537], "EnvObservation.token_ids: expected `array` of length <= 65536"),
    "observation_info_list": (EnvObservation, [1, 2, "", None, False, None, {"k": [1]}],
                              "EnvObservation.info['k']: expected a scalar"),
    "env_error_reason": (EnvError, [1, 2, 500, "t", "env_exploded"], "EnvError.reason: 'env_exploded' is not one of"),
    "env_reset_sample_id": (EnvReset, [1, 2, 3, (1 << 20) + 1, "t", "p"], "EnvReset.sample_id"),
    "env_step_action_type": (EnvStep, [1, 2, 5], "EnvStep.action: expected str, got int"),
    "env_close_negative": (EnvClose, [-1], "EnvClose.episode_id: -1 is outside"),
}


@pytest.mark.parametrize("case", BAD_FIELDS)
def test_bad_fields_name_kind_and_field(case):
    cls, values, where = BAD_FIELDS[case]
    err = expect(raw(cls, values), ErrorCode.BAD_FIELD, where)
    assert err.kind == cls.__name__


def test_error_carries_the_field_path():
    err = expect(raw(Work, [[[1, [5], 2, 0, [1.0, 1.0, -1]]]]), ErrorCode.BAD_FIELD, "Work.items[0]")
    assert (err.kind, err.field) == ("Work", "items[0].sampling.top_k")


@pytest.mark.parametrize("frames, code, where", [
    ([TR], ErrorCode.BAD_FRAME, "message has 1 frames"),
    ([TR, b"\x90"], ErrorCode.BAD_FRAME, "header: expected 4 bytes"),
    ([TR + b"\x3c\x00", b"\x91\x01"], ErrorCode.BAD_FRAME, "header: expected 4 bytes"),
    ([b"", b"\x91\x01"], ErrorCode.BAD_FRAME, "header"),
    ([b"XX\x02\x3c", b"\x91\x01"], ErrorCode.BAD_FRAME, "starting with b'TR'"),
    ([NEWER + b"\x3c", b"\x91\x01"], ErrorCode.VERSION_MISMATCH, f"protocol version {PROTOCOL_VERSION + 1}"),
    ([b"TR\x00\x3c", b"\x91\x01"], ErrorCode.VERSION_MISMATCH, "protocol version 0"),
    ([TR + b"\xff", b"\x91\x01"], ErrorCode.UNKNOWN_KIND, "unknown message kind 255"),
    ([TR + b"\x00", b"\x91\x01"], ErrorCode.UNKNOWN_KIND, "unknown message kind 0"),
    ([TR + b"\x3c", b"\xc1"], ErrorCode.BAD_FIELD, "Heartbeat: body is not valid MessagePack"),
    ([TR + b"\x3c", b"\x91"], ErrorCode.BAD_FIELD, "Heartbeat: body is not valid MessagePack"),
    ([TR + b"\x3c", b"\x91\x01\x01"], ErrorCode.BAD_FIELD, "Heartbeat: body is not valid MessagePack"),
    ([TR + b"\x3c", b"\x91\xa2\xff\xfe"], ErrorCode.BAD_FIELD, "Heartbeat: body is not valid MessagePack"),
    ([TR + b"\x3c", b"\x91" * 5000 + b"\x01"], ErrorCode.BAD_FIELD, "Heartbeat"),
    ([TR + b"\x3c", b"\x91\xdd\xff\xff\xff\xff"], ErrorCode.BAD_FIELD, "Heartbeat: body is not valid"),
    ([TR + b"\x3c", b"\x81\x01\x01"], ErrorCode.BAD_FIELD, "Heartbeat: body is not valid"),  # int map key
    ([TR + b"\x3c", b"\x91\x01", b"extra"], ErrorCode.BAD_FRAME, "Heartbeat: 1 tensor frames but the message has no"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_frames(frames, code, where):
    expect(frames, code, where)


def test_msgpack_extension_types_are_rejected():
    ext = msgpack.packb([msgpack.ExtType(5, b"payload")])
    expect([header(Heartbeat), ext], ErrorCode.BAD_FIELD, "extension type 5")
    stamp = msgpack.packb([1, msgpack.Timestamp(1, 0)], datetime=False)  # ext -1, the timestamp type
    expect([header(Heartbeat), stamp], ErrorCode.BAD_FIELD, "Heartbeat.wall_s: expected float, got Timestamp")
    stamp_scalar = msgpack.packb([1, "t", "p", "c", {"when": msgpack.Timestamp(1, 0)}])
    expect([header(ScoreRequest), stamp_scalar], ErrorCode.BAD_FIELD, "ScoreRequest.metadata['when']")


def test_frame_references():
    big = rollout(400, 5)
    frames = encode(big)
    values = msgpack.unpackb(frames[1])
    assert values[2][2] == 2 and len(frames) == 3
    out_of_range = rollout_values(prompt_token_ids=["int32", [400], 3])
    expect([frames[0], msgpack.packb(out_of_range), frames[2]], ErrorCode.BAD_FRAME,
           "Rollout.prompt_token_ids: frame index 3 is out of range")
    expect([frames[0], msgpack.packb(rollout_values(prompt_token_ids=["int32", [400], 1])), frames[2]],
           ErrorCode.BAD_FRAME, "frame index 1")
    expect([frames[0], msgpack.packb(rollout_values(prompt_token_ids=["int32", [400], 0])), frames[2]],
           ErrorCode.BAD_FRAME, "frame index 0")
    reused = list(values)
    reused[3] = ["int32", [400], 2]  # completion_token_ids claims the prompt's frame too
    expect([frames[0], msgpack.packb(reused), frames[2]], ErrorCode.BAD_FRAME,
           "Rollout.completion_token_ids: frame index 2 is out of range or used twice")
    expect([*frames, b"unreferenced"], ErrorCode.BAD_FRAME, "Rollout: 2 tensor frames but 1 referenced")
    expect([frames[0], frames[1], frames[2][:-1]], ErrorCode.BAD_FRAME, "Rollout.prompt_token_ids: frame 2 has 1599")
    expect(frames[:2], ErrorCode.BAD_FRAME, "frame index 2 is out of range")


def test_size_limits():
    frames = encode(rollout(400, 5))
    assert len(frames) == 3
    expect(frames, ErrorCode.TOO_LARGE, "Rollout: frame 2 has 1600 bytes, over the limit 1000",
           Limits(max_frame_bytes=1000))
    expect(frames, ErrorCode.TOO_LARGE, "Rollout: body of", Limits(max_body_bytes=100))
    expect(frames, ErrorCode.TOO_LARGE, "over the message limit 1500", Limits(max_message_bytes=1500))
    expect(frames, ErrorCode.BAD_FRAME, "message has 3 frames; expected 2..2", Limits(max_frames=2))
    assert_same(rollout(400, 5), decode(frames, Limits(max_frame_bytes=1600, max_message_bytes=2000)))
    with pytest.raises(ValueError, match="Limits.max_frames"):
        Limits(max_frames=0)


def test_peek_header_reads_only_frame_zero():
    assert peek_header(TRV + b"\x14") == (PROTOCOL_VERSION, 20)
    assert peek_header(zmq.Frame(b"TR\x07\xff")) == (7, 255)  # any version and kind: the caller decides
    for bad in (TRV, b"tr\x02\x14", TRV + b"\x14\x00"):
        with pytest.raises(ProtocolError) as info:
            peek_header(bad)
        assert info.value.code == ErrorCode.BAD_FRAME


def test_huge_counts_are_refused_before_allocation():
    """12 million empty arrays (about 12 MB, inside the body limit) cost a schema-less decoder seconds
    and a gigabyte; against the schema they are refused at the first array that is too long or mistyped,
    whether they are the body, a field's list or a map's value."""
    many = msgpack.packb([[]] * 12_000_000)
    templates = [(cls, None) for cls in (Heartbeat, Hello, Rollout, ScoreRequest, Work, WeightsChunk)]
    templates += [(ScoreRequest, [1, "t", "p", "c", {"a": None}]), (Work, [[[1, None, 2]]]),
                  (WeightsChunk, ["policy", 1, 0, 1, {"t": ["int8", None, b""]}])]
    limits = Limits(max_body_bytes=16 << 20)
    for cls, template in templates:
        frames = [header(cls), msgpack.packb(template).replace(b"\xc0", many, 1)]  # the one nil: the arrays
        start = time.perf_counter()
        with pytest.raises(ProtocolError) as info:
            decode(frames, limits)
        elapsed_s = time.perf_counter() - start
        assert info.value.code == ErrorCode.BAD_FIELD and info.value.kind == cls.__name__, str(info.value)
        assert elapsed_s < 0.05, f"{cls.__name__}: refused after {elapsed_s * 1e3:.0f} ms: {info.value}"


# ---------------------------------------------------------------------------------------- safety


def test_codec_never_pickles():
    for module in (codec, importlib.import_module("tailrace.protocol.schema"),
                   importlib.import_module("tailrace.protocol._forms"),
                   importlib.import_module("tailrace.protocol.messages")):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)
                    for alias in node.names} | {node.module.split(".")[0] for node in ast.walk(tree)
                                                if isinstance(node, ast.ImportFrom) and node.module}
        assert not imported & {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}, module
        source = Path(module.__file__).read_text()
        assert "torch.load" not in source and "allow_pickle" not in source
        assert "exec(" not in source and "eval(" not in source, module  # no generated code
