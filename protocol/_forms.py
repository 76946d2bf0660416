"""Wire forms: how each message class of protocol/messages.py is decoded and encoded by msgspec.

A class without tensors is its own wire form: msgspec decodes the body straight into it. A class with
tensor fields gets a twin Struct (msgspec.defstruct, same fields and bounds) whose tensor fields are
TensorDescriptors; the codec decodes the body into the twin, turns the descriptors into tensors, checking
them against the field's TensorSpec, and only then builds the message, so that __post_init__ sees tensors.
Encoding goes the other way: tensor fields become descriptors, the rest is left to msgspec.
Private to protocol/. Test: pytest tests/protocol/test_codec.py
"""

from __future__ import annotations

import functools
import operator
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from tailrace.protocol.schema import (
    DTYPES,
    MAX_SPAN,
    Array,
    TensorDescriptor,
    TensorSpec,
    hints,
    is_struct,
    optional_of,
    split,
)

Convert = Callable[[Any, Any], Any]
"""convert(value, ctx): a wire value to a Python one (ctx: the codec's tensor decoding), or back (ctx:
the codec's tensor encoding)."""


class Invalid(Exception):
    """Raised while descriptors become tensors; each enclosing container prepends its part of the field
    path, so paths are only built when something is wrong. The codec turns it into a ProtocolError."""

    def __init__(self, text: str, code: int = 401):
        super().__init__(text)
        self.text = text
        self.code = code
        self.path: list[str] = []  # innermost first: ["['t']", ".tensors"]

    def field_path(self) -> str:
        return "".join(reversed(self.path)).removeprefix(".")


class Spec:
    """A field's TensorSpec, prepared for the decoder: dtype set, rank, element limit."""

    __slots__ = ("dtypes", "ndim", "max_count", "one_dim")

    def __init__(self, spec: TensorSpec | None):
        spec = spec or TensorSpec()
        self.dtypes = frozenset(spec.dtypes or DTYPES)
        self.ndim = spec.ndim
        self.max_count = min(spec.max_len or MAX_SPAN, MAX_SPAN)
        self.one_dim = self.ndim in (None, 1)  # lets the codec take its 1-d fast path


@dataclass(frozen=True)
class Form:
    """How one class travels. to_message/to_wire are None when the class holds no tensors."""

    wire_type: type
    decoder: msgspec.msgpack.Decoder
    to_message: Convert | None
    to_wire: Convert | None


def _inside(part: str, convert: Convert, value: Any, ctx: Any) -> Any:
    try:
        return convert(value, ctx)
    except Invalid as exc:
        exc.path.append(part)
        raise


def _annotated(new: Any, old: Any) -> Any:
    """new with old's Meta bounds (a TensorSpec stays behind: the converter holds it)."""
    metas = []
    while typing.get_origin(old) is Annotated:
        metas += [m for m in old.__metadata__ if isinstance(m, msgspec.Meta)]
        old = old.__origin__
    return Annotated[(new, *metas)] if metas else new


def _plan(tp: Any) -> tuple[Any, Convert | None, Convert | None]:
    """(wire type, decode converter, encode converter) of a field annotation; converters are None
    where no tensor is inside, and then the wire type is tp itself."""
    base, _, spec = split(tp)
    if base is Array:
        prepared = Spec(spec)
        return TensorDescriptor, (lambda v, ctx: ctx.array(v, prepared)), (lambda v, enc: enc.tensor(v))
    origin, args = typing.get_origin(base), typing.get_args(base)
    inner = args[0] if origin is list else args[1] if origin is dict else optional_of(base)
    if inner is not base:
        wire, dec, enc = _plan(inner)
        if dec is None:
            return tp, None, None
        if origin is list:
            return (_annotated(list[wire], tp),
                    lambda v, ctx: [_inside(f"[{i}]", dec, x, ctx) for i, x in enumerate(v)],
                    lambda v, e: [enc(x, e) for x in v])
        if origin is dict:
            return (_annotated(dict[args[0], wire], tp),
                    lambda v, ctx: {k: _inside(f"[{k[:40]!r}]", dec, x, ctx) for k, x in v.items()},
                    lambda v, e: {k: enc(x, e) for k, x in v.items()})
        return (_annotated(wire | None, tp), lambda v, ctx: None if v is None else dec(v, ctx),
                lambda v, e: None if v is None else enc(v, e))
    if is_struct(base):
        form = form_of(base)
        if form.to_message is not None:
            return form.wire_type, form.to_message, form.to_wire
    return tp, None, None


@functools.cache
def form_of(cls: type) -> Form:
    """The wire form of a message or structure class (see the module docstring)."""
    names = cls.__struct_fields__
    plans = [_plan(hints(cls)[name]) for name in names]
    if all(dec is None for _, dec, _ in plans):
        return Form(cls, msgspec.msgpack.Decoder(cls), None, None)
    fields = []
    for info, (wire, _, _) in zip(msgspec.structs.fields(cls), plans, strict=True):
        if info.required:
            fields.append((info.name, wire))
        elif info.default_factory is not msgspec.NODEFAULT:
            fields.append((info.name, wire, msgspec.field(default_factory=info.default_factory)))
        else:
            fields.append((info.name, wire, info.default))
    twin = msgspec.defstruct(cls.__name__, fields, array_like=True, forbid_unknown_fields=True, kw_only=True)
    values_of = operator.attrgetter(*names) if len(names) > 1 else lambda obj: (getattr(obj, names[0]),)
    decoders = [(i, "." + names[i], dec) for i, (_, dec, _) in enumerate(plans) if dec is not None]
    encoders = [(i, names[i], enc) for i, (_, _, enc) in enumerate(plans) if enc is not None]

    def to_message(obj: Any, ctx: Any) -> Any:
        values = list(values_of(obj))
        for i, part, dec in decoders:
            values[i] = _inside(part, dec, values[i], ctx)
        return cls(**dict(zip(names, values, strict=True)))  # runs __post_init__ on the tensors

    def to_wire(msg: Any, ctx: Any) -> list:
        if type(msg) is not cls:
            raise TypeError(f"{cls.__name__}: expected a {cls.__name__}, got {type(msg).__name__}")
        values = list(values_of(msg))
        for i, name, enc in encoders:
            try:
                values[i] = enc(values[i], ctx)
            except (TypeError, ValueError, AttributeError) as exc:
                raise TypeError(f"{cls.__name__}.{name}: {exc}") from None
        return values

    return Form(twin, msgspec.msgpack.Decoder(twin), to_message, to_wire)
