"""Building blocks of protocol/messages.py on msgspec, and the names msgspec's errors get on the wire.

A message is a frozen msgspec `Struct(array_like=True)`: a MessagePack array of its fields in wire order,
decoded strictly in C with every bound (`Meta(ge=, le=, max_length=)`) checked before anything is
allocated. `@message(kind)` and `@struct` register the classes; `Array` marks a tensor field, whose
`TensorSpec` the codec checks. `explain` turns a msgspec ValidationError (paths like `$[3][0]`) into a
ProtocolError naming the message kind and field, e.g. `Work.items[0].prompt_token_ids[1]: -3 is outside
[0, 16777216]`. Test: pytest tests/protocol/test_codec.py
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import struct as _struct
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

__all__ = [
    "Array", "DTYPES", "MAX_NDIM", "MAX_SPAN", "MESSAGE_CLASSES", "STRUCT_CLASSES", "Int64", "Key",
    "ProtocolError", "Scalar", "TensorDescriptor", "TensorSpec", "Text", "UInt", "WireStruct", "explain",
    "hints", "is_struct", "message", "optional_of", "split", "struct",
]

# Bounds for fields that name none of their own: enough for real traffic, small enough that one message
# cannot make a peer allocate without limit.
DEFAULT_MAX_STR = 1 << 20
MAX_KEY_LEN = 1024
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

DTYPES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
"""Tensor element types that may travel on the wire (name on the wire -> bytes per element)."""
MAX_NDIM = 8
MAX_SPAN = 1 << 53  # bound on the product of a tensor's non-zero dimensions

Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
UInt = Annotated[int, Meta(ge=0, le=INT64_MAX)]
Text = Annotated[str, Meta(max_length=DEFAULT_MAX_STR)]
Key = Annotated[str, Meta(max_length=MAX_KEY_LEN)]
"""A map key on the wire."""
Scalar = Int64 | float | Text | bool | None

MESSAGE_CLASSES: dict[int, type] = {}
"""Message kind code -> message class, filled by @message."""
STRUCT_CLASSES: list[type] = []
"""Nested wire structures, filled by @struct."""


class ProtocolError(ValueError):
    """A frame or field that breaks protocol/SPEC.md. The message names the message kind and field."""

    def __init__(self, text: str, *, code: int = 400, kind: str = "", field: str = ""):
        super().__init__(text)
        self.code = code
        self.kind = kind
        self.field = field


class WireStruct(msgspec.Struct, array_like=True, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every message and structure: an array of its fields in wire order; trailing fields with
    defaults may be omitted, extra ones are refused."""


class Array:
    """Marker type for a tensor field (torch.Tensor when decoded; torch tensors or numpy arrays are
    encoded). Travels as a TensorDescriptor; annotate it with a TensorSpec:
    `Annotated[Array, TensorSpec(dtypes=("float32",), ndim=1)]`."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What a tensor field promises: allowed dtypes (None: any), rank (None: any up to MAX_NDIM) and a
    limit on its element count."""

    dtypes: tuple[str, ...] | None = None
    ndim: int | None = None
    max_len: int | None = None


class TensorDescriptor(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A tensor as it travels: [dtype, shape, data], data the bytes inline or the index of its frame.
    Bounded here so that decoding allocates little; checked against the field's TensorSpec by the codec."""

    dtype: Annotated[str, Meta(max_length=64)]
    shape: Annotated[list[int], Meta(max_length=64)]
    data: bytes | int


def struct(cls: type) -> type:
    """Register a nested wire structure (encoded as an array of its fields, like a message body)."""
    STRUCT_CLASSES.append(cls)
    return cls


def message(kind: int) -> Callable[[type], type]:
    """Register a message class under its one-byte kind code (see protocol/SPEC.md)."""
    def register(cls: type) -> type:
        if not 1 <= kind <= 255:
            raise ValueError(f"message kind {kind} is outside 1..255")
        if kind in MESSAGE_CLASSES:
            raise ValueError(f"message kind {kind} is used by {MESSAGE_CLASSES[kind].__name__}")
        cls.KIND = kind
        MESSAGE_CLASSES[kind] = cls
        return cls
    return register


def split(tp: Any) -> tuple[Any, dict[str, Any], TensorSpec | None]:
    """(type without Annotated, its Meta bounds by name, its TensorSpec) of a field annotation."""
    bounds: dict[str, Any] = {}
    spec = None
    while typing.get_origin(tp) is Annotated:
        for extra in tp.__metadata__:
            if isinstance(extra, Meta):
                bounds.update({k: getattr(extra, k) for k in ("ge", "le", "max_length")
                               if getattr(extra, k) is not None})
            elif isinstance(extra, TensorSpec):
                spec = extra
        tp = tp.__origin__
    return tp, bounds, spec


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """Field name -> annotation (with its Annotated bounds) of a Struct class."""
    return typing.get_type_hints(cls, include_extras=True)


def is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


# ---------------------------------------------------------------------------------------- errors

_ERROR = re.compile(r"(?P<text>.*?)(?: - at `(?P<path>[^`]*)`(?: in `(?P<outer>[^`]*)`)?)?", re.S)
_RAW_LIST = msgspec.msgpack.Decoder(list[msgspec.Raw])
_RAW_MAP = msgspec.msgpack.Decoder(dict[str, msgspec.Raw])
_DESCRIPTOR_PARTS = ("dtype must be a str of at most 64 characters", "bad shape: at most 64 int dimensions",
                     "tensor data must be bin or a frame index")


def explain(cls: type, wire_type: type, body: Any, error: msgspec.ValidationError, code: int) -> ProtocolError:
    """The ProtocolError for a ValidationError from decoding a body as `wire_type` (cls's wire form).
    Walks msgspec's path through the types, naming each step; with `body` (keep it small: each step
    skips through it) also through the body as zero-copy Raw slices, to say what the value was. Without
    it, the text is msgspec's own."""
    match = _ERROR.fullmatch(str(error))
    text, on_key = match["text"], match["path"] == "key"
    steps = re.findall(r"\[(\d+|\.\.\.)\]", (match["outer"] if on_key else match["path"]) or "")
    tp, raw, where = wire_type, body, []
    try:
        for i, step in enumerate(steps):
            tp, raw, name = _step(tp, raw, step)
            where.append(name)
            if split(tp)[0] is TensorDescriptor and i + 1 < len(steps):  # inside a descriptor
                part = int(steps[i + 1])
                got = "" if raw is None else f", got {_got(_peek(_RAW_LIST.decode(raw)[part]))}"
                text = _DESCRIPTOR_PARTS[part] + got
                break
        else:
            if on_key:
                text = f"map key must be a str of at most {MAX_KEY_LEN} characters"
            elif raw is not None:
                text = _describe(tp, _peek(raw), text)
            else:
                text = text[:1].lower() + text[1:]
    except LookupError:  # a path this walk cannot follow: keep msgspec's own words
        text = text[:1].lower() + text[1:]
    except msgspec.DecodeError as exc:
        text = f"body is not valid MessagePack (DecodeError: {exc})"
        where = []
    path = "".join(where).removeprefix(".")
    kind = cls.__name__
    return ProtocolError(f"{kind}.{path}: {text}" if path else f"{kind}: {text}", code=code, kind=kind, field=path)


def _step(tp: Any, raw: Any, step: str) -> tuple[Any, Any, str]:
    """(type, raw value or None, path part) one step down from a struct, list or map."""
    base = optional_of(split(tp)[0])
    origin, args = typing.get_origin(base), typing.get_args(base)
    if is_struct(base):
        name = base.__struct_fields__[int(step)]
        return hints(base)[name], raw and _RAW_LIST.decode(raw)[int(step)], "." + name
    if origin is list:
        return args[0], raw and _RAW_LIST.decode(raw)[int(step)], f"[{step}]"
    if origin is dict and raw is None:
        return args[1], None, "[...]"
    if origin is dict:  # msgspec does not say which entry: the first whose value fails, as it decodes them
        check = msgspec.msgpack.Decoder(args[1])
        for key, value in _RAW_MAP.decode(raw).items():
            try:
                check.decode(value)
            except msgspec.ValidationError:
                return args[1], value, f"[{key[:40]!r}]"
    raise LookupError(step)


def optional_of(tp: Any) -> Any:
    """T for `T | None`; any other type as it is."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) == 1:
            return inner[0]
    return tp


def _peek(raw: Any) -> tuple[str, Any]:
    """(Python type name, value) of one MessagePack value, decoding only scalars: containers give their
    length, bin its length, an extension its type code."""
    data = memoryview(raw).cast("B")
    b = data[0]
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
        return "list", b & 0x0F if b <= 0x9F else _length(data, b == 0xDC)
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):
        return "dict", b & 0x0F if b <= 0x8F else _length(data, b == 0xDE)
    if 0xC4 <= b <= 0xC6:
        return "bytes", len(data)
    if 0xD4 <= b <= 0xD8 or 0xC7 <= b <= 0xC9:
        offset = 1 if b >= 0xD4 else {0xC7: 2, 0xC8: 3, 0xC9: 5}[b]
        return "ext", _struct.unpack_from("b", data, offset)[0]
    value = msgspec.msgpack.decode(data)  # a scalar; a str with bad UTF-8 raises DecodeError
    return type(value).__name__, value


def _length(data: memoryview, short: bool) -> int:
    return _struct.unpack_from(">H" if short else ">I", data, 1)[0]


def _got(peeked: tuple[str, Any]) -> str:
    kind, value = peeked
    if kind == "ext":
        return "Timestamp" if value == -1 else f"MessagePack extension type {value}"
    return kind


def _describe(tp: Any, peeked: tuple[str, Any], text: str) -> str:
    """Why a value of the peeked kind does not fit tp, in the words of protocol/SPEC.md."""
    base, bounds, _ = split(tp)
    kind, value = peeked
    got = _got(peeked)
    limit = bounds.get("max_length")
    if kind == "ext" and value != -1:
        return f"MessagePack extension type {value} is not part of the protocol"
    if base is int or base is float:
        if kind != "int" and (base is int or kind != "float"):
            return f"expected {base.__name__}, got {got}"
        if value != value:
            return "NaN where a bounded number is required"
        if base is int:
            return f"{value} is outside [{bounds.get('ge', INT64_MIN)}, {bounds.get('le', INT64_MAX)}]"
        return f"{float(value)!r} is outside [{bounds.get('ge', -math.inf)}, {bounds.get('le', math.inf)}]"
    if base is str or typing.get_origin(base) is Literal:
        if kind != "str":
            return f"expected str, got {got}"
        if typing.get_origin(base) is Literal:
            return f"{value!r} is not one of {sorted(typing.get_args(base))}"
        return f"length {len(value)} exceeds the maximum {limit}"
    if base is bool or base is bytes:
        return f"expected {'bool' if base is bool else 'bin'}, got {got}"
    if base is TensorDescriptor:
        return f"expected a tensor descriptor [dtype, shape, data], got {f'array of {value}' if kind == 'list' else got}"
    origin = typing.get_origin(base)
    if origin is list or origin is dict:
        noun, units = ("array", "elements") if origin is list else ("map", "entries")
        if kind != ("list" if origin is list else "dict"):
            return f"expected {noun}, got {got}"
        return f"{value} {units} exceed the maximum {limit}"
    if is_struct(base):
        num = len(base.__struct_fields__)
        required = num - len(base.__struct_defaults__)
        if kind != "list":
            return f"expected an array of {num} fields, got {got}"
        if not required <= value <= num:
            return f"expected {required}..{num} fields, got {value}"
        return text  # a cross-field check (__post_init__) with its own words
    if optional_of(base) is not base:
        return _describe(optional_of(base), peeked, text)
    if kind == "str":
        return f"string of length {len(value)} exceeds the maximum {DEFAULT_MAX_STR}"
    return f"expected a scalar (nil, bool, int, float, str), got {got}"

