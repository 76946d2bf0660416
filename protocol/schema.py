"""Schema machinery behind protocol/messages.py: field declarations, strict validators, wire encoders.

`wire(...)` declares a field's bounds; `@message(kind)` and `@struct` register a dataclass and compile,
from its type annotations, one validator per field (wire value -> checked Python value) and an encoder
(object -> MessagePack-ready array of fields). messages.py holds only declarations; protocol/codec.py
calls the compiled functions. Test: pytest tests/protocol/test_codec.py
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from typing import Any

__all__ = [
    "Array",
    "DTYPES",
    "MAX_NDIM",
    "MESSAGE_CLASSES",
    "STRUCT_CLASSES",
    "ProtocolError",
    "Scalar",
    "decode_fields",
    "message",
    "struct",
    "wire",
]

# Default bounds, overridable per field: enough for real traffic, small enough that one message
# cannot make a peer allocate without limit.
DEFAULT_MAX_STR = 1 << 20
DEFAULT_MAX_LIST = 1 << 22
DEFAULT_MAX_MAP = 1 << 16
MAX_KEY_LEN = 1024
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

DTYPES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
"""Tensor element types that may travel on the wire (name on the wire -> bytes per element)."""
MAX_NDIM = 8
MAX_SPAN = 1 << 53  # bound on the product of a tensor's non-zero dimensions

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


class Invalid(Exception):
    """Raised by a validator; each enclosing struct or container prepends its part of the field path,
    so paths are only built when something is wrong. The codec turns it into a ProtocolError."""

    def __init__(self, text: str, code: int = 401):
        super().__init__(text)
        self.text = text
        self.code = code
        self.path: list[str] = []  # innermost first: [".top_k", ".sampling", "[0]", ".items"]

    def field_path(self) -> str:
        return "".join(reversed(self.path)).removeprefix(".")


class Array:
    """Marker type for a tensor field: travels as a descriptor [dtype, shape, data], where data is the
    bytes inline or the index of a frame of its own.

    Encodes torch tensors and numpy arrays; decodes to torch.Tensor (torch is imported only when a
    message with a tensor is encoded or decoded, so reward servers never need it).
    """


Scalar = int | float | str | bool | None

Validator = Callable[[Any, Any], Any]
"""check(wire_value, ctx) -> Python value; ctx turns tensor descriptors into tensors (see codec)."""
Encoder = Callable[[Any, Any], Any]
"""encode(value, ctx) -> MessagePack-ready value; ctx turns tensors into descriptors (see codec)."""


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


def _meta_of(f: dataclasses.Field) -> dict:
    meta = {"ge": None, "le": None, "max_len": None, "choices": None, "dtypes": None, "ndim": None}
    meta.update(f.metadata.get("wire", {}))
    return meta


# ---------------------------------------------------------------------------------------- validators


def _make_validator(tp: Any, meta: dict, where: str) -> Validator:
    """Return check(value, ctx) -> normalised value, raising Invalid on anything wrong."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        inner = [a for a in args if a is not type(None)]
        if tp == Scalar:
            return _check_scalar
        if type(None) in args and len(inner) == 1:
            check = _make_validator(inner[0], meta, where)
            return lambda v, ctx: None if v is None else check(v, ctx)
        raise TypeError(f"{where}: unsupported union {tp}")
    if tp is bool:
        return _check_bool
    if tp is int:
        return _int_validator(meta)
    if tp is float:
        return _float_validator(meta)
    if tp is str or tp is bytes:
        return _text_validator(tp, meta)
    if tp is Array:
        return _array_validator(meta)
    if origin is list:
        return _list_validator(args[0], meta, where)
    if origin is dict:
        return _dict_validator(args[0], args[1], meta, where)
    if dataclasses.is_dataclass(tp):
        return lambda v, ctx: tp.__wire_decode__(v, ctx)
    raise TypeError(f"{where}: unsupported wire type {tp!r}")


def _check_bool(v: Any, ctx: Any) -> bool:
    if type(v) is not bool:
        raise Invalid(f"expected bool, got {type(v).__name__}")
    return v


def _int_validator(meta: dict) -> Validator:
    lo = INT64_MIN if meta["ge"] is None else max(INT64_MIN, math.ceil(meta["ge"]))
    hi = INT64_MAX if meta["le"] is None else min(INT64_MAX, math.floor(meta["le"]))

    def check_int(v, ctx):
        if type(v) is not int:  # bool is not int here: True must not pass as 1
            raise Invalid(f"expected int, got {type(v).__name__}")
        if v < lo or v > hi:
            raise Invalid(f"{v} is outside [{lo}, {hi}]")
        return v
    return check_int


def _float_validator(meta: dict) -> Validator:
    lo, hi = meta["ge"], meta["le"]
    if lo is None and hi is None:
        def check_float(v, ctx):
            if type(v) is float:
                return v
            if type(v) is int:
                return float(v)
            raise Invalid(f"expected float, got {type(v).__name__}")
        return check_float
    lo = -math.inf if lo is None else float(lo)
    hi = math.inf if hi is None else float(hi)

    def check_bounded_float(v, ctx):
        if type(v) is not float:
            if type(v) is not int:
                raise Invalid(f"expected float, got {type(v).__name__}")
            v = float(v)  # an int that does not fit a double raises OverflowError: caught by the codec
        if not lo <= v <= hi:  # also catches NaN, which compares false with everything
            raise Invalid("NaN where a bounded number is required" if v != v else f"{v!r} is outside [{lo}, {hi}]")
        return v
    return check_bounded_float


def _text_validator(tp: type, meta: dict) -> Validator:
    limit = meta["max_len"] or DEFAULT_MAX_STR
    choices = None if meta["choices"] is None else frozenset(meta["choices"])
    tname = "str" if tp is str else "bin"

    def check_text(v, ctx):
        if type(v) is not tp:
            raise Invalid(f"expected {tname}, got {type(v).__name__}")
        if len(v) > limit:
            raise Invalid(f"length {len(v)} exceeds the maximum {limit}")
        if choices is not None and v not in choices:
            raise Invalid(f"{v!r} is not one of {sorted(choices)}")
        return v
    return check_text


def _check_scalar(v: Any, ctx: Any) -> Any:
    tp = type(v)
    if tp is str:
        if len(v) > DEFAULT_MAX_STR:
            raise Invalid(f"string of length {len(v)} exceeds the maximum {DEFAULT_MAX_STR}")
        return v
    if v is None or tp is int or tp is float or tp is bool:
        return v
    raise Invalid(f"expected a scalar (nil, bool, int, float, str), got {tp.__name__}")


def _list_validator(elem_tp: Any, meta: dict, where: str) -> Validator:
    limit = meta["max_len"] or DEFAULT_MAX_LIST
    elem_meta = dict(meta, max_len=None)
    elem = _make_validator(elem_tp, elem_meta, where)
    if elem_tp is int:
        lo = INT64_MIN if meta["ge"] is None else meta["ge"]
        hi = INT64_MAX if meta["le"] is None else meta["le"]
        int_types = {int}

        def check_int_list(v, ctx):
            if type(v) is not list:
                raise Invalid(f"expected array, got {type(v).__name__}")
            if len(v) > limit:
                raise Invalid(f"{len(v)} elements exceed the maximum {limit}")
            # One pass in C over the element types, then min/max: the per-element path is only
            # taken to name the offending element.
            if v and (set(map(type, v)) != int_types or min(v) < lo or max(v) > hi):
                for i, x in enumerate(v):
                    try:
                        elem(x, ctx)
                    except Invalid as exc:
                        exc.path.append(f"[{i}]")
                        raise
            return v
        return check_int_list

    def check_list(v, ctx):
        if type(v) is not list:
            raise Invalid(f"expected array, got {type(v).__name__}")
        if len(v) > limit:
            raise Invalid(f"{len(v)} elements exceed the maximum {limit}")
        out = []
        try:
            for x in v:
                out.append(elem(x, ctx))
        except Invalid as exc:
            exc.path.append(f"[{len(out)}]")
            raise
        return out
    return check_list


def _dict_validator(key_tp: Any, val_tp: Any, meta: dict, where: str) -> Validator:
    if key_tp is not str:
        raise TypeError(f"{where}: map keys must be str")
    limit = meta["max_len"] or DEFAULT_MAX_MAP
    val_check = _make_validator(val_tp, dict(meta, max_len=None), where)  # max_len counts entries

    def check_dict(v, ctx):
        if type(v) is not dict:
            raise Invalid(f"expected map, got {type(v).__name__}")
        if len(v) > limit:
            raise Invalid(f"{len(v)} entries exceed the maximum {limit}")
        out = {}
        for k, x in v.items():
            if type(k) is not str or len(k) > MAX_KEY_LEN:
                raise Invalid(f"map key must be a str of at most {MAX_KEY_LEN} characters, got "
                              f"{type(k).__name__} {str(k)[:40]!r}")
            try:
                out[k] = val_check(x, ctx)
            except Invalid as exc:
                exc.path.append(f"[{k[:40]!r}]")
                raise
        return out
    return check_dict


class ArraySpec:
    """What a tensor field promises: allowed dtypes, rank (None: any up to MAX_NDIM), element limit."""

    __slots__ = ("dtypes", "ndim", "max_count", "one_dim")

    def __init__(self, meta: dict):
        self.dtypes = frozenset(meta["dtypes"] or DTYPES)
        self.ndim = meta["ndim"]
        self.max_count = min(meta["max_len"] or MAX_SPAN, MAX_SPAN)
        self.one_dim = self.ndim in (None, 1)  # lets the codec take its 1-d fast path


def check_descriptor(v: Any, spec: ArraySpec) -> tuple[str, list[int], int, Any]:
    """(dtype, shape, element count, data) of a tensor descriptor [dtype, shape, data], checked against
    the field's spec before any memory is touched; the codec then checks the data and builds the tensor."""
    if type(v) is not list or len(v) != 3:
        raise Invalid(f"expected a tensor descriptor [dtype, shape, data], got {_describe_value(v)}")
    name, shape, data = v
    if type(name) is not str or name not in spec.dtypes:
        raise Invalid(f"dtype {name!r} is not one of {sorted(spec.dtypes)}")
    if type(shape) is not list:
        raise Invalid(f"shape must be an array, got {type(shape).__name__}")
    ndim = spec.ndim
    if (ndim is not None and len(shape) != ndim) or len(shape) > MAX_NDIM:
        raise Invalid(f"shape {shape!r} must have {ndim if ndim is not None else f'<= {MAX_NDIM}'} dimensions")
    count = span = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise Invalid(f"bad shape {shape!r}: dimensions are non-negative ints")
        count *= d
        span *= d or 1  # an empty tensor still needs strides that fit in int64
    if span > MAX_SPAN:
        raise Invalid(f"shape {shape!r} is too large (product of non-zero dimensions over 2^53)")
    if count > spec.max_count:
        raise Invalid(f"{count} elements exceed the maximum {spec.max_count}")
    return name, shape, count, data


class _NoTensors:
    """Decoding context outside of the codec: refuses tensor descriptors."""

    def array(self, v: Any, spec: ArraySpec) -> Any:
        raise Invalid("tensor descriptor outside of a codec decode")


_NO_TENSORS = _NoTensors()


def _array_validator(meta: dict) -> Validator:
    spec = ArraySpec(meta)
    return lambda v, ctx: ctx.array(v, spec)


def _describe_value(v: Any) -> str:
    return f"array of {len(v)}" if type(v) is list else type(v).__name__


# ---------------------------------------------------------------------------------------- encoders


def _encode_tensor(v: Any, ctx: Any) -> list:
    return ctx.tensor(v)


def _make_encoder(tp: Any) -> Encoder | None:
    """Return encode(value, ctx) for values that MessagePack cannot take as they are (tensors,
    nested structures), or None when the value is already wire-ready."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Array:
        return _encode_tensor
    if dataclasses.is_dataclass(tp):
        return lambda v, ctx: tp.__wire_encode__(v, ctx)
    if origin is list:
        elem = _make_encoder(args[0])
        return None if elem is None else (lambda v, ctx: [elem(x, ctx) for x in v])
    if origin is dict:
        val = _make_encoder(args[1])
        return None if val is None else (lambda v, ctx: {k: val(x, ctx) for k, x in v.items()})
    if origin in (types.UnionType, typing.Union) and tp != Scalar:
        inner = _make_encoder(next(a for a in args if a is not type(None)))
        return None if inner is None else (lambda v, ctx: None if v is None else inner(v, ctx))
    return None


def _struct_encoder(cls: type, names: tuple[str, ...], encoders: list) -> Encoder:
    """Generate encode(obj, ctx) -> wire array for one class: a tuple of its attributes when all are
    wire-ready, else a list with tensors and nested structures encoded."""
    kind = cls.__name__
    env = {"cls": cls, "failed": _failed_field}
    items = []
    for k, (name, enc) in enumerate(zip(names, encoders, strict=True)):
        env[f"enc{k}"] = enc
        if enc is None:
            items.append(f"obj.{name}")
        elif enc is _encode_tensor:
            items.append(f"ctx.tensor(obj.{name})")
        else:
            items.append(f"enc{k}(obj.{name}, ctx)")
    body = f"({', '.join(items)},)" if all(e is None for e in encoders) else f"[{', '.join(items)}]"
    lines = [
        "def encode_struct(obj, ctx):",
        "    if type(obj) is not cls:",
        f"        raise TypeError('{kind}: expected a {kind}, got ' + type(obj).__name__)",
        "    try:",
        f"        return {body}",
        "    except (TypeError, ValueError, AttributeError) as exc:",
        "        raise failed(obj, ctx, exc) from None",
    ]
    exec("\n".join(lines), env)  # noqa: S102  (source built from field names only)
    return env["encode_struct"]


def _failed_field(obj: Any, ctx: Any, exc: Exception) -> TypeError:
    """Name the field whose encoding raised `exc` (re-encodes field by field: errors only)."""
    cls = type(obj)
    for (name, _, _), enc in zip(cls.__wire_fields__, cls.__wire_encoders__, strict=True):
        try:
            value = getattr(obj, name)
            if enc is not None:
                enc(value, ctx)
        except (TypeError, ValueError, AttributeError) as field_exc:
            return TypeError(f"{cls.__name__}.{name}: {field_exc}")
    return TypeError(f"{cls.__name__}: {exc}")


# ---------------------------------------------------------------------------------------- structures


def _fast_guard(tp: Any, meta: dict, k: int, env: dict) -> str | None:
    """A Python condition that is False exactly when field k's full validator would return the wire
    value unchanged; the generated decoder calls the validator only when it is True (the validator
    then raises, or converts, e.g. int -> float). None: always call the validator."""
    if tp is bool:
        return "type(v) is not bool"
    if tp is int:
        env[f"lo{k}"] = INT64_MIN if meta["ge"] is None else max(INT64_MIN, math.ceil(meta["ge"]))
        env[f"hi{k}"] = INT64_MAX if meta["le"] is None else min(INT64_MAX, math.floor(meta["le"]))
        return f"type(v) is not int or v < lo{k} or v > hi{k}"
    if tp is float:
        if meta["ge"] is None and meta["le"] is None:
            return "type(v) is not float"
        env[f"lo{k}"] = -math.inf if meta["ge"] is None else float(meta["ge"])
        env[f"hi{k}"] = math.inf if meta["le"] is None else float(meta["le"])
        return f"type(v) is not float or not lo{k} <= v <= hi{k}"
    if tp is str:
        env[f"max{k}"] = meta["max_len"] or DEFAULT_MAX_STR
        if meta["choices"] is None:
            return f"type(v) is not str or len(v) > max{k}"
        env[f"choices{k}"] = frozenset(meta["choices"])
        return f"type(v) is not str or len(v) > max{k} or v not in choices{k}"
    return None


def _struct_decoder(cls: type, fields: list[tuple[str, Any, dict]], checks: tuple, num_required: int,
                    defaults: tuple) -> Validator:
    """Generate decode(values, ctx) -> cls for one class, like dataclasses generates __init__: scalar
    fields are checked inline, the rest by their validators; an Invalid gets the field's name."""
    num_fields = len(fields)
    env = {"cls": cls, "new": object.__new__, "Invalid": Invalid, "post_init": getattr(cls, "__post_init__", None),
           "dotted": tuple("." + name for name, _, _ in fields)}
    lines = [
        "def decode_struct(values, ctx):",
        "    if type(values) is not list:",
        f"        raise Invalid('expected an array of {num_fields} fields, got ' + type(values).__name__)",
        "    n = len(values)",
        f"    if n < {num_required} or n > {num_fields}:",
        f"        raise Invalid(f'expected {num_required}..{num_fields} fields, got {{n}}')",
        # Every field is validated here; filling __dict__ skips the frozen dataclass __init__ (one
        # object.__setattr__ per field), and post_init runs the same cross-field checks it would.
        "    obj = new(cls)",
        "    d = obj.__dict__",
        "    i = 0",
        "    try:",
    ]
    for k, (name, tp, meta) in enumerate(fields):
        env[f"check{k}"], env[f"default{k}"] = checks[k], defaults[k]
        guard = _fast_guard(tp, meta, k, env)
        if tp is Array:
            env[f"spec{k}"] = ArraySpec(meta)
            check = f"v = ctx.array(v, spec{k})"
        else:
            check = f"if {guard}: v = check{k}(v, ctx)" if guard else f"v = check{k}(v, ctx)"
        body = [f"i = {k}", f"v = values[{k}]", check, f"d[{name!r}] = v"]
        if k < num_required:
            lines += ["        " + line for line in body]
        else:
            lines += [f"        if n > {k}:"] + ["            " + line for line in body]
            lines += ["        else:", f"            d[{name!r}] = default{k}()"]
    lines += [
        "    except Invalid as exc:",
        "        exc.path.append(dotted[i])",
        "        raise",
        "    if post_init is not None:",
        "        try:",
        "            post_init(obj)",
        "        except ValueError as exc:",
        "            raise Invalid(str(exc)) from None",
        "    return obj",
    ]
    exec("\n".join(lines), env)  # noqa: S102  (source built above from field names and constants only)
    return env["decode_struct"]


def _compile(cls: type) -> None:
    if "__slots__" in cls.__dict__ or not cls.__dataclass_params__.init:
        raise TypeError(f"{cls.__name__}: wire classes are plain dataclasses with __dict__ and __init__")
    hints = typing.get_type_hints(cls)
    fields, checks, encoders, defaults = [], [], [], []
    for f in dataclasses.fields(cls):
        where = f"{cls.__name__}.{f.name}"
        if not f.init:
            raise TypeError(f"{where}: every field of a wire class is set by __init__")
        if f.default is not dataclasses.MISSING:
            defaults.append(lambda value=f.default: value)
        elif f.default_factory is not dataclasses.MISSING:
            defaults.append(f.default_factory)
        elif any(defaults):
            raise TypeError(f"{where}: required fields must come before optional ones")
        else:
            defaults.append(None)
        fields.append((f.name, hints[f.name], _meta_of(f)))
        checks.append(_make_validator(hints[f.name], fields[-1][2], where))
        encoders.append(_make_encoder(hints[f.name]))
    num_required = defaults.count(None)
    cls.__wire_fields__ = tuple(fields)  # (name, type, bounds) in wire order
    cls.__wire_required__ = num_required
    cls.__wire_plain__ = all(e is None for e in encoders)  # no tensors, no nested structures
    cls.__wire_decode__ = staticmethod(_struct_decoder(cls, fields, tuple(checks), num_required, tuple(defaults)))
    cls.__wire_encoders__ = tuple(encoders)
    cls.__wire_encode__ = staticmethod(_struct_encoder(cls, tuple(f[0] for f in fields), encoders))


def struct(cls: type) -> type:
    """Register a nested wire structure (encoded as an array of its fields, like a message body)."""
    _compile(cls)
    STRUCT_CLASSES.append(cls)
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


def decode_fields(cls: type, values: Any, ctx: Any = None) -> Any:
    """Build a registered class from its wire array, validating every field; ProtocolError names the
    class and field. ctx resolves tensor descriptors (the codec passes one)."""
    try:
        return cls.__wire_decode__(values, _NO_TENSORS if ctx is None else ctx)
    except Invalid as exc:
        path = exc.field_path()
        where = f"{cls.__name__}.{path}" if path else cls.__name__
        raise ProtocolError(f"{where}: {exc.text}", code=exc.code, kind=cls.__name__, field=path) from None
