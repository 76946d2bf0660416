"""Schema machinery behind protocol/messages.py: field declarations and strict validators.

`wire(...)` declares a field's bounds; `@message(kind)` and `@struct` register a dataclass and compile a
validator for every field from its type annotation. messages.py holds only declarations; the codec
(protocol/codec.py) calls the compiled validators. Test: pytest tests/protocol/test_codec.py
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any

__all__ = [
    "Array",
    "MESSAGE_CLASSES",
    "ProtocolError",
    "Scalar",
    "message",
    "struct",
    "wire",
]

# Default bounds, overridable per field: enough for real traffic, small enough that one message
# cannot make a peer allocate without limit.
DEFAULT_MAX_STR = 1 << 20
DEFAULT_MAX_LIST = 1 << 22
DEFAULT_MAX_MAP = 1 << 16
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

MESSAGE_CLASSES: dict[int, type] = {}


class ProtocolError(ValueError):
    """A frame or field that breaks protocol/SPEC.md. The message names the message kind and field."""

    def __init__(self, text: str, *, code: int = 400, kind: str = "", field: str = ""):
        super().__init__(text)
        self.code = code
        self.kind = kind
        self.field = field


class Array:
    """Marker type for a tensor field: travels as a tensor descriptor plus, when large, its own frame.

    Encodes torch tensors and numpy arrays; decodes to torch.Tensor (torch is imported only when a
    message with a tensor is decoded, so reward servers never need it).
    """


Scalar = int | float | str | bool | None


def wire(
    *,
    default: Any = dataclasses.MISSING,
    default_factory: Any = dataclasses.MISSING,
    ge: float | None = None,
    le: float | None = None,
    max_len: int | None = None,
    choices: tuple | None = None,
    dtypes: tuple[str, ...] | None = None,
    ndim: int | None = None,
) -> Any:
    """Declare a message field's bounds: ge/le for numbers (and each list element), max_len for
    str/bytes/list/dict/array element count, choices for enumerations, dtypes/ndim for arrays."""
    meta = {"ge": ge, "le": le, "max_len": max_len, "choices": choices, "dtypes": dtypes, "ndim": ndim}
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"wire": meta})


Validator = Callable[[Any, str], Any]


def _fail(kind: str, field: str, text: str) -> ProtocolError:
    return ProtocolError(f"{kind}.{field}: {text}", kind=kind, field=field)


def _number_bounds(value: Any, meta: dict, kind: str, field: str) -> None:
    if meta["ge"] is not None and value < meta["ge"]:
        raise _fail(kind, field, f"{value!r} is below the minimum {meta['ge']}")
    if meta["le"] is not None and value > meta["le"]:
        raise _fail(kind, field, f"{value!r} is above the maximum {meta['le']}")


def _make_validator(tp: Any, meta: dict, kind: str, name: str) -> Validator:
    """Return check(value, field_path) -> normalised value, raising ProtocolError on anything wrong."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        if type(None) in args and len(inner) == 1:
            check = _make_validator(inner[0], meta, kind, name)
            return lambda v, path: None if v is None else check(v, path)
        if tp == Scalar:
            return _scalar_validator(meta, kind)
        raise TypeError(f"{kind}.{name}: unsupported union {tp}")
    if tp is bool:
        def check_bool(v, path):
            if type(v) is not bool:
                raise _fail(kind, path, f"expected bool, got {type(v).__name__}")
            return v
        return check_bool
    if tp is int:
        lo = INT64_MIN if meta.get("ge") is None else meta["ge"]
        hi = INT64_MAX if meta.get("le") is None else meta["le"]
        def check_int(v, path):
            if type(v) is not int:
                raise _fail(kind, path, f"expected int, got {type(v).__name__}")
            if v < lo or v > hi:
                raise _fail(kind, path, f"{v} is outside [{lo}, {hi}]")
            return v
        return check_int
    if tp is float:
        def check_float(v, path):
            if type(v) is int:
                v = float(v)
            elif type(v) is not float:
                raise _fail(kind, path, f"expected float, got {type(v).__name__}")
            if math.isnan(v) and (meta.get("ge") is not None or meta.get("le") is not None):
                raise _fail(kind, path, "NaN where a bounded number is required")
            _number_bounds(v, meta, kind, path)
            return v
        return check_float
    if tp is str or tp is bytes:
        limit = meta.get("max_len") or DEFAULT_MAX_STR
        choices = meta.get("choices")
        def check_text(v, path):
            if type(v) is not tp:
                raise _fail(kind, path, f"expected {tp.__name__}, got {type(v).__name__}")
            if len(v) > limit:
                raise _fail(kind, path, f"length {len(v)} exceeds the maximum {limit}")
            if choices is not None and v not in choices:
                raise _fail(kind, path, f"{v!r} is not one of {list(choices)}")
            return v
        return check_text
    if tp is Array:
        return _array_validator(meta, kind)
    if origin is list:
        limit = meta.get("max_len") or DEFAULT_MAX_LIST
        elem_meta = {k: meta.get(k) for k in ("ge", "le", "choices")} | {"max_len": None}
        elem = _make_validator(args[0], elem_meta, kind, name)
        fast_int = args[0] is int
        def check_list(v, path):
            if type(v) is not list:
                raise _fail(kind, path, f"expected array, got {type(v).__name__}")
            if len(v) > limit:
                raise _fail(kind, path, f"{len(v)} elements exceed the maximum {limit}")
            if fast_int and all(type(x) is int for x in v):
                lo, hi = (min(v), max(v)) if v else (0, 0)
                if v and (
                    (elem_meta["ge"] is not None and lo < elem_meta["ge"])
                    or (elem_meta["le"] is not None and hi > elem_meta["le"])
                    or lo < INT64_MIN or hi > INT64_MAX
                ):
                    raise _fail(kind, path, f"an element is outside the bounds of the field ({lo}..{hi})")
                return v
            return [elem(x, f"{path}[{i}]") for i, x in enumerate(v)]
        return check_list
    if origin is dict:
        limit = meta.get("max_len") or DEFAULT_MAX_MAP
        key_check = _make_validator(args[0], {"max_len": 1024}, kind, name)
        val_check = _make_validator(args[1], {k: meta.get(k) for k in ("dtypes", "ndim")}, kind, name)
        def check_dict(v, path):
            if type(v) is not dict:
                raise _fail(kind, path, f"expected map, got {type(v).__name__}")
            if len(v) > limit:
                raise _fail(kind, path, f"{len(v)} entries exceed the maximum {limit}")
            return {key_check(k, path): val_check(x, f"{path}[{k!r}]") for k, x in v.items()}
        return check_dict
    if dataclasses.is_dataclass(tp):
        return lambda v, path: _decode_struct(tp, v, path)
    if tp is typing.Any:
        raise TypeError(f"{kind}.{name}: Any is not a wire type")
    raise TypeError(f"{kind}.{name}: unsupported wire type {tp!r}")


def _scalar_validator(meta: dict, kind: str) -> Validator:
    def check_scalar(v, path):
        if v is None or type(v) in (int, float, str, bool):
            if type(v) is str and len(v) > DEFAULT_MAX_STR:
                raise _fail(kind, path, "string too long")
            return v
        raise _fail(kind, path, f"expected a scalar (nil, bool, int, float, str), got {type(v).__name__}")
    return check_scalar


ARRAY_RESOLVER: contextvars.ContextVar[Callable[[Any, str, str], Any]] = contextvars.ContextVar(
    "tailrace_array_resolver"
)
"""Set by the codec while decoding: turns a tensor descriptor into a tensor using the message's frames."""


def _array_validator(meta: dict, kind: str) -> Validator:
    # On decode a field holds a descriptor [dtype, shape, data]; the codec's resolver turns it into a
    # tensor. Then we check what the field promises (dtype, rank, element count).
    dtypes, ndim, limit = meta.get("dtypes"), meta.get("ndim"), meta.get("max_len")
    def check_array(v, path):
        if type(v) is list:
            resolve = ARRAY_RESOLVER.get(None)
            if resolve is None:
                raise _fail(kind, path, "tensor descriptor outside of a decode")
            v = resolve(v, kind, path)
        dtype = getattr(v, "dtype", None)
        if dtype is None or not hasattr(v, "shape"):
            raise _fail(kind, path, f"expected a tensor, got {type(v).__name__}")
        name = str(dtype).removeprefix("torch.")
        if dtypes is not None and name not in dtypes:
            raise _fail(kind, path, f"dtype {name} is not one of {list(dtypes)}")
        if ndim is not None and len(v.shape) != ndim:
            raise _fail(kind, path, f"expected {ndim} dimensions, got shape {tuple(v.shape)}")
        if limit is not None and math.prod(v.shape) > limit:
            raise _fail(kind, path, f"{math.prod(v.shape)} elements exceed the maximum {limit}")
        return v
    return check_array


def _compile(cls: type) -> None:
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    specs = []
    num_required = 0
    for i, f in enumerate(fields):
        meta = dict(f.metadata.get("wire", {}))
        meta.setdefault("ge", None)
        meta.setdefault("le", None)
        meta.setdefault("max_len", None)
        meta.setdefault("choices", None)
        meta.setdefault("dtypes", None)
        meta.setdefault("ndim", None)
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if not has_default:
            if num_required != i:
                raise TypeError(f"{cls.__name__}.{f.name}: required fields must come before optional ones")
            num_required = i + 1
        specs.append((f.name, _make_validator(hints[f.name], meta, cls.__name__, f.name), hints[f.name]))
    cls.__wire_fields__ = tuple(specs)
    cls.__wire_required__ = num_required


def _decode_struct(cls: type, values: Any, path: str) -> Any:
    """Build `cls` from its wire array, validating every field. Trailing optional fields may be absent."""
    name = cls.__name__
    if type(values) is not list:
        raise ProtocolError(f"{name}{'.' + path if path else ''}: expected an array of fields, "
                            f"got {type(values).__name__}", kind=name, field=path)
    specs = cls.__wire_fields__
    if not cls.__wire_required__ <= len(values) <= len(specs):
        raise ProtocolError(
            f"{name}: expected {cls.__wire_required__}..{len(specs)} fields, got {len(values)}",
            kind=name, field=path,
        )
    kwargs = {}
    prefix = f"{path}." if path else ""
    for (field, check, _), value in zip(specs, values, strict=False):
        kwargs[field] = check(value, prefix + field)
    try:
        return cls(**kwargs)
    except ValueError as exc:  # cross-field checks in __post_init__
        raise ProtocolError(f"{name}: {exc}", kind=name, field=path) from exc


def struct(cls: type) -> type:
    """Register a nested wire structure (encoded as an array of its fields, like a message body)."""
    _compile(cls)
    return cls


def message(kind: int) -> Callable[[type], type]:
    """Register a message class under its one-byte kind code (see protocol/SPEC.md)."""
    def register(cls: type) -> type:
        if not 1 <= kind <= 255:
            raise ValueError(f"message kind {kind} is outside 1..255")
        if kind in MESSAGE_CLASSES:
            raise ValueError(f"message kind {kind} is used by {MESSAGE_CLASSES[kind].__name__}")
        _compile(cls)
        cls.KIND = kind
        MESSAGE_CLASSES[kind] = cls
        return cls
    return register


def decode_fields(cls: type, values: Any) -> Any:
    return _decode_struct(cls, values, "")
