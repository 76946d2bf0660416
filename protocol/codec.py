"""Encode and decode tailrace messages as ZeroMQ multipart frames (layout: protocol/SPEC.md).

    frame 0  header, 4 bytes: b"TR", protocol version (u8), message kind (u8)
    frame 1  body: MessagePack array of the message's fields in wire order
    frame 2+ tensor payloads, raw little-endian bytes, one per tensor larger than INLINE_MAX_BYTES

A tensor field is a descriptor [dtype, shape, data]: data is the bytes (bin) when the tensor has at most
INLINE_MAX_BYTES, else the index (>= 2) of its frame. `peek_header` dispatches on frame 0 without touching
the body. Decoding is strict and bounded: msgspec decodes the body against the message's schema
(protocol/schema.py), checking every length before it allocates and every bound; tensor descriptors are
then checked against their field and turned into tensors. Anything wrong raises ProtocolError naming the
message kind and field. Never pickle, never generated code. Hello and Reject keep their framing in every
protocol version: `decode_any_version` and `encode_reject` let a peer of one version tell one of another
why it is refused (SPEC.md, "Versions").
Test: pytest tests/protocol/test_codec.py; speed: python tools/bench.py protocol
"""

from __future__ import annotations

import ctypes
import dataclasses
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import msgpack
import msgspec

from tailrace.protocol import messages  # noqa: F401  (registers every message class)
from tailrace.protocol._forms import Form, Invalid, Spec, form_of
from tailrace.protocol.messages import PROTOCOL_VERSION, ErrorCode, Hello, HelloPrefix, Reject
from tailrace.protocol.schema import DTYPES, MAX_NDIM, MAX_SPAN, MESSAGE_CLASSES, ProtocolError, explain

__all__ = ["DTYPES", "HEADER_BYTES", "INLINE_MAX_BYTES", "Limits", "ProtocolError", "decode", "decode_any_version",
           "encode", "encode_reject", "peek_header"]

MAGIC = b"TR"
HEADER_BYTES = 4
INLINE_MAX_BYTES = 1024
"""Tensors of at most this many bytes travel inside the body (as MessagePack bin), larger ones as
their own zero-copy frame."""

assert sys.byteorder == "little", "tensor frames are little-endian; big-endian hosts are not supported"

# Decoded tensors view the received frames, which torch sees as read-only; it warns once otherwise.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Size limits applied before a body is parsed. Bytes unless named otherwise."""

    max_frame_bytes: int = 1 << 30
    max_message_bytes: int = 1 << 31
    max_frames: int = 1 << 16
    max_body_bytes: int = 64 << 20
    max_handshake_bytes: int = 64 << 10
    """Bytes of a whole message from a peer that has no session yet (it may send only a Hello): refused
    before any frame is copied or parsed (see protocol/_server.py)."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"Limits.{f.name} must be >= 1, got {getattr(self, f.name)}")


DEFAULT_LIMITS = Limits()

_HEADER_OF: dict[type, bytes] = {cls: MAGIC + bytes((PROTOCOL_VERSION, kind)) for kind, cls in MESSAGE_CLASSES.items()}
_CLASS_OF: dict[bytes, type] = {header: cls for cls, header in _HEADER_OF.items()}


def _buffer_of(frame: Any) -> Any:
    """Bytes-like view of a frame: bytes as they are, zmq.Frame via .buffer, anything else as bytes."""
    if type(frame) is bytes:
        return frame
    buffer = getattr(frame, "buffer", None)  # zmq.Frame
    return memoryview(frame).cast("B") if buffer is None else buffer


def _nbytes(frame: Any) -> int:
    if type(frame) is bytes or hasattr(type(frame), "bytes"):  # bytes, zmq.Frame: len() counts bytes
        return len(frame)
    return memoryview(frame).nbytes


def _header_bytes(frame: Any) -> bytes:
    """Frame 0 as bytes when it has the header's size, else b"" (never copies a large frame)."""
    if type(frame) is bytes:
        return frame
    if _nbytes(frame) != HEADER_BYTES:
        return b""
    return frame.bytes if hasattr(type(frame), "bytes") else bytes(memoryview(frame).cast("B"))


def peek_header(frame: Any) -> tuple[int, int]:
    """Return (protocol_version, kind) from a header frame; ProtocolError if it is not one."""
    size = _nbytes(frame)
    head = bytes(_buffer_of(frame)[:HEADER_BYTES])
    if size != HEADER_BYTES or head[:2] != MAGIC:
        raise ProtocolError(f"header: expected {HEADER_BYTES} bytes starting with b'TR', got {size} bytes "
                            f"starting with {head[:2]!r}", code=ErrorCode.BAD_FRAME)
    return head[2], head[3]


# ---------------------------------------------------------------------------------------- tensors

_torch: Any = None  # the torch module once a tensor has been seen; reward servers never import it
_frombuffer: Any = None
_TORCH_DTYPE: dict[str, Any] = {}
_TORCH_NAME: dict[Any, str] = {}
_INLINE_1D: dict[str, tuple[int, Any]] = {}  # the decoder's fast path: every dtype but bool (0/1 check)


def _import_torch() -> Any:
    global _torch, _frombuffer
    if _torch is None:
        import torch

        _TORCH_DTYPE.update({name: getattr(torch, name) for name in DTYPES})
        _TORCH_NAME.update({dtype: name for name, dtype in _TORCH_DTYPE.items()})
        _INLINE_1D.update({name: (DTYPES[name], dtype) for name, dtype in _TORCH_DTYPE.items() if name != "bool"})
        _frombuffer = torch.frombuffer
        _torch = torch
    return _torch


def _unsupported(name: str) -> ValueError:
    return ValueError(f"dtype {name} cannot travel on the wire; supported: {sorted(DTYPES)}")


class _Encoding:
    """Collects the tensor frames of one message while its fields are encoded."""

    __slots__ = ("frames", "inline_max_bytes")

    def __init__(self, header: bytes, inline_max_bytes: int):
        self.frames: list[Any] = [header, b""]
        self.inline_max_bytes = inline_max_bytes

    def tensor(self, value: Any) -> list:
        """Descriptor [dtype, shape, data] for a torch tensor or numpy array; large payloads become a
        frame that views the tensor's memory when it is contiguous on the CPU (else a copy)."""
        torch = _torch or ("torch" in sys.modules and _import_torch())
        if torch and type(value) is torch.Tensor and value.is_cpu and value.is_contiguous():
            # The hot path: one pointer read for small tensors, no torch op dispatch.
            name = _TORCH_NAME.get(value.dtype)
            if name is None:
                raise _unsupported(str(value.dtype).removeprefix("torch."))
            nbytes = value.nbytes
            if nbytes <= self.inline_max_bytes:
                return [name, value.shape, ctypes.string_at(value.data_ptr(), nbytes) if nbytes else b""]
            self.frames.append(value.detach().reshape(-1).view(torch.uint8).numpy())
            return [name, value.shape, len(self.frames) - 1]
        if torch and isinstance(value, torch.Tensor):
            if value.layout is not torch.strided:
                raise ValueError(f"only dense tensors travel on the wire, got layout {value.layout}")
            plain = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
            return self.tensor(plain.as_subclass(torch.Tensor) if type(plain) is not torch.Tensor else plain)
        import numpy as np

        if not isinstance(value, np.ndarray | np.generic):
            raise TypeError(f"expected a torch.Tensor or numpy.ndarray, got {type(value).__name__}")
        array = np.asarray(value)
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("<"))
        name = array.dtype.name
        if name not in DTYPES or name == "bfloat16":
            raise _unsupported(name)
        if array.nbytes <= self.inline_max_bytes:
            return [name, array.shape, array.tobytes()]
        self.frames.append(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
        return [name, array.shape, len(self.frames) - 1]


class _Decoding:
    """Turns the tensor descriptors of one message into tensors, checking the frames they use."""

    __slots__ = ("frames", "used")

    def __init__(self, frames: Any):
        self.frames = frames
        self.used: set[int] = set()

    def array(self, desc: Any, spec: Spec) -> Any:
        if _frombuffer is None:  # here, not in __init__: messages without tensors never import torch
            _import_torch()
        # Fast path, the common case of small 1-d tensors inline: accepts a subset of what the full
        # path does (same dtype, rank, count and byte checks), and builds the same tensor.
        name, shape, data = desc.dtype, desc.shape, desc.data
        if spec.one_dim and type(data) is bytes and len(shape) == 1 and name in spec.dtypes:
            inline = _INLINE_1D.get(name)  # (bytes per element, torch dtype); bool is not here
            count = shape[0]
            if inline is not None and 0 < count <= spec.max_count and len(data) == count * inline[0]:
                return _frombuffer(bytearray(data), dtype=inline[1])  # writable copy
        return self._tensor(name, shape, _count(name, shape, spec), data)

    def _tensor(self, name: str, shape: list[int], count: int, data: Any) -> Any:
        nbytes = count * DTYPES[name]
        if type(data) is bytes:
            if len(data) != nbytes:
                raise Invalid(f"{len(data)} bytes for {name}{shape} (needs {nbytes})")
            buf = bytearray(data)  # small: a writable copy, so the tensor may be modified in place
        elif type(data) is int:
            if not 2 <= data < len(self.frames) or data in self.used:
                raise Invalid(f"frame index {data} is out of range or used twice (message has "
                              f"{len(self.frames)} frames)", code=ErrorCode.BAD_FRAME)
            self.used.add(data)
            buf = _buffer_of(self.frames[data])
            if len(buf) != nbytes:
                raise Invalid(f"frame {data} has {len(buf)} bytes for {name}{shape} (needs {nbytes})",
                              code=ErrorCode.BAD_FRAME)
        else:
            raise Invalid(f"tensor data must be bin or a frame index, got {type(data).__name__}")
        dtype = _TORCH_DTYPE[name]
        if nbytes == 0:
            return _torch.empty(shape, dtype=dtype)
        if name == "bool" and (buf.translate(None, b"\0\1") if type(buf) is bytearray
                               else _frombuffer(buf, dtype=_torch.uint8).max().item() > 1):
            raise Invalid("bool tensor holds bytes other than 0 and 1")
        tensor = _frombuffer(buf, dtype=dtype)
        return tensor if len(shape) == 1 else tensor.view(shape)


def _count(name: str, shape: list[int], spec: Spec) -> int:
    """Element count of a descriptor's dtype and shape, checked against the field's spec before any
    memory is touched."""
    if name not in spec.dtypes:
        raise Invalid(f"dtype {name!r} is not one of {sorted(spec.dtypes)}")
    ndim = spec.ndim
    if (ndim is not None and len(shape) != ndim) or len(shape) > MAX_NDIM:
        raise Invalid(f"shape {shape!r} must have {ndim if ndim is not None else f'<= {MAX_NDIM}'} dimensions")
    count = span = 1
    for d in shape:
        if d < 0:
            raise Invalid(f"bad shape {shape!r}: dimensions are non-negative ints")
        count *= d
        span *= d or 1  # an empty tensor still needs strides that fit in int64
    if span > MAX_SPAN:
        raise Invalid(f"shape {shape!r} is too large (product of non-zero dimensions over 2^53)")
    if count > spec.max_count:
        raise Invalid(f"{count} elements exceed the maximum {spec.max_count}")
    return count


# ---------------------------------------------------------------------------------------- encode

_local = threading.local()  # one Encoder per thread


def _to_wire_scalar(obj: Any) -> Any:
    """msgspec `enc_hook`: numpy scalars (np.float32(0.5), np.int64(3)) become Python ones. Tensors
    never get here: their fields are descriptors before msgspec sees them."""
    item = getattr(obj, "item", None)
    if item is not None and type(obj).__module__ == "numpy" and getattr(obj, "ndim", None) == 0:
        return item()
    raise TypeError(f"cannot encode a {type(obj).__name__}")


def _encoder() -> msgspec.msgpack.Encoder:
    try:
        return _local.encoder
    except AttributeError:
        _local.encoder = msgspec.msgpack.Encoder(enc_hook=_to_wire_scalar)
        return _local.encoder


def _failed(msg: Any, values: Any, exc: Exception) -> TypeError:
    """Name the field that could not be encoded (re-encodes field by field: errors only)."""
    kind = type(msg).__name__
    encoder = _encoder()
    for name, value in zip(type(msg).__struct_fields__, values, strict=True):
        try:
            encoder.encode(value)
        except (TypeError, ValueError, OverflowError) as field_exc:
            return TypeError(f"{kind}.{name}: {field_exc}")
    return TypeError(f"{kind}: {exc}")


def encode(msg: Any, *, inline_max_bytes: int = INLINE_MAX_BYTES) -> list[Any]:
    """Frames for one message: [header, body, *tensor buffers]. Tensor buffers are views of the
    caller's tensors (zero-copy): do not modify a tensor until its send has completed."""
    cls = type(msg)
    header = _HEADER_OF.get(cls)
    if header is None:
        raise TypeError(f"{cls.__name__} is not a registered message")
    form = _FORMS[cls]
    if form.to_wire is None:
        frames, values = [header, b""], msg
    else:
        encoding = _Encoding(header, inline_max_bytes)
        frames, values = encoding.frames, form.to_wire(msg, encoding)
    try:
        frames[1] = _encoder().encode(values)
    except (TypeError, ValueError, OverflowError) as exc:
        fields = [getattr(msg, name) for name in cls.__struct_fields__] if values is msg else values
        raise _failed(msg, fields, exc) from None
    return frames


# ---------------------------------------------------------------------------------------- decode

_FORMS: dict[type, Form] = {cls: form_of(cls) for cls in MESSAGE_CLASSES.values()}
EXPLAIN_MAX_BYTES = 64 << 10
"""A refused body up to this size is parsed again to say exactly what is wrong: without a schema (so that
what is not MessagePack at all, such as bad UTF-8, a non-str map key or an extension, is called so) and
along msgspec's error path. Larger ones never are: parsing them again could cost what the schema saved;
their error texts are msgspec's own, with field names."""


def _ext_rejected(code: int, data: bytes) -> Any:
    raise ValueError(f"MessagePack extension type {code} is not part of the protocol")


def _not_msgpack(kind: str, exc: Exception) -> ProtocolError:
    return ProtocolError(f"{kind}: body is not valid MessagePack ({type(exc).__name__}: {exc})",
                         code=ErrorCode.BAD_FIELD, kind=kind)


def _refused(cls: type, body: Any, exc: msgspec.ValidationError) -> ProtocolError:
    small = _nbytes(body) <= EXPLAIN_MAX_BYTES
    if small:
        try:
            msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_ext_rejected)
        except Exception as parse_exc:  # msgpack raises several unrelated types for malformed input
            return _not_msgpack(cls.__name__, parse_exc)
    try:
        return explain(cls, _FORMS[cls].wire_type, body if small else None, exc, ErrorCode.BAD_FIELD)
    except Exception:  # explain could not follow the path: msgspec's own words still name it
        return ProtocolError(f"{cls.__name__}: {exc}", code=ErrorCode.BAD_FIELD, kind=cls.__name__)


def _header_class(frame: Any) -> type:
    cls = _CLASS_OF.get(_header_bytes(frame))
    if cls is not None:
        return cls
    version, kind = peek_header(frame)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} is not supported; this peer speaks {PROTOCOL_VERSION}",
                            code=ErrorCode.VERSION_MISMATCH)
    raise ProtocolError(f"unknown message kind {kind}", code=ErrorCode.UNKNOWN_KIND)


def _check_sizes(frames: Any, cls: type, limits: Limits) -> None:
    sizes = [len(f) if type(f) is bytes else _nbytes(f) for f in frames]
    if max(sizes) <= limits.max_frame_bytes and sizes[1] <= limits.max_body_bytes \
            and sum(sizes) <= limits.max_message_bytes:
        return
    kind = cls.__name__
    for i, size in enumerate(sizes):
        if size > limits.max_frame_bytes:
            raise ProtocolError(f"{kind}: frame {i} has {size} bytes, over the limit {limits.max_frame_bytes}",
                                code=ErrorCode.TOO_LARGE, kind=kind)
    if sizes[1] > limits.max_body_bytes:
        raise ProtocolError(f"{kind}: body of {sizes[1]} bytes over the limit {limits.max_body_bytes}",
                            code=ErrorCode.TOO_LARGE, kind=kind)
    raise ProtocolError(f"{kind}: {sum(sizes)} bytes over the message limit {limits.max_message_bytes}",
                        code=ErrorCode.TOO_LARGE, kind=kind)


def decode(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode and validate one message from its frames (bytes, memoryviews or zmq.Frame objects).
    Tensors over INLINE_MAX_BYTES view their frame's memory (read-only: clone before writing)."""
    num_frames = len(frames)
    if not 2 <= num_frames <= limits.max_frames:
        raise ProtocolError(f"message has {num_frames} frames; expected 2..{limits.max_frames}",
                            code=ErrorCode.BAD_FRAME)
    head = frames[0]
    cls = _CLASS_OF.get(head) if type(head) is bytes else None
    if cls is None:
        cls = _header_class(head)
    _check_sizes(frames, cls, limits)
    form = _FORMS[cls]
    if form.to_message is None and num_frames != 2:
        raise ProtocolError(f"{cls.__name__}: {num_frames - 2} tensor frames but the message has no tensors",
                            code=ErrorCode.BAD_FRAME, kind=cls.__name__)
    buffer = _buffer_of(frames[1])
    try:
        values = form.decoder.decode(buffer)
    except msgspec.ValidationError as exc:
        raise _refused(cls, buffer, exc) from None
    except Exception as exc:  # DecodeError for malformed input, RecursionError for deep nesting
        raise _not_msgpack(cls.__name__, exc) from None
    if form.to_message is None:
        return values
    ctx = _Decoding(frames)
    kind = cls.__name__
    try:
        msg = form.to_message(values, ctx)
    except Invalid as exc:
        path = exc.field_path()
        raise ProtocolError(f"{kind}.{path}: {exc.text}" if path else f"{kind}: {exc.text}", code=exc.code,
                            kind=kind, field=path) from None
    except (TypeError, ValueError, OverflowError, RuntimeError, MemoryError) as exc:  # __post_init__, torch
        raise ProtocolError(f"{kind}: {exc}", code=ErrorCode.BAD_FIELD, kind=kind) from None
    if len(ctx.used) != num_frames - 2:
        raise ProtocolError(f"{kind}: {num_frames - 2} tensor frames but {len(ctx.used)} referenced",
                            code=ErrorCode.BAD_FRAME, kind=kind)
    return msg


# ---------------------------------------------------------------------------------------- other versions

_ANY_VERSION = {Hello.KIND: msgspec.msgpack.Decoder(HelloPrefix), Reject.KIND: msgspec.msgpack.Decoder(Reject)}


def encode_reject(reject: Reject, version: int) -> list[bytes]:
    """Frames of a Reject under protocol version `version`'s header: the answer to a Hello of that version,
    which the peer can read whatever its version (a Reject's framing never changes)."""
    if not 0 <= version <= 255:
        raise ValueError(f"version must be a byte, got {version}")
    return [MAGIC + bytes((version, Reject.KIND)), encode(reject)[1]]


def decode_any_version(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> tuple[int, Any]:
    """(protocol version, message) of a Hello or Reject under any version's header, read by the framing
    every version shares: a Reject whole, a Hello as its HelloPrefix (later fields ignored). ProtocolError
    for any other message, or a body that does not fit."""
    if len(frames) != 2:
        raise ProtocolError(f"message has {len(frames)} frames; a Hello or Reject has 2", code=ErrorCode.BAD_FRAME)
    version, kind = peek_header(frames[0])
    decoder = _ANY_VERSION.get(kind)
    if decoder is None:
        raise ProtocolError(f"kind {kind} of protocol version {version} is not a Hello or Reject",
                            code=ErrorCode.VERSION_MISMATCH)
    name = decoder.type.__name__
    if _nbytes(frames[1]) > limits.max_body_bytes:
        raise ProtocolError(f"{name}: body over the limit {limits.max_body_bytes}", code=ErrorCode.TOO_LARGE,
                            kind=name)
    try:
        return version, decoder.decode(_buffer_of(frames[1]))
    except Exception as exc:  # ValidationError, DecodeError, RecursionError: all mean a body that does not fit
        raise ProtocolError(f"{name} of protocol version {version}: {exc}", code=ErrorCode.BAD_FIELD,
                            kind=name) from None
