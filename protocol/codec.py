"""Encode and decode tailrace messages as ZeroMQ multipart frames (layout: protocol/SPEC.md).

    frame 0  header, 4 bytes: b"TR", protocol version (u8), message kind (u8)
    frame 1  body: MessagePack array of the message's fields in wire order
    frame 2+ tensor payloads, raw bytes, one per tensor larger than INLINE_MAX_BYTES

`peek_header` dispatches on frame 0 without touching the body. Decoding is strict: every field's type
and bounds are checked and anything wrong raises ProtocolError naming the message kind and field.
Never pickle. Test: pytest tests/protocol/test_codec.py
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import msgpack

from protocol import messages  # noqa: F401  (registers every message class)
from protocol.messages import PROTOCOL_VERSION, ErrorCode
from protocol.schema import ARRAY_RESOLVER, MESSAGE_CLASSES, ProtocolError, decode_fields

__all__ = ["Limits", "ProtocolError", "decode", "encode", "peek_header", "HEADER_BYTES"]

MAGIC = b"TR"
HEADER_BYTES = 4
INLINE_MAX_BYTES = 1024
"""Tensors of at most this many bytes travel inside the body (as MessagePack bin), larger ones as
their own zero-copy frame."""

# dtype name on the wire -> (itemsize, torch attribute name, numpy name or None)
DTYPES: dict[str, tuple[int, str, str | None]] = {
    "float64": (8, "float64", "float64"),
    "float32": (4, "float32", "float32"),
    "float16": (2, "float16", "float16"),
    "bfloat16": (2, "bfloat16", None),
    "int64": (8, "int64", "int64"),
    "int32": (4, "int32", "int32"),
    "int16": (2, "int16", "int16"),
    "int8": (1, "int8", "int8"),
    "uint8": (1, "uint8", "uint8"),
    "bool": (1, "bool", "bool"),
}
MAX_NDIM = 8

assert sys.byteorder == "little", "tensor frames are little-endian; big-endian hosts are not supported"

# Decoded tensors are read-only views of the received frames; torch warns once per call otherwise.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Size limits applied before a body is parsed. Bytes unless named otherwise."""

    max_frame_bytes: int = 1 << 30
    max_message_bytes: int = 1 << 31
    max_frames: int = 1 << 16
    max_body_bytes: int = 64 << 20

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"Limits.{f.name} must be >= 1, got {getattr(self, f.name)}")


DEFAULT_LIMITS = Limits()


def _header(kind: int) -> bytes:
    return MAGIC + bytes((PROTOCOL_VERSION, kind))


_HEADERS = {kind: _header(kind) for kind in MESSAGE_CLASSES}


def _buffer_of(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame


def peek_header(frame: Any) -> tuple[int, int]:
    """Return (protocol_version, kind) from a header frame; ProtocolError if it is not one."""
    buf = _buffer_of(frame)
    if len(buf) != HEADER_BYTES or bytes(buf[:2]) != MAGIC:
        raise ProtocolError(f"header: expected {HEADER_BYTES} bytes starting with b'TR', got {len(buf)} bytes",
                            code=ErrorCode.BAD_FRAME)
    return buf[2], buf[3]


# ---------------------------------------------------------------------------------------- encode


def _tensor_payload(value: Any) -> tuple[str, list[int], Any]:
    """(dtype name, shape, contiguous uint8 buffer) for a torch tensor or numpy array, no copy when
    already contiguous on the CPU."""
    module = type(value).__module__
    if module.startswith("torch"):
        import torch

        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        name = str(t.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise ValueError(f"dtype {name} cannot travel on the wire; supported: {sorted(DTYPES)}")
        shape = list(t.shape)
        if t.numel() == 0:
            return name, shape, b""
        t = t.contiguous().reshape(-1)
        buf = t.view(torch.uint8).numpy() if t.dtype != torch.uint8 else t.numpy()
        return name, shape, buf
    import numpy as np

    a = np.asarray(value)
    name = a.dtype.name
    if name not in DTYPES or DTYPES[name][2] is None:
        raise ValueError(f"dtype {name} cannot travel on the wire; supported: {sorted(DTYPES)}")
    shape = list(a.shape)
    if a.size == 0:
        return name, shape, b""
    return name, shape, np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def encode(msg: Any, *, inline_max_bytes: int = INLINE_MAX_BYTES) -> list[Any]:
    """Frames for one message: [header, body, *tensor buffers]. Tensor buffers are views of the
    caller's tensors (zero-copy): do not modify a tensor until its send has completed."""
    kind = getattr(type(msg), "KIND", None)
    if kind is None:
        raise TypeError(f"{type(msg).__name__} is not a registered message")
    frames: list[Any] = [_HEADERS[kind], b""]

    def default(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj):
            return [getattr(obj, name) for name, _, _ in type(obj).__wire_fields__]
        if hasattr(obj, "dtype") and hasattr(obj, "shape"):
            name, shape, buf = _tensor_payload(obj)
            nbytes = buf.nbytes if hasattr(buf, "nbytes") else len(buf)
            if nbytes <= inline_max_bytes:
                return [name, shape, bytes(buf)]
            frames.append(buf)
            return [name, shape, len(frames) - 1]
        raise TypeError(f"{type(msg).__name__}: cannot encode a {type(obj).__name__}")

    frames[1] = msgpack.packb(default(msg), default=default, use_bin_type=True)
    return frames


# ---------------------------------------------------------------------------------------- decode


class _ArrayResolver:
    """Turns tensor descriptors of one message into torch tensors viewing its frames."""

    def __init__(self, frames: list[Any]):
        self.frames = frames
        self.used: set[int] = set()

    def __call__(self, desc: list, kind: str, path: str) -> Any:
        import torch

        if len(desc) != 3 or type(desc[0]) is not str or type(desc[1]) is not list:
            raise ProtocolError(f"{kind}.{path}: tensor descriptor must be [dtype, shape, data]",
                                kind=kind, field=path)
        name, shape, data = desc
        if name not in DTYPES:
            raise ProtocolError(f"{kind}.{path}: unknown dtype {name!r}", kind=kind, field=path)
        if len(shape) > MAX_NDIM or any(type(d) is not int or d < 0 for d in shape):
            raise ProtocolError(f"{kind}.{path}: bad shape {shape!r}", kind=kind, field=path)
        itemsize = DTYPES[name][0]
        nbytes = math.prod(shape) * itemsize
        if type(data) is int:
            if not 2 <= data < len(self.frames) or data in self.used:
                raise ProtocolError(f"{kind}.{path}: frame index {data} is missing or used twice",
                                    kind=kind, field=path)
            self.used.add(data)
            buf = _buffer_of(self.frames[data])
        elif type(data) is bytes:
            buf = data
        else:
            raise ProtocolError(f"{kind}.{path}: tensor data must be a frame index or bin",
                                kind=kind, field=path)
        if len(buf) != nbytes:
            raise ProtocolError(f"{kind}.{path}: {len(buf)} bytes for {name}{shape} (needs {nbytes})",
                                kind=kind, field=path)
        dtype = getattr(torch, DTYPES[name][1])
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).view(shape)


def decode(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode and validate one message from its frames (bytes, memoryviews or zmq.Frame objects)."""
    if not 2 <= len(frames) <= limits.max_frames:
        raise ProtocolError(f"message has {len(frames)} frames; expected 2..{limits.max_frames}",
                            code=ErrorCode.BAD_FRAME)
    version, kind = peek_header(frames[0])
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not supported; this peer speaks {PROTOCOL_VERSION}",
                            code=ErrorCode.VERSION_MISMATCH)
    cls = MESSAGE_CLASSES.get(kind)
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind}", code=ErrorCode.UNKNOWN_KIND)
    total = 0
    for i, frame in enumerate(frames):
        size = len(_buffer_of(frame))
        if size > limits.max_frame_bytes:
            raise ProtocolError(f"{cls.__name__}: frame {i} has {size} bytes, over the limit "
                                f"{limits.max_frame_bytes}", code=ErrorCode.TOO_LARGE, kind=cls.__name__)
        total += size
    if total > limits.max_message_bytes:
        raise ProtocolError(f"{cls.__name__}: {total} bytes over the message limit {limits.max_message_bytes}",
                            code=ErrorCode.TOO_LARGE, kind=cls.__name__)
    body = _buffer_of(frames[1])
    if len(body) > limits.max_body_bytes:
        raise ProtocolError(f"{cls.__name__}: body of {len(body)} bytes over the limit {limits.max_body_bytes}",
                            code=ErrorCode.TOO_LARGE, kind=cls.__name__)
    try:
        values = msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for malformed input
        raise ProtocolError(f"{cls.__name__}: body is not valid MessagePack ({type(exc).__name__}: {exc})",
                            code=ErrorCode.BAD_FIELD, kind=cls.__name__) from None
    resolver = _ArrayResolver(frames)
    token = ARRAY_RESOLVER.set(resolver)
    try:
        msg = decode_fields(cls, values)
    except ProtocolError as exc:
        if exc.code == 400 and exc.field:
            exc.code = ErrorCode.BAD_FIELD
        if not exc.kind:
            exc.kind = cls.__name__
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise ProtocolError(f"{cls.__name__}: {exc}", code=ErrorCode.BAD_FIELD, kind=cls.__name__) from None
    finally:
        ARRAY_RESOLVER.reset(token)
    if len(resolver.used) != len(frames) - 2:
        raise ProtocolError(f"{cls.__name__}: {len(frames) - 2} tensor frames but {len(resolver.used)} referenced",
                            code=ErrorCode.BAD_FRAME, kind=cls.__name__)
    return msg
